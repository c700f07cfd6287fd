"""Ray Data input (samples/s): raysgd fed by Ray Data vs raysgd fed by a DataLoader vs Ray Train fed
by the same Ray Data dataset.

The model, step and per-worker batch are the throughput benchmark's (`workload.py`), 2 workers with
one torch thread each. The Ray Data sides read the same synthetic images through a pipeline
(``ray.data.range`` -> ``map_batches`` that looks each row's image up in the seeded pool), split
over the workers with ``streaming_split(2, equal=True)`` by each framework; the DataLoader side
indexes the same pool in the worker. Each run trains `--warmup` steps, then `--steps` timed steps
(one epoch of the dataset); the time is taken inside the loop on rank 0. The Ray cluster has 4 CPUs:
2 for the workers, 2 for Ray Data's tasks. One run per side by default.

    hatch run bench:data                      # the measurement
    hatch run bench:data --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import numpy as np

from raysgd_examples.bench import _common
from raysgd_examples.bench._loop import throughput_from_times
from raysgd_examples.bench.workload import SyntheticCIFAR, Workload

__all__ = ["SIDES", "PoolImages", "main", "make_ray_dataset", "measure"]

SIDES = ("raysgd_data", "raysgd_loader", "ray_train_data")
_MODULE = "raysgd_examples.bench.data"


class PoolImages:
    """``map_batches`` step: row ids -> ``image`` (3x32x32 float32) and ``label`` (int64), looked
    up in the same seeded pool the DataLoader side indexes."""

    def __init__(self, workload: Workload) -> None:
        pool = SyntheticCIFAR(1, workload.pool, workload.seed)
        self.images = pool.images.numpy()
        self.labels = pool.labels.numpy().astype(np.int64)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        index = batch["id"] % len(self.images)
        return {"image": self.images[index], "label": self.labels[index]}


def make_ray_dataset(workload: Workload, num_rows: int) -> Any:
    """The Ray Data pipeline both Ray Data sides read."""
    import ray

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data.range(num_rows).map_batches(PoolImages(workload))


def _loop_config(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload.quick() if args.quick else Workload(batch_size=args.batch_size)
    return {"workload": workload.to_dict(), "warmup": args.warmup, "steps": args.steps}


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): ``{"samples_per_s": ...}``."""
    cfg = _loop_config(args)
    workload = Workload(**cfg["workload"])
    total = cfg["warmup"] + cfg["steps"]
    rows = total * workload.batch_size * args.workers
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
        cfg["result"] = os.path.join(tmp, "result.json")
        if side == "ray_train_data":
            from raysgd_examples.bench import _ray_train

            with _common.local_ray():
                _ray_train.fit(
                    cfg, num_workers=args.workers, dataset=make_ray_dataset(workload, rows)
                )
            with open(cfg["result"], encoding="utf-8") as f:
                times = json.load(f)["times"]
        elif side in ("raysgd_data", "raysgd_loader"):
            from raysgd import DatasetOptions
            from raysgd_examples.bench import _raysgd

            with _common.local_ray(raysgd=True):
                data: dict[str, Any] = {}
                if side == "raysgd_data":
                    data = {
                        "datasets": {"train": make_ray_dataset(workload, rows)},
                        "dataset_options": DatasetOptions(columns=("image", "label")),
                    }
                trainer = _raysgd.make_trainer(cfg, num_workers=args.workers, **data)
                try:
                    trainer.train(num_steps=total)
                    times = _raysgd.step_times(trainer)
                finally:
                    trainer.shutdown()
        else:
            raise ValueError(f"unknown side {side!r}")
    samples_per_step = workload.batch_size * args.workers
    return {"samples_per_s": throughput_from_times(times, cfg["warmup"], samples_per_step)}


def _ratios(m: dict[str, Any]) -> dict[str, float]:
    medians = {side: s["median"] for side, s in m["sides"].items() if "median" in s}
    ours = medians.get("raysgd_data")
    return {
        f"raysgd_data_vs_{other}": ours / medians[other]
        for other in ("raysgd_loader", "ray_train_data")
        if ours and medians.get(other)
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/data.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-worker batch")
    parser.add_argument("--workers", type=int, default=2)
    args = _common.parse_args(parser, argv, steps=50, quick_steps=5)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    m = _common.metric("data_throughput", "samples/s", True, runs, "samples_per_s")
    m["ratios"] = _ratios(m)
    _common.print_metric(m)
    for name, ratio in m["ratios"].items():
        print(f"  {name}: {ratio:.3f}")
    _common.write_results(args.out, "data", [m], args, workload=_loop_config(args))
    return m


if __name__ == "__main__":
    main()
