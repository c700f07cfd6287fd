"""Scale: what fault tolerance costs per call as the model grows (it should cost nothing).

For MLPs of 0.1M, 25M and 100M parameters trained with Adam on 2 workers (gloo, CPU), each
size in a fresh process:

- ``train(num_steps=1, max_retries=0)`` ("bare": no fault tolerance asked for) against
  ``train(num_steps=1)`` ("guarded": the default ``max_retries=3``), in pairs of a random order,
  medians;
- ``validate(num_steps=1)`` right after a ``train()`` call, against the same right after another
  ``validate()``;
- the driver process's peak resident memory (``ru_maxrss``), and its growth over the driver before
  the trainer started.

Flat means: guarded / bare about 1.0 at every size (the goal is <= 1.05), validate after train
about the same as after validate, and a driver whose memory does not grow with the model.
``--strategy fsdp`` measures the sharded strategy instead of ``ddp``; with it, ``--snapshot-every K``
sets how often each worker snapshots its shards (`TorchTrainer(snapshot_every=K)`; 1: every step,
so that guarded / bare shows what one snapshot costs the loop; 0: only at start-up).

    hatch run bench:scale [--quick] [--repeats N] [--steps N] [--sizes 0.1M,25M,100M]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from raysgd_examples.bench import _common

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SIZES", "main", "make_mlp", "measure", "mlp_parameters"]

#: Model sizes (parameters) by name: an MLP of `depth` layers, the first `depth - 1` square of
#: `width` (width * width + width parameters each) and a last one to 10 classes.
SIZES = {"0.1M": (128, 7), "25M": (2048, 7), "100M": (4096, 7)}
_MODULE = "raysgd_examples.bench.scale"
_ROWS = 64  # rows of the synthetic data set: enough for a few steps of 8 rows per worker


def make_mlp(width: int, depth: int) -> nn.Module:
    """The MLP of `SIZES` (seeded): `depth - 1` square layers of `width` with ReLUs, then a
    linear layer to 10 classes. Only torch is imported (the torchrun sides build it too)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def mlp_parameters(width: int, depth: int) -> int:
    """The parameters of ``make_mlp(width, depth)``, without building it."""
    return (width * width + width) * (depth - 1) + width * 10 + 10


def _make_operator(width: int, depth: int) -> type:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from raysgd import TrainingOperator
    from raysgd.utils import BATCH_SIZE

    class MLPOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = make_mlp(width, depth)
            x = torch.randn(_ROWS, width)
            y = torch.randint(0, 10, (_ROWS,))
            loader = DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE])
            self.register(
                models=model,
                optimizers=torch.optim.Adam(model.parameters(), lr=1e-4),
                criterion=nn.CrossEntropyLoss(),
            )
            self.register_data(train_loader=loader, validation_loader=loader)

    return MLPOperator


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one size (in a child process): median seconds of each call kind, driver memory."""
    from raysgd import TorchTrainer
    from raysgd.utils import BATCH_SIZE

    width, depth = SIZES[side] if not args.quick else (64, 3)
    driver_before = _peak_rss_mb()
    with _common.local_ray(raysgd=True):
        trainer = TorchTrainer(
            training_operator_cls=_make_operator(width, depth),
            num_workers=args.workers,
            config={BATCH_SIZE: 8 * args.workers},
            strategy=args.strategy,
            **({"snapshot_every": args.snapshot_every} if args.snapshot_every is not None else {}),
        )
        try:
            trainer.train(num_steps=2, max_retries=0)  # warm-up: Adam's state exists from here on
            bare, guarded = [], []
            # Each pair in an order drawn at random: neither side always runs right after the
            # other, and a cost that comes every k steps (an fsdp snapshot every 20) does not
            # always land on the same side, as it did with strict alternation.
            order = random.Random()
            for _ in range(args.steps):
                pair = [
                    lambda: bare.append(_timed(lambda: trainer.train(num_steps=1, max_retries=0))),
                    lambda: guarded.append(_timed(lambda: trainer.train(num_steps=1))),
                ]
                order.shuffle(pair)
                for run in pair:
                    run()
            after_train, after_validate = [], []
            for _ in range(max(1, args.steps // 2)):
                trainer.train(num_steps=1)
                after_train.append(_timed(lambda: trainer.validate(num_steps=1)))
                after_validate.append(_timed(lambda: trainer.validate(num_steps=1)))
        finally:
            trainer.shutdown()
    driver_peak = _peak_rss_mb()
    return {
        "parameters": mlp_parameters(width, depth),
        "bare_s": statistics.median(bare),
        "guarded_s": statistics.median(guarded),
        "guarded_over_bare": statistics.median(guarded) / statistics.median(bare),
        "validate_after_train_s": statistics.median(after_train),
        "validate_after_validate_s": statistics.median(after_validate),
        "driver_peak_mb": driver_peak,
        "driver_growth_mb": driver_peak - driver_before,
    }


def _table(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for side, side_runs in runs.items():
        good = [r for r in side_runs if "error" not in r]
        if not good:
            rows.append({"size": side, "error": side_runs[0].get("error", "no result")})
            continue
        row: dict[str, Any] = {"size": side, "runs": len(good)}
        for key in good[0]:
            row[key] = statistics.median(float(r[key]) for r in good)
        rows.append(row)
    return rows


def _print(rows: list[dict[str, Any]], strategy: str) -> None:
    print(f"\nscale ({strategy}, 2 workers; medians)")
    print(
        f"  {'size':<6} {'params':>11} {'bare s':>8} {'guarded s':>10} {'ratio':>6} "
        f"{'val after train s':>18} {'val after val s':>16} {'driver peak MB':>15}"
    )
    for row in rows:
        if "error" in row:
            print(f"  {row['size']:<6} error: {row['error'].splitlines()[0][:100]}")
            continue
        print(
            f"  {row['size']:<6} {int(row['parameters']):>11,} {row['bare_s']:>8.3f} "
            f"{row['guarded_s']:>10.3f} {row['guarded_over_bare']:>6.2f} "
            f"{row['validate_after_train_s']:>18.3f} {row['validate_after_validate_s']:>16.3f} "
            f"{row['driver_peak_mb']:>15.0f}"
        )


def chart(rows: list[dict[str, Any]], path: Path) -> Optional[Path]:
    """Three panels over the model size: guarded / bare `train()` (with the 1.05 goal),
    `validate()` after `train()` against after `validate()`, and the driver's peak memory."""
    good = [r for r in rows if "error" not in r]
    if not good:
        return None
    plt = _common.pyplot()

    labels = [f"{r['parameters'] / 1e6:.1f}M" for r in good]
    fig, (ratio, validate, memory) = plt.subplots(1, 3, figsize=(12, 3.4))
    ratio.bar(labels, [r["guarded_over_bare"] for r in good], color="tab:blue")
    ratio.axhline(1.05, color="tab:red", linestyle="--", linewidth=1, label="goal <= 1.05")
    ratio.axhline(1.0, color="black", linewidth=1)
    ratio.set_title("guarded / bare train(num_steps=1)", fontsize=9)
    ratio.legend(fontsize=8)
    x = range(len(good))
    validate.bar([i - 0.2 for i in x], [r["validate_after_train_s"] for r in good], 0.4,
                 label="after train()")  # fmt: skip
    validate.bar([i + 0.2 for i in x], [r["validate_after_validate_s"] for r in good], 0.4,
                 label="after validate()")  # fmt: skip
    validate.set_xticks(list(x), labels)
    validate.set_title("validate(num_steps=1), seconds", fontsize=9)
    validate.legend(fontsize=8)
    memory.bar(labels, [r["driver_peak_mb"] for r in good], color="tab:green")
    memory.set_ylim(0, 1.3 * max(r["driver_peak_mb"] for r in good))
    memory.set_title("driver peak memory, MB", fontsize=9)
    for ax in (ratio, validate, memory):
        ax.set_xlabel("parameters", fontsize=8)
    return _common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/scale.json`` and ``<out>/scale.png``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=tuple(SIZES), repeats=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--sizes", default=None, help="comma-separated subset of the sizes")
    parser.add_argument(
        "--snapshot-every", type=int, default=None, help="fsdp: steps between shard snapshots"
    )
    raw = list(argv) if argv is not None else None
    args = _common.parse_args(parser, raw, steps=6, quick_steps=2)
    if args.sizes:
        args.sides = args.sizes
    runs = _common.dispatch(_MODULE, measure, args, tuple(SIZES))
    if runs is None:
        return {}
    rows = _table(runs)
    _print(rows, args.strategy)
    _common.write_results(args.out, "scale", [], args, rows=rows)
    drawn = chart(rows, Path(args.out) / f"scale_{args.strategy}.png")
    if drawn is not None:
        print(f"wrote {drawn}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
