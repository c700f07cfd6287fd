"""GPU throughput: raysgd `TorchTrainer` vs a plain PyTorch loop vs Ray Train, ResNet-50.

ResNet-50 (torchvision's, random weights; a built-in copy of its shape when torchvision is missing)
trains on one fixed synthetic batch held in memory, in fp32, fp16 (autocast + GradScaler) and bf16
(autocast). raysgd and Ray Train use every visible GPU, one worker each; the plain loop is one
process on one GPU, so every figure is images/s per GPU. Each side runs in a fresh child process
that trains every precision; the sides alternate A-B-C / C-B-A over the rounds (`--repeats`) and
the median of the rounds is reported, with the ratio to the plain loop and raysgd's ratio to Ray
Train. The timed window of every side is `--steps` steps after `--warmup` untimed ones, with the
GPU drained at both ends and nowhere in between; raysgd is also timed on the driver around its
whole `train(num_steps=steps)` call (``raysgd_driver_timed``: per-call costs included).

On a machine without a GPU it says so and exits 0 without measuring anything.

    hatch run bench:gpu                           # writes bench_results/gpu.json and gpu_chart.png
    hatch run bench:gpu --quick                   # a smoke run
    hatch run bench:gpu --precisions fp16,bf16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional

from raysgd_examples.bench import _common
from raysgd_examples.bench._common import gpu_count

__all__ = ["SIDES", "gpu_count", "main", "measure"]

SIDES = ("raysgd", "plain", "ray_train")
REFERENCE = "plain"
_MODULE = "raysgd_examples.bench.gpu"
_NAME = "gpu"


def _jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    quick, dry = bool(args.quick), bool(args.cpu_dry_run)
    return [
        {
            "precision": precision,
            "batch_size": 4 if dry else 16 if quick else args.batch_size,
            "image": 32 if dry else 64 if quick else 224,
            "num_classes": 1000,
            "warmup": args.warmup,
            "steps": args.steps,
            "seed": 0,
        }
        for precision in args.precision_list
    ]


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side, every precision (in a child process): ``{precision: result}``."""
    from raysgd_examples.bench import _gpu_sides

    jobs, use_gpu = _jobs(args), not args.cpu_dry_run
    gpus = gpu_count() if use_gpu else 1
    if side == "plain":
        return _gpu_sides.measure_plain(jobs, use_gpu)
    # One CPU per worker plus room for the driver's tasks.
    with _common.local_ray(num_cpus=max(4, gpus + 2), raysgd=side == "raysgd"):
        if side == "raysgd":
            return _gpu_sides.measure_raysgd(jobs, gpus, use_gpu)
        if side == "ray_train":
            return _gpu_sides.measure_ray_train(jobs, gpus, use_gpu)
    raise ValueError(f"unknown side {side!r}")


def _per_precision(
    runs: dict[str, list[dict[str, Any]]], precision: str, job: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """The runs of one precision as ``{side: [{"images_per_s": ...}]}`` (errors kept)."""
    images = job["batch_size"] * job["steps"]
    out: dict[str, list[dict[str, Any]]] = {}
    for side, side_runs in runs.items():
        for run in side_runs:
            if "error" in run:
                out.setdefault(side, []).append(run)
                continue
            result = run[precision]
            out.setdefault(side, []).append({"images_per_s": images / result["elapsed_s"]})
            if "driver_elapsed_s" in result:
                out.setdefault(f"{side}_driver_timed", []).append(
                    {"images_per_s": images / result["driver_elapsed_s"]}
                )
    return out


def _summary(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[dict]:
    metrics = []
    for job in _jobs(args):
        precision = job["precision"]
        m = _common.metric(
            f"ResNet-50 {precision}",
            "images/s per GPU",
            True,
            _per_precision(runs, precision, job),
            "images_per_s",
            note=f"batch {job['batch_size']} per GPU, {job['steps']} timed steps",
            reference=REFERENCE,
        )
        sides = m["sides"]
        if "median" in sides.get("raysgd", {}) and "median" in sides.get("ray_train", {}):
            m["raysgd_vs_ray_train"] = sides["raysgd"]["median"] / sides["ray_train"]["median"]
        metrics.append(m)
    return metrics


def _details(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What each side ran with (model, threads, cuDNN autotuning), from its first good run."""
    details: dict[str, Any] = {}
    for side, side_runs in runs.items():
        good = [r for r in side_runs if "error" not in r]
        if good:
            details[side] = {
                p: {k: v for k, v in r.items() if "elapsed" not in k} for p, r in good[0].items()
            }
    return details


def _gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpus": 0, "gpu_name": "none (--cpu-dry-run)", "cuda": None, "cudnn": None}
    return {
        "gpus": torch.cuda.device_count(),
        "gpu_name": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the benchmark (or say there is no GPU); print the tables; write gpu.json and a chart."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=3)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10)")
    parser.add_argument("--batch-size", type=int, default=128, help="per-GPU batch")
    parser.add_argument("--precisions", default="fp32,fp16,bf16", help="comma-separated subset")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every side on the CPU with tiny sizes to check the harness (numbers mean nothing)",
    )
    args = _common.parse_args(parser, argv, steps=120, quick_steps=5)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 10
    args.precision_list = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(args.precision_list) - {"fp32", "fp16", "bf16"})
    if unknown or not args.precision_list:
        parser.error(f"--precisions: unknown {unknown}; known: fp32, fp16, bf16")
    if not args.child and not args.cpu_dry_run and gpu_count() == 0:
        print(
            "bench:gpu: no GPU is visible here (torch.cuda.is_available() is False): nothing was "
            "measured and no figures were written. Run `hatch run bench:gpu` on a machine with "
            "an NVIDIA GPU and a CUDA build of torch."
        )
        return {}
    selected = _common.selected_sides(args, SIDES)
    if args.child:
        _common.child_main(measure, args)
        return {}
    runs = _common.run_rounds(
        lambda side: _common.run_child(_MODULE, side, args.argv, args.timeout),
        selected,
        args.repeats,
        alternate=True,
    )
    metrics = _summary(runs, args)
    for m in metrics:
        _common.print_metric(m)
        if "raysgd_vs_ray_train" in m:
            print(f"  raysgd / ray_train: {m['raysgd_vs_ray_train']:.3f}")
    details = _details(runs)
    models = {r.get("model") for d in details.values() for r in d.values()}
    print(f"\nmodel: {', '.join(sorted(str(m) for m in models))}")
    path = _common.write_results(
        args.out, _NAME, metrics, args, gpu=_gpu_info(), job=_jobs(args), sides=details
    )
    _chart_and_table(path)
    return {"metrics": metrics, "median_ratio_vs_plain": _median_ratios(metrics)}


def _median_ratios(metrics: list[dict[str, Any]]) -> dict[str, float]:
    by_side: dict[str, list[float]] = {}
    for m in metrics:
        for side, ratio in m.get(f"ratio_vs_{REFERENCE}", {}).items():
            by_side.setdefault(side, []).append(ratio)
    return {side: statistics.median(r) for side, r in by_side.items()}


def _chart_and_table(path: Path) -> None:
    import json

    from raysgd_examples.bench.run_all import chart, markdown_table

    payload = json.loads(path.read_text())
    results = {_NAME: payload}
    png = chart(results, path.with_name("gpu_chart.png"))
    gpu = payload["gpu"]
    table = (
        f"GPU: {gpu['gpus']} x {gpu['gpu_name']}, CUDA {gpu['cuda']}, cuDNN {gpu['cudnn']}.\n"
        + markdown_table(results, payload["machine"])
    )
    path.with_name("gpu_table.md").write_text(table + "\n")
    print(f"wrote {path.with_name('gpu_table.md')}" + (f", {png}" if png else ""))
    print("\n" + table)


if __name__ == "__main__":
    main()
