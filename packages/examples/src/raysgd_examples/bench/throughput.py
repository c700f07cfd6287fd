"""Throughput (samples/s): raysgd `TorchTrainer` vs `torchrun` DDP vs Ray Train `TorchTrainer`.

Same model, data, per-worker batch and loop on every side (`workload.py`), 2 workers with one torch
thread each. Each run trains `--warmup` steps, then `--steps` timed steps; the time is taken inside
the loop on rank 0 (steady state: no start-up, no teardown). Median over `--repeats` runs, each in
a fresh process, sides interleaved. Goal: raysgd >= 0.98x torchrun.

    hatch run bench:throughput                     # the measurement
    hatch run bench:throughput --quick --repeats 1 # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from raysgd_examples.bench import _common
from raysgd_examples.bench._loop import throughput_from_times
from raysgd_examples.bench.workload import Workload

__all__ = ["SIDES", "main", "measure"]

SIDES = ("raysgd", "torchrun", "ray_train")
_MODULE = "raysgd_examples.bench.throughput"


def _loop_config(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload.quick() if args.quick else Workload(batch_size=args.batch_size)
    return {"workload": workload.to_dict(), "warmup": args.warmup, "steps": args.steps}


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): ``{"samples_per_s": ...}``."""
    cfg = _loop_config(args)
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
        cfg["result"] = os.path.join(tmp, "result.json")
        if side == "torchrun":
            _common.run_torchrun(
                "raysgd_examples.bench._torchrun_worker",
                [json.dumps(cfg)],
                nproc=args.workers,
                timeout=args.timeout,
            )
            with open(cfg["result"], encoding="utf-8") as f:
                times = json.load(f)["times"]
        elif side == "ray_train":
            from raysgd_examples.bench import _ray_train

            with _common.local_ray():
                _ray_train.fit(cfg, num_workers=args.workers)
            with open(cfg["result"], encoding="utf-8") as f:
                times = json.load(f)["times"]
        elif side == "raysgd":
            from raysgd_examples.bench import _raysgd

            with _common.local_ray(raysgd=True):
                trainer = _raysgd.make_trainer(cfg, num_workers=args.workers)
                try:
                    trainer.train(num_steps=cfg["warmup"] + cfg["steps"])
                    times = _raysgd.step_times(trainer)
                finally:
                    trainer.shutdown()
        else:
            raise ValueError(f"unknown side {side!r}")
    samples_per_step = cfg["workload"]["batch_size"] * args.workers
    return {"samples_per_s": throughput_from_times(times, cfg["warmup"], samples_per_step)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/throughput.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=3)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-worker batch")
    parser.add_argument("--workers", type=int, default=2)
    args = _common.parse_args(parser, argv, steps=50, quick_steps=5)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    m = _common.metric("throughput", "samples/s", True, runs, "samples_per_s")
    _common.print_metric(m)
    _common.write_results(args.out, "throughput", [m], args, workload=_loop_config(args))
    return m


if __name__ == "__main__":
    main()
