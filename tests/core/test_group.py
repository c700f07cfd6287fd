"""WorkerGroup formation, execution, shipping and clean-up on the shared local cluster (4 CPUs)."""

from __future__ import annotations

import os

import pytest
import ray

from raysgd_core import KEEP_WORKERS_ENV, WorkerGroup, get_context, release_kept_workers

pytestmark = pytest.mark.timeout(120)


def _all_reduce_rank_plus_one() -> tuple[float, int, int]:
    import torch
    import torch.distributed as dist

    ctx = get_context()
    t = torch.tensor([float(ctx.world_rank + 1)])
    dist.all_reduce(t)
    return t.item(), ctx.world_rank, ctx.world_size


class Scaler:
    """Defined in the test module: reaches the workers only if shipped by value."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def apply(self, x: int) -> int:
        return x * self.factor


def _use_scaler(scaler: Scaler) -> int:
    return scaler.apply(get_context().world_rank)


@pytest.fixture
def nothing_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers are not kept between groups (the default; the suite's conftest keeps them)."""
    monkeypatch.setenv(KEEP_WORKERS_ENV, "0")
    release_kept_workers()


@pytest.mark.parametrize("n", [1, 4])
def test_formation_context_shipping_and_shutdown(
    ray_local, nothing_kept, wait_no_leftovers, wait_for_cpus, n
):
    def hook() -> None:
        os.environ["HOOK_RAN"] = "yes"

    def read_env() -> tuple[str | None, str | None, str, int, int]:
        ctx = get_context()
        ctx.store["seen"] = ctx.store.get("seen", 0) + 1
        return (
            os.environ.get("RAYSGD_TEST_VAR"),
            os.environ.get("HOOK_RAN"),
            ctx.backend,
            ctx.local_world_size,
            ctx.store["seen"],
        )

    free_before = wait_for_cpus(4)
    group = WorkerGroup(n, env_vars={"RAYSGD_TEST_VAR": "42"}, init_hook=hook)
    with group:
        assert group.world_size == n
        assert ray.available_resources().get("CPU", 0) == free_before - n
        results = group.execute(_all_reduce_rank_plus_one)
        expected = n * (n + 1) / 2
        assert results == [(expected, r, n) for r in range(n)]
        infos = group.workers
        assert [w.rank for w in infos] == list(range(n))
        assert [w.local_rank for w in infos] == list(range(n))  # one node
        assert all(w.device == "cpu" and w.pid != os.getpid() for w in infos)
        assert len({w.pid for w in infos}) == n

        # The env vars and the init hook reach every worker; the context says what it is.
        assert group.execute(read_env) == [("42", "yes", "gloo", n, 1)] * n
        # The store lives as long as the worker process.
        assert [seen for *_, seen in group.execute(read_env)] == [2] * n
        # A class and a function from this test module are shipped by value.
        assert group.execute(_use_scaler, Scaler(10)) == [10 * r for r in range(n)]
        last = n - 1
        assert group.execute_single(last, _use_scaler, scaler=Scaler(3)) == 3 * last
        # Top-level ObjectRef arguments are resolved on the workers.
        ref = ray.put(Scaler(5))
        assert group.execute(_use_scaler, ref) == [5 * r for r in range(n)]
        refs = group.execute_async(_use_scaler, Scaler(7))
        assert ray.get(refs) == [7 * r for r in range(n)]
        with pytest.raises(ValueError, match="rank"):
            group.execute_single(n, read_env)
    # RaySGD's own tests read `ray.available_resources()` right after `shutdown()`: it must not
    # return before Ray has removed the placement groups (their CPUs are missing until then).
    assert ray.available_resources().get("CPU", 0) == free_before
    group.shutdown()  # idempotent (the with block already shut it down)
    # Every resource goes back to Ray: no actor, no placement group, all CPUs free.
    assert wait_no_leftovers() == ([], [])
    assert wait_for_cpus(free_before) == free_before


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_workers"):
        WorkerGroup(0)
    with pytest.raises(ValueError, match="placement_strategy"):
        WorkerGroup(2, placement_strategy="RANDOM")
    with pytest.raises(TypeError, match="init_hook"):
        WorkerGroup(2, init_hook="not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spare_workers"):
        WorkerGroup(2, spare_workers=-1)
    with pytest.raises(TypeError, match="spare_imports"):
        WorkerGroup(2, spare_workers=1, spare_imports="json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spare_imports"):
        WorkerGroup(2, spare_workers=1, spare_imports=5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not started"):
        WorkerGroup(2).execute(print)


def test_get_context_outside_a_worker_fails_clearly():
    with pytest.raises(RuntimeError, match="outside a worker"):
        get_context()


def test_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, raysgd_core; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('raysgd_operator', 'raysgd_amp', 'raysgd', 'torch')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_start_makes_its_own_ray_even_where_another_cluster_left_its_address():
    """Ray's `ray.init()` joins the cluster named in `<tmp>/ray/ray_current_cluster`, which
    `ray start` and `ray.cluster_utils.Cluster` leave behind (even after it is gone). A group started
    without Ray must start its own local instance instead, and so must the trainer."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as tmp:  # short: Ray's socket paths
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9")  # a cluster that is not there
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = tmp
        code = (
            "from raysgd_core import WorkerGroup\n"
            "with WorkerGroup(1) as group:\n"
            "    print('ranks', group.execute(lambda: 7))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks [7]" in out.stdout


def test_cpus_are_free_right_after_shutdown_with_rank_0_in_this_process(
    ray_local, nothing_kept, wait_for_cpus
):
    # As right after the `with` block of test_formation_context_shipping_and_shutdown (where
    # every rank is an actor), with rank 0 in this process holding one of the CPUs.
    free_before = wait_for_cpus(4)
    group = WorkerGroup(3, use_local=True).start()
    assert ray.available_resources().get("CPU", 0) == free_before - 3
    group.shutdown()
    assert ray.available_resources().get("CPU", 0) == free_before
