"""Soak: many recoveries in one run, and whether anything leaks or slows down.

One raysgd trainer (2 workers, the benchmark workload, a local Ray cluster) goes through
`--recoveries` recoveries in one process: before every `train(num_steps=...)` call the driver picks
a rank and a step at random and that worker exits there (`os._exit`), so every call recovers once.
Half of them run with ``spare_workers=1``, half without. Then, on a `ray.cluster_utils.Cluster`
(a head without CPUs and three one-CPU nodes), a worker's node is drained for a preemption
`--drains` times (the real `ray drain-node`), the node removed once the workers moved and another
added, so that drains and reclaimed nodes are part of the run too.

Measured after every recovery, in the driver: its resident memory, open file descriptors and
threads; the live placement groups; the live worker processes on this machine; the files in
/dev/shm and raysgd's folders in the temporary folder. Reported per trainer (each holds what it
holds: a spare has its own placement group and process): each figure at its tenth recovery and at
its last (goal: within 10 %), and the mean step time of a clean call of `--timing-steps` steps
before its first recovery and after its last (goal: within 10 %).

    hatch run bench:soak [--quick] [--recoveries N] [--drains N] [--timing-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from raysgd_core.scratch import SCRATCH_PREFIX
from raysgd_examples.bench import _common

__all__ = ["main", "snapshot"]

_SIDES = ("raysgd",)
_MODULE = "raysgd_examples.bench.soak"


def snapshot() -> dict[str, float]:
    """What could leak, read in this (driver) process now."""
    import ray
    from ray.util import placement_group_table

    status = Path("/proc/self/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    pgs = [pg for pg in placement_group_table().values() if pg.get("state") != "REMOVED"]
    temp = tempfile.gettempdir()
    return {
        "driver_rss_mb": rss_kb / 1024,
        "open_fds": float(len(os.listdir("/proc/self/fd"))),
        "threads": float(len(os.listdir("/proc/self/task"))),
        "placement_groups": float(len(pgs)),
        "worker_processes": float(_worker_processes()),
        "dev_shm_files": float(_dev_shm_files()),
        "raysgd_temp_entries": float(
            sum(
                name.startswith(("raysgd", ".raysgd")) and not name.startswith(SCRATCH_PREFIX)
                for name in os.listdir(temp)
            )
        ),
        "ray_nodes_alive": float(sum(1 for n in ray.nodes() if n.get("Alive"))),
    }


def _dev_shm_files() -> int:
    """The entries in /dev/shm (memory), less workers' scratch folders: those belong to a live
    process, or are removed once it is gone (`raysgd_core.scratch_dir`)."""
    if not os.path.isdir("/dev/shm"):
        return 0
    return sum(not name.startswith(SCRATCH_PREFIX) for name in os.listdir("/dev/shm"))


def _worker_processes() -> int:
    """raysgd's worker actors alive in this Ray session, spares included.

    Counted from the processes themselves (a killed or shut-down actor whose process lingers is
    what this should catch): Ray titles an actor's process ``ray::<its class>`` (raysgd's worker
    class is ``WorkerActor``: the suite's soak test fails if that changes), and starts it from
    the raylet of its node. Only the children of this session's raylets count, so that another
    Ray session on the machine (a second test process, another user's job) is not counted.
    """
    import ray

    sockets = [
        f"--raylet_socket_name={node['RayletSocketName']}".encode()
        for node in ray.nodes()
        if node.get("Alive")
    ]
    raylets: set[str] = set()
    workers: dict[str, str] = {}  # pid -> parent pid
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if command.startswith(b"ray::WorkerActor"):
                # The parent pid is the field after the parenthesised command name.
                stat = Path(f"/proc/{pid}/stat").read_text()
                workers[pid] = stat.rsplit(")", 1)[1].split()[1]
            elif any(socket in command for socket in sockets):
                raylets.add(pid)
        except OSError:  # the process ended while we looked
            pass
    return sum(parent in raylets for parent in workers.values())


def _operator_cls() -> type:
    from raysgd_examples.bench._raysgd import BenchOperator

    class SoakOperator(BenchOperator):
        """The benchmark workload; a worker exits where the driver's plan file says (once)."""

        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            plan_file = self.config["plan"]
            try:
                plan = json.loads(Path(plan_file).read_text())
            except (OSError, ValueError):
                plan = None
            if (
                plan
                and plan["rank"] == self.world_rank
                and plan["step"] == batch_info["global_step"]
                and not os.path.exists(plan_file + ".done")
            ):
                Path(plan_file + ".done").write_text("")
                os._exit(1)
            return super().train_batch(batch, batch_info)

    return SoakOperator


def _trainer(cfg: dict[str, Any], plan: str, **kwargs: Any) -> Any:
    from raysgd import TorchTrainer
    from raysgd.utils import BATCH_SIZE
    from raysgd_examples.bench.workload import Workload

    workload = Workload(**cfg["workload"])
    return TorchTrainer(
        training_operator_cls=_operator_cls(),
        config={"loop": cfg, BATCH_SIZE: workload.batch_size * 2, "plan": plan},
        num_workers=2,
        num_cpus_per_worker=1,
        use_gpu=False,
        backend="gloo",
        **kwargs,
    )


def _step_time(trainer: Any, steps: int, spares: int = 0) -> float:
    # A spare started after a promotion imports torch for a few seconds: on a small machine that
    # would be timed as the workers' step time, so the clean call waits for the pool to be up.
    deadline = time.monotonic() + 120
    while len(trainer.worker_group.spares) < spares and time.monotonic() < deadline:
        time.sleep(0.2)
    started = time.perf_counter()
    trainer.train(num_steps=steps)
    return (time.perf_counter() - started) / steps


def _recoveries(
    trainer: Any, plan: str, count: int, steps: int, rng: random.Random, record: Callable
) -> None:
    for _ in range(count):
        failures = trainer.failures
        target = _next_step(trainer) + rng.randrange(1, steps)
        Path(plan).write_text(json.dumps({"rank": rng.randrange(2), "step": target}))
        if os.path.exists(plan + ".done"):
            os.remove(plan + ".done")
        trainer.train(num_steps=steps, max_retries=3)
        if trainer.failures != failures + 1:
            raise RuntimeError(
                f"expected one recovery in the call, saw {trainer.failures - failures}"
            )
        record(trainer)


def _next_step(trainer: Any) -> int:
    return int(trainer.apply_all_operators(lambda op: op.global_step)[0])


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """The whole soak (one side: raysgd), in a child process."""
    from raysgd_examples.bench.workload import Workload

    workload = Workload.quick() if args.quick else Workload()
    cfg = {"workload": workload.to_dict(), "warmup": 0, "steps": 10**6}
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"runs": {}}
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_soak_") as tmp:
        plan = os.path.join(tmp, "plan.json")
        half = args.recoveries // 2
        with _common.local_ray(num_cpus=4, settle=True, raysgd=True):
            for spares in (0, 1):
                # Each trainer is its own run: what it holds (a spare's placement group, say) is
                # compared with itself, from its tenth recovery to its last.
                history: list[dict[str, float]] = []
                trainer = _trainer(cfg, plan, spare_workers=spares)
                try:
                    _step_time(trainer, args.timing_steps, spares)  # warm-up call
                    before = _step_time(trainer, args.timing_steps, spares)
                    _recoveries(
                        trainer,
                        plan,
                        args.recoveries - half if spares else half,
                        args.steps,
                        rng,
                        lambda t, h=history: h.append({**snapshot(), "failures": t.failures}),
                    )
                    _step_time(trainer, args.timing_steps, spares)  # the replacement warms up
                    result["runs"][f"spare_workers={spares}"] = {
                        "history": history,
                        "step_s_before": before,
                        "step_s_after": _step_time(trainer, args.timing_steps, spares),
                        "goodput": trainer.goodput(),
                    }
                finally:
                    trainer.shutdown()
        if args.drains:
            result["drains"] = _drains(cfg, plan, args)
    return result


def _drains(cfg: dict[str, Any], plan: str, args: argparse.Namespace) -> dict[str, Any]:
    """Drain a worker's node `args.drains` times on a Cluster, removing it and adding another."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    out: dict[str, Any] = {"snapshots": []}
    trainer = _trainer(cfg, plan)
    try:
        _step_time(trainer, args.timing_steps)
        out["step_s_before"] = _step_time(trainer, args.timing_steps)
        for _ in range(args.drains):
            victim_id = trainer.worker_group.workers[1].node_id
            victim = next(n for n in nodes if n.node_id == victim_id)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ray.scripts.scripts",
                    "drain-node",
                    "--address",
                    cluster.address,
                    "--node-id",
                    victim_id,
                    "--reason",
                    "DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message",
                    "soak",
                    "--deadline-remaining-seconds",
                    "60",
                ],
                check=True,
                capture_output=True,
            )
            trainer.train(num_steps=args.steps)  # the workers move off the draining node
            cluster.remove_node(victim)
            nodes.remove(victim)
            nodes.append(cluster.add_node(num_cpus=1))
            cluster.wait_for_nodes()
            trainer.train(num_steps=args.steps)
            out["snapshots"].append(snapshot())
        out["step_s_after"] = _step_time(trainer, args.timing_steps)
        out["moves"] = sum(1 for e in trainer.recovery_events if e.kind == "preemption")
        out["failures"] = trainer.failures
    finally:
        trainer.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


_LEAKS = (
    "driver_rss_mb",
    "open_fds",
    "threads",
    "placement_groups",
    "worker_processes",
    "dev_shm_files",
    "raysgd_temp_entries",
)


def _growth(history: list[dict[str, float]], key: str, start: int) -> tuple[float, float, float]:
    first = history[min(start, len(history)) - 1][key]
    last = history[-1][key]
    return first, last, (last - first) / first if first else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak; print what grew; write ``<out>/soak.json``."""
    # 100 recoveries outlast the usual 10 minutes per run.
    parser = _common.bench_parser(
        __doc__.splitlines()[0], sides=_SIDES, repeats=1, timeout_s=3600.0
    )
    parser.add_argument("--recoveries", type=int, default=None)
    parser.add_argument("--drains", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-steps", type=int, default=None)
    args = _common.parse_args(parser, argv, steps=12, quick_steps=6)
    if args.recoveries is None:
        args.recoveries = 12 if args.quick else 100
    if args.drains is None:
        args.drains = 1 if args.quick else 5
    if args.timing_steps is None:
        args.timing_steps = 30 if args.quick else 150
    runs = _common.dispatch(_MODULE, measure, args, _SIDES)
    if runs is None:
        return {}
    (run,) = runs["raysgd"]
    if "error" in run:
        raise SystemExit(f"the soak failed: {run['error']}")
    rows: dict[str, Any] = {}
    for name, one in run["runs"].items():
        history = one["history"]
        start = 10 if len(history) >= 20 else max(1, len(history) // 2)
        print(f"\n{name}: {len(history)} recoveries; from recovery {start} to the last:")
        rows[name] = {}
        for key in _LEAKS:
            first, last, growth = _growth(history, key, start)
            rows[name][key] = {"at_start": first, "at_end": last, "growth": growth}
            print(f"  {key:<22} {first:10.1f} -> {last:10.1f}  ({growth:+.1%})")
        before, after = one["step_s_before"], one["step_s_after"]
        rows[name]["step_s"] = {"before": before, "after": after, "growth": after / before - 1}
        print(
            f"  {'step time (s)':<22} {before:10.4f} -> {after:10.4f}  ({after / before - 1:+.1%})"
        )
        lost = {k: round(v, 1) for k, v in one["goodput"]["lost_s"].items() if v}
        print(f"  goodput {one['goodput']['goodput']:.2f}; lost (s): {lost}")
    if "drains" in run:
        drains = run["drains"]
        b, a = drains["step_s_before"], drains["step_s_after"]
        rows["drains"] = {"before": b, "after": a, "growth": a / b - 1}
        print(
            f"\ndrains on a Cluster: step time {b:.4f} -> {a:.4f} s ({a / b - 1:+.1%}); "
            f"{drains['moves']} move(s), {drains['failures']} failure(s)"
        )
    recoveries = sum(len(one["history"]) for one in run["runs"].values())
    m = {"name": "soak", "rows": rows, "recoveries": recoveries}
    _common.write_results(args.out, "soak", [m], args, workload={"steps": args.steps})
    return m


if __name__ == "__main__":
    main()
