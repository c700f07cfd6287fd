"""Run every benchmark, then write ``all.json``, a chart of the ratios and a markdown table.

Each benchmark runs as its own process (its output streams through), writes ``<out>/<name>.json``;
this script gathers them into ``<out>/all.json``, draws ``<out>/chart.png`` (every side's median
as a ratio to the reference, torchrun unless the benchmark says otherwise) and prints a markdown
table for the README, headed by the machine it ran on. A benchmark that fails is reported in the
table and the others go on.

    hatch run bench:all                      # everything, default sizes (on a quiet machine)
    hatch run bench:all --quick --repeats 1  # a smoke run of everything
    hatch run bench:all --only throughput,recovery

`bench:gpu` is part of it only where a GPU is visible.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from raysgd_examples.bench._common import (
    child_env,
    gpu_count,
    machine_info,
    pyplot,
    save_figure,
)

__all__ = ["BENCHMARKS", "chart", "main", "markdown_table"]

BENCHMARKS = (
    "core_startup",
    "throughput",
    "startup",
    "recovery",
    "amp",
    "tune_overhead",
    "checkpoint",
)
#: Run by default only where a GPU is visible (its own script, `bench:gpu`, says so otherwise).
GPU_BENCHMARKS = ("gpu",)


def _gpu_visible() -> bool:
    return gpu_count() > 0


def _ratios(metric: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """(reference name, ratios) of a metric: ``ratio_vs_torchrun`` or another ``ratio_vs_*``."""
    for key, value in metric.items():
        if key.startswith("ratio_vs_") and value:
            return key[len("ratio_vs_") :], value
    return "torchrun", {}


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def markdown_table(results: dict[str, Any], machine: dict[str, Any]) -> str:
    """One row per benchmark side: median, unit, and ratio to the benchmark's reference."""
    lines = [
        f"Machine: {machine['platform']}, {machine['cpu_count']} CPUs, Python {machine['python']}, "
        f"torch {machine['torch']}, Ray {machine['ray']}.",
        "",
        "| benchmark | metric | side | median | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, payload in results.items():
        if "error" in payload:
            lines.append(f"| {name} | — | — | failed: {payload['error'][:80]} | — |")
            continue
        for m in payload.get("metrics", []):
            reference, ratios = _ratios(m)
            better = "higher" if m.get("higher_is_better") else "lower"
            for side, s in m["sides"].items():
                if "error" in s:
                    cell, ratio = f"failed: {s['error'].splitlines()[0][:60]}", "—"
                else:
                    cell = f"{_fmt(s['median'])} {m['unit']}"
                    ratio = f"{ratios[side]:.2f}x {reference}" if side in ratios else "—"
                lines.append(
                    f"| {name} | {m['metric']} ({better} is better) | {side} | {cell} | {ratio} |"
                )
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> Optional[Path]:
    """A horizontal bar per side and metric: its median over the reference's (1.0 = same)."""
    plt = pyplot()

    panels = []
    for name, payload in results.items():
        for m in payload.get("metrics", []):
            reference, ratios = _ratios(m)
            if ratios:
                panels.append((f"{name}: {m['metric']}", reference, m, ratios))
    if not panels:
        return None
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 1.0 + 1.1 * sum(len(p[3]) for p in panels)), squeeze=False
    )
    for ax, (title, reference, m, ratios) in zip(axes[:, 0], panels):
        sides = list(ratios)
        ax.barh(sides, [ratios[s] for s in sides], color="tab:blue")
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xlim(0, 1.15 * max(1.0, *ratios.values()))  # room for the value labels
        better = "higher" if m.get("higher_is_better") else "lower"
        ax.set_title(f"{title}\n(ratio to {reference}; {better} is better)", fontsize=9)
        for y, side in enumerate(sides):
            ax.text(ratios[side], y, f" {ratios[side]:.2f}", va="center", fontsize=8)
    return save_figure(fig, path)


def _run_one(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    module = f"raysgd_examples.bench.{name}"
    if importlib.util.find_spec(module) is None:
        return {"error": "not available"}
    cmd = [sys.executable, "-m", module, "--out", str(out)]
    if args.quick:
        cmd.append("--quick")
    if args.repeats is not None:
        cmd += ["--repeats", str(args.repeats)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    started = time.time()
    try:
        proc = subprocess.run(cmd, timeout=args.timeout, env=child_env(), check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    path = out / f"{name}.json"
    if proc.returncode != 0 or not path.exists() or path.stat().st_mtime < started:
        return {"error": f"exit code {proc.returncode}, no fresh {path.name}"}
    return json.loads(path.read_text())


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the benchmarks; write all.json and chart.png; print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="passed to every benchmark")
    parser.add_argument("--steps", type=int, default=None, help="passed to every benchmark")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated subset (default: all; gpu only where a GPU is visible)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark")
    args = parser.parse_args(argv)
    if args.only is None:
        chosen = list(BENCHMARKS) + (list(GPU_BENCHMARKS) if _gpu_visible() else [])
    else:
        chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    known = BENCHMARKS + GPU_BENCHMARKS
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"--only: unknown {unknown}; known: {list(known)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: _run_one(name, args, out) for name in chosen}
    machine = machine_info()
    summary = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "quick": args.quick,
        "benchmarks": results,
    }
    (out / "all.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = chart(results, out / "chart.png")
    table = markdown_table(results, machine)
    (out / "table.md").write_text(table + "\n")
    print(f"\nwrote {out / 'all.json'}, {out / 'table.md'}" + (f", {png}" if png else ""))
    print("\n" + table)
    return summary


if __name__ == "__main__":
    main()
