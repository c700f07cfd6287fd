"""Worker processes kept between groups (`RAYSGD_KEEP_WORKERS_S`): the next group of the same kind
takes them, with an empty store and a new process group; anything else releases them."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from raysgd_core import KEEP_WORKERS_ENV, WorkerGroup, get_context, release_kept_workers

pytestmark = pytest.mark.timeout(120)


def _pid_seen_rank() -> tuple[int, int, int]:
    ctx = get_context()
    seen = ctx.store.get("seen", 0)
    ctx.store["seen"] = seen + 1
    return os.getpid(), seen, ctx.world_rank


def _sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(get_context().world_rank)])
    dist.all_reduce(t)
    return t.item()


def _pids(group: WorkerGroup) -> set[int]:
    return {pid for pid, _, _ in group.execute(_pid_seen_rank)}


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_kept_workers_serve_the_next_group_of_their_kind_and_nothing_else(
    ray_local: None, monkeypatch: pytest.MonkeyPatch, wait_for_cpus
) -> None:
    monkeypatch.setenv(KEEP_WORKERS_ENV, "60")
    release_kept_workers()
    free = wait_for_cpus(4)
    with WorkerGroup(2) as first:
        kept = _pids(first)
    # Kept: the processes live on and hold their room.
    assert _free_cpus() == free - 2
    with WorkerGroup(2) as second:
        got = second.execute(_pid_seen_rank)
        # The same processes, each starting the group with an empty store, in a working group.
        assert {pid for pid, _, _ in got} == kept
        assert [(seen, rank) for _, seen, rank in got] == [(0, 0), (0, 1)]
        assert second.execute(_sum_of_ranks) == [1.0, 1.0]
        probe = WorkerGroup(1, env_vars={"RAYSGD_TEST_VAR": "1"}).start()
    # Kept workers hold room, yet a group counts it as room it has (the failure policy sizes a
    # recovery by this): those of its kind it takes, those of another it releases.
    assert _free_cpus() == free - 3
    assert probe.estimate_fitting() == free - 1
    probe.shutdown(force=True)
    # Workers started otherwise (here: other environment variables) are new processes; the kept
    # ones are released to make room for them. A forced shutdown keeps nothing.
    other = WorkerGroup(2, env_vars={"RAYSGD_TEST_VAR": "1"}).start()
    assert not (_pids(other) & kept)
    assert _free_cpus() == free - 2
    other.shutdown(force=True)
    assert wait_for_cpus(free) == free
    with WorkerGroup(3) as third:
        kept = _pids(third)
    # A kept process that died meanwhile is replaced by a new one; the group forms as ever.
    dead = kept.pop()
    os.kill(dead, signal.SIGKILL)
    with WorkerGroup(3) as fourth:
        pids = _pids(fourth)
        assert kept < pids and dead not in pids and len(pids) == 3
        assert fourth.execute(_sum_of_ranks) == [3.0] * 3
        # Kept only as long as the driver's setting says when the group shuts down.
        monkeypatch.setenv(KEEP_WORKERS_ENV, "0.5")
    assert wait_for_cpus(free) == free
