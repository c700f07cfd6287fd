"""Worker pool start-up: `raysgd_core.WorkerGroup(2).start()` to the first finished all-reduce.

- raysgd: on a warm local cluster (Ray up and settled), the clock runs from constructing the
  `WorkerGroup` through `start()` to the end of the first `execute` of an all-reduce.
- torchrun: ``torchrun --nproc_per_node=2`` on a script that only forms the gloo group and
  all-reduces once; the whole process time.
- ray_train: Ray Train `TorchTrainer.fit()` on the same trivial job, to its first reported step.
- raysgd_kept: as raysgd, for the second group of a driver that keeps a stopped group's workers
  (`RAYSGD_KEEP_WORKERS_S`): the first group is started and shut down off the clock.

The figures, with the machine they were taken on, are in the root README's Benchmarks table.
`--steps` is accepted for uniformity and ignored (one all-reduce).

    hatch run bench:core [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from raysgd_examples.bench import _common

__all__ = ["SIDES", "main", "measure"]

SIDES = ("raysgd", "torchrun", "ray_train", "raysgd_kept")
_MODULE = "raysgd_examples.bench.core_startup"


def _all_reduce_once() -> float:
    """Runs on every rank: sum a one on each rank; returns the world size."""
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return float(value.item())


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): ``{"first_allreduce_s": ...}``."""
    if side == "torchrun":
        seconds = _common.run_torchrun(
            "raysgd_examples.bench._torchrun_worker",
            ['{"mode": "allreduce"}'],
            nproc=args.workers,
            timeout=args.timeout,
        )
        return {"first_allreduce_s": seconds}
    if side in ("raysgd", "raysgd_kept"):
        from raysgd_core import KEEP_WORKERS_ENV, WorkerGroup, release_kept_workers

        with _common.local_ray(settle=True, raysgd=True):
            if side == "raysgd_kept":
                os.environ[KEEP_WORKERS_ENV] = "60"
                with WorkerGroup(args.workers, num_cpus_per_worker=1, backend="gloo") as first:
                    first.execute(_all_reduce_once)
            start = time.perf_counter()
            group = WorkerGroup(args.workers, num_cpus_per_worker=1, backend="gloo")
            try:
                group.start()
                sums = group.execute(_all_reduce_once)
                seconds = time.perf_counter() - start
            finally:
                group.shutdown()
                release_kept_workers()
        if sums != [float(args.workers)] * args.workers:
            raise RuntimeError(f"all-reduce gave {sums}")
        return {"first_allreduce_s": seconds}
    if side == "ray_train":
        from raysgd_examples.bench import _ray_train
        from raysgd_examples.bench._loop import first_step_time
        from raysgd_examples.bench.workload import Timeline

        with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
            path = os.path.join(tmp, "timeline.jsonl")
            with _common.local_ray(settle=True):
                start = time.time()
                _ray_train.fit({"mode": "allreduce", "timeline": path}, num_workers=args.workers)
            return {"first_allreduce_s": first_step_time(Timeline(path)) - start}
    raise ValueError(f"unknown side {side!r}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/core_startup.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=5)
    parser.add_argument("--workers", type=int, default=2)
    args = _common.parse_args(parser, argv, steps=1, quick_steps=1)
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    m = _common.metric(
        "WorkerGroup start to first all-reduce",
        "s",
        False,
        runs,
        "first_allreduce_s",
        note="raysgd: warm cluster; torchrun: whole process; Ray Train: fit() to first step; "
        "raysgd_kept: a driver's second group, on the first one's kept workers",
    )
    _common.print_metric(m)
    _common.write_results(args.out, "core_startup", [m], args)
    return m


if __name__ == "__main__":
    main()
