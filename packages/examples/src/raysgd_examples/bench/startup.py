"""Time to the first finished step: raysgd `TorchTrainer` vs `torchrun` vs Ray Train `fit()`.

- cold: a fresh Python process is launched; the clock runs from the launch to the end of the first
  training step (imports and starting Ray included). raysgd: `TorchTrainer(...)` starts Ray itself
  as a user's script would, then `train(num_steps=1)`. Ray Train: `ray.init(include_dashboard=False)`
  then `fit()` until rank 0 has reported step 1. torchrun: the one-step job (its whole process time
  is recorded too).
- warm: Ray is already up and settled; the clock runs from constructing the trainer to the end of
  `train(num_steps=1)` (raysgd) or the first reported step of `fit()` (Ray Train). torchrun has no
  warm start; its cold figure is the reference for both.

Goal for raysgd warm: under 2 s.

    hatch run bench:startup [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from raysgd_examples.bench import _common

__all__ = ["SIDES", "main", "measure"]

SIDES = ("raysgd_cold", "raysgd_warm", "torchrun", "ray_train_cold", "ray_train_warm")
_MODULE = "raysgd_examples.bench.startup"


def _loop_config(args: argparse.Namespace) -> dict[str, Any]:
    from raysgd_examples.bench.workload import Workload

    workload = Workload.quick() if args.quick else Workload()
    return {"workload": workload.to_dict(), "warmup": 0, "steps": 1}


def _raysgd_first_step(cfg: dict[str, Any], workers: int) -> float:
    """Construct a trainer, train one step; return the wall time at which the step ended."""
    from raysgd_examples.bench import _raysgd

    trainer = _raysgd.make_trainer(cfg, num_workers=workers)
    try:
        trainer.train(num_steps=1)
        return time.time()
    finally:
        trainer.shutdown()


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): ``{"first_step_s": ...}``."""
    from raysgd_examples.bench import _loop
    from raysgd_examples.bench.workload import Timeline

    cfg = _loop_config(args)
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
        cfg["timeline"] = os.path.join(tmp, "timeline.jsonl")
        timeline = Timeline(cfg["timeline"])
        if side == "torchrun":
            start = time.time()
            process_s = _common.run_torchrun(
                "raysgd_examples.bench._torchrun_worker",
                [json.dumps(cfg)],
                nproc=args.workers,
                timeout=args.timeout,
            )
            return {"first_step_s": _loop.first_step_time(timeline) - start, "process_s": process_s}
        if side == "raysgd_cold":
            import ray

            try:  # no ray.init here: the trainer starts Ray as it would for a user
                done = _raysgd_first_step(cfg, args.workers)
            finally:
                ray.shutdown()
            return {"first_step_s": done - args.launched}
        if side == "raysgd_warm":
            with _common.local_ray(num_cpus=max(4, args.workers + 2), settle=True, raysgd=True):
                start = time.time()
                return {"first_step_s": _raysgd_first_step(cfg, args.workers) - start}
        if side in ("ray_train_cold", "ray_train_warm"):
            from raysgd_examples.bench import _ray_train

            cfg["report"] = True
            cold = side == "ray_train_cold"
            with _common.local_ray(num_cpus=max(4, args.workers + 2), settle=not cold):
                start = args.launched if cold else time.time()
                _ray_train.fit(cfg, num_workers=args.workers)
                fit_s = time.time() - start
            return {"first_step_s": _loop.first_step_time(timeline) - start, "fit_s": fit_s}
    raise ValueError(f"unknown side {side!r}")


def _rename(runs: dict[str, list[dict[str, Any]]], mode: str) -> dict[str, list[dict[str, Any]]]:
    """The runs of one mode (cold/warm), keyed raysgd / torchrun / ray_train."""
    out: dict[str, list[dict[str, Any]]] = {}
    for side, side_runs in runs.items():
        if side == "torchrun":
            out[side] = side_runs
        elif side.endswith("_" + mode):
            out[side[: -len(mode) - 1]] = side_runs
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; print the tables; write ``<out>/startup.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    args = _common.parse_args(parser, argv, steps=1, quick_steps=1)
    if args.child:
        _common.child_main(measure, args)
        return []
    sides = _common.selected_sides(args, SIDES)

    def run_one(side: str) -> dict[str, Any]:
        # The launch time travels to the child: "cold" starts before its interpreter does.
        launched = ["--launched", repr(time.time())]
        return _common.run_child(_MODULE, side, [*args.argv, *launched], args.timeout)

    runs = _common.run_rounds(run_one, sides, args.repeats)
    metrics = [
        _common.metric(
            f"first step, {mode}", "s", False, _rename(runs, mode), "first_step_s", note=note
        )
        for mode, note in (
            ("cold", "from launching a fresh process, Ray start included"),
            ("warm", "Ray already up; torchrun has no warm start (its cold figure)"),
        )
    ]
    for m in metrics:
        _common.print_metric(m)
    _common.write_results(args.out, "startup", metrics, args, workload=_loop_config(args))
    return metrics


if __name__ == "__main__":
    main()
