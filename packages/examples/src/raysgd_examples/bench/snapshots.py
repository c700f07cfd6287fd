"""fsdp's in-memory snapshots: the host memory they hold and the time they take, at a model size.

Two sides train the same model (a stack of ``--layers`` square linear layers of ``--width``, built
on the meta device, sharded over ``--workers``), each in a process of its own with its own Ray:
``kept``, a snapshot at every step (`snapshot_every=1`), and ``none``, no snapshot kept
(`snapshot_memory_mb=0`). Per worker, after ``--steps`` timed steps:

- ``part_mb``: its part of the state (parameters and optimizer state; what a snapshot copies);
- ``resident_mb``: its resident memory; ``copies_resident``, on ``kept``: the difference to
  ``none``'s in copies of the part (everything the snapshots cost, heap included);
- ``copies_given_back``, on ``kept``: what dropping its snapshots gives back, in copies of the part;
- ``loop_s``: the time a snapshot keeps the step waiting (the copy into host memory), and
  ``finish_s``: the rest (keeping it for DCP, the swap with the ring peer, the commit) in the
  background, both measured on a snapshot taken after training;
- ``step_s``: the median step, of which the snapshots' share is ``kept``'s against ``none``'s.

    hatch run bench:snapshots [--width W] [--layers L] [--workers N] [--steps N]
                              [--optimizer adam|sgd] [--dtype float32|bfloat16] [--out DIR]

``--quick``: a small model, a smoke run. 100M parameters: ``--width 2048 --layers 24``; 1B:
``--width 4096 --layers 60 --optimizer sgd --dtype bfloat16`` (what fits 24 GB on 2 workers).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.bench import _common

__all__ = ["main"]

SIDES = ("kept", "none")
_MODULE = "raysgd_examples.bench.snapshots"


class _Operator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        width, dtype = config["width"], getattr(torch, config["dtype"])
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(config["layers"])])
        model = model.to(dtype)
        if config["optimizer"] == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
        x = torch.randn(config[BATCH_SIZE] * (config["steps"] + 1), width).to(dtype)
        self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, x), batch_size=config[BATCH_SIZE])
        )

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        metrics = super().train_batch(batch, batch_info)
        self.step_times = [*getattr(self, "step_times", []), time.perf_counter() - started]
        return metrics


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_worker(kept: bool) -> dict[str, Any]:
    """On a worker, after training: its part, its memory, and one snapshot timed."""
    from raysgd._internal.worker.objects import worker_state
    from raysgd._internal.worker.snapshots import nbytes

    state = worker_state()
    snapshots, runner = state.snapshots, state.runner
    snapshots.join()
    gc.collect()
    part = nbytes(runner.state.sharded_parts()[0])
    out: dict[str, Any] = {"part_mb": part / 2**20, "resident_mb": _resident_bytes() / 2**20}
    steps = runner.operator.step_times[1:]  # the first step maps the optimizer state's pages
    out["step_s"] = statistics.median(steps) if steps else None
    if kept:
        started = time.perf_counter()
        snapshots.take(wait=False)
        out["loop_s"] = time.perf_counter() - started
        snapshots.join()
        out["finish_s"] = time.perf_counter() - started - out["loop_s"]
        gc.collect()
        with_them = _resident_bytes()
        snapshots.forget()
        gc.collect()
        out["copies_given_back"] = (with_them - _resident_bytes()) / part
    return out


def _measure(side: str, args: Any) -> dict[str, Any]:
    config = {
        BATCH_SIZE: 8 * args.workers,
        "width": args.width,
        "layers": args.layers,
        "optimizer": args.optimizer,
        "dtype": args.dtype,
        "steps": args.steps,
    }
    with _common.local_ray(num_cpus=max(4, args.workers), raysgd=True):
        trainer = TorchTrainer(
            training_operator_cls=_Operator,
            config=config,
            num_workers=args.workers,
            strategy="fsdp",
            snapshot_every=1,
            snapshot_memory_mb=None if side == "kept" else 0,
        )
        try:
            trainer.train(num_steps=args.steps)
            # Every worker at once: taking a snapshot is a collective.
            workers = trainer.apply_all_workers(lambda: _measure_worker(side == "kept"))
        finally:
            trainer.shutdown()
    return {"side": side, "workers": workers}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = _common.parse_args(parser, argv, steps=6, quick_steps=3)
    if args.quick:
        args.width, args.layers = 512, 4
    if args.child:
        _common.child_main(_measure, args)
        return
    runs = {
        side: _common.run_child(_MODULE, side, args.argv, args.timeout)
        for side in _common.selected_sides(args, SIDES)
    }
    params = args.layers * (args.width**2 + args.width)
    print(
        f"fsdp snapshots, {params / 1e6:.0f}M parameters ({args.optimizer}, {args.dtype}), "
        f"{args.workers} workers"
    )
    for side, run in runs.items():
        for rank, worker in enumerate(run["workers"]):
            if side == "kept" and "none" in runs:
                base = runs["none"]["workers"][rank]["resident_mb"]
                worker["copies_resident"] = (worker["resident_mb"] - base) / worker["part_mb"]
            shown = ", ".join(
                f"{k} {v:.3g}" for k, v in worker.items() if isinstance(v, (int, float))
            )
            print(f"  {side} rank {rank}: {shown}")
    _common.write_results(args.out, "snapshots", list(runs.values()), args, parameters=params)


if __name__ == "__main__":
    main()
