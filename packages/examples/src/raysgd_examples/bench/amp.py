"""Mixed-precision throughput: samples/s of a small conv net trained through `raysgd_amp`.

Compares bf16 autocast against fp32 on CPU and, where CUDA exists, fp16 (with a GradScaler) against
fp32 on the GPU. One process, no Ray: this measures the precision backends, not the trainer. Runs
alternate between the precisions, repeat after repeat, so that drift on a shared machine hits them
alike; the median of the repeats is reported, with the ratio to fp32 on the same device.

    hatch run bench:amp                      # full sizes, writes bench_results/amp.json
    hatch run bench:amp --quick              # tiny sizes: a smoke run, not data
    hatch run bench:amp --out results/x.json # --out is a folder or a .json file
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from raysgd_amp import get_precision
from raysgd_examples.bench._common import machine_info

__all__ = ["main", "measure"]

NAME = "amp"


def _conv_net(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def measure(
    use_fp16: Any, device: str, *, batch: int, image: int, width: int, steps: int, warmup: int
) -> float:
    """Samples/s of `steps` training steps (after `warmup` untimed ones) under `use_fp16`."""
    torch.manual_seed(0)
    dev = torch.device(device)
    precision = get_precision(use_fp16, device=dev)
    model = _conv_net(width).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    (model,), (optimizer,) = precision.setup([model], [optimizer], dev)
    x = torch.randn(batch, 3, image, image, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        precision.backward(loss, optimizer)
        precision.step(optimizer)

    for _ in range(warmup):
        one_step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return steps * batch / (time.perf_counter() - start)


def _out_path(out: str) -> Path:
    path = Path(out)
    return path if path.suffix == ".json" else path / f"{NAME}.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per precision (median)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not data")
    parser.add_argument("--out", default="bench_results", help="folder for amp.json, or a .json")
    parser.add_argument("--batch", type=int, default=None, help="samples per step")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark, print the medians and ratios, write the JSON; returns what it wrote."""
    args = _parser().parse_args(argv)
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        raise SystemExit("--repeats and --steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = {
        "batch": args.batch or (4 if args.quick else 64),
        "image": 8 if args.quick else 32,
        "width": 4 if args.quick else 32,
        "steps": args.steps or (2 if args.quick else 20),
        "warmup": 1 if args.quick else 3,
    }
    # (device, reduced precision compared against fp32 there)
    pairs = [("cpu", "bf16")] + ([("cuda", "fp16")] if torch.cuda.is_available() else [])
    metrics = []
    for device, reduced in pairs:
        runs: dict[str, list[float]] = {"fp32": [], reduced: []}
        for rep in range(args.repeats):
            for choice in runs:  # alternate, so slow phases of a shared machine hit both
                use_fp16 = False if choice == "fp32" else reduced
                runs[choice].append(measure(use_fp16, device, **sizes))
                print(
                    f"  [{rep + 1}/{args.repeats}] {device} {choice}: {runs[choice][-1]:.1f} samples/s"
                )
        medians = {k: statistics.median(v) for k, v in runs.items()}
        ratio = medians[reduced] / medians["fp32"]
        print(
            f"{device}: fp32 {medians['fp32']:.1f}, {reduced} {medians[reduced]:.1f} samples/s "
            f"-> {reduced}/fp32 = {ratio:.3f}"
        )
        metrics.append(
            {
                "metric": f"training throughput on {device}, {reduced} vs fp32",
                "unit": "samples/s",
                "higher_is_better": True,
                "sides": {k: {"values": v, "median": medians[k]} for k, v in runs.items()},
                "ratio_vs_fp32": {reduced: ratio},
                "ratio_vs_torchrun": {},  # not a trainer comparison: both sides are plain loops
                "note": "one process, no Ray; conv net through raysgd_amp",
            }
        )
    payload = {
        "benchmark": NAME,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "args": {**vars(args), **sizes},
        "metrics": metrics,
    }
    path = _out_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
