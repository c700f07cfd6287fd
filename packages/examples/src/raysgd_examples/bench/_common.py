"""What every benchmark script shares: arguments, child processes, medians, JSON, ratio tables.

Each measurement runs in a fresh child process (`python -m <script> --child <side> ...`) that prints
one ``BENCH_RESULT <json>`` line. That keeps the sides apart: no Ray cluster idles in the background
while torchrun is measured, and a cold start is really cold. The sides of one benchmark are run
round-robin, repeat after repeat, so that drift on a shared machine hits them all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = [
    "REFERENCE",
    "bench_parser",
    "child_main",
    "dispatch",
    "gpu_count",
    "local_ray",
    "machine_info",
    "metric",
    "parse_args",
    "print_metric",
    "process_alive",
    "pyplot",
    "run_child",
    "run_rounds",
    "run_torchrun",
    "save_figure",
    "selected_sides",
    "write_results",
]

#: Every ratio is taken against this side: torchrun is the zero-overhead reference.
REFERENCE = "torchrun"
_MARKER = "BENCH_RESULT "


def bench_parser(
    description: str, *, sides: Sequence[str], repeats: int, timeout_s: float = 600.0
) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: --repeats, --steps, --quick, --out, --sides, and
    --timeout (seconds per child run, `timeout_s` by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats, help="runs per side (median)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not data")
    parser.add_argument("--out", default="bench_results", help="folder for <name>.json")
    parser.add_argument(
        "--sides", default=",".join(sides), help=f"comma-separated subset of {','.join(sides)}"
    )
    parser.add_argument("--timeout", type=float, default=timeout_s, help="seconds per child run")
    # Internal: run one measurement of one side in this process and print it.
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Optional[Sequence[str]],
    *,
    steps: int,
    quick_steps: int,
) -> argparse.Namespace:
    """Parse; fill --steps (and --repeats: 1) from --quick; keep the raw argv for the children."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    if args.steps is None:
        args.steps = quick_steps if args.quick else steps
    if args.quick and not any(a == "--repeats" or a.startswith("--repeats=") for a in raw):
        args.repeats = 1
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    args.argv = raw
    return args


def selected_sides(args: argparse.Namespace, known: Sequence[str]) -> list[str]:
    """The --sides subset, validated against the benchmark's known sides."""
    chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; known: {list(known)}")
    return chosen


def child_env() -> dict[str, str]:
    """Environment for child processes: no usage-stats prompt, one OpenMP thread per process."""
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # torchrun sets this too; set it everywhere so no side gets more threads by accident.
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_child(module: str, side: str, argv: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run ``python -m module --child side *argv`` and return the dict it printed."""
    cmd = [sys.executable, "-m", module, "--child", side, *argv]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), check=False
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])
    tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
    raise RuntimeError(f"{side}: child exited with {proc.returncode} and no result:\n{tail}")


def child_main(measure: Callable[[str, argparse.Namespace], dict[str, Any]], args: Any) -> None:
    """Body of a child process: measure one side once and print the result line."""
    result = measure(args.child, args)
    print(_MARKER + json.dumps(result), flush=True)


def run_torchrun(
    module: str, argv: Sequence[str], *, nproc: int = 2, extra: Sequence[str] = (), timeout: float
) -> float:
    """Run ``torchrun --standalone --nproc_per_node=nproc [extra] -m module argv``; return seconds.

    Launched as ``python -m torch.distributed.run`` so it uses this interpreter's torch.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", *extra, "-m", module, *argv,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), check=False
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        # The workers' tracebacks come first, torchrun's summary last: show both ends.
        err = (
            proc.stderr
            if len(proc.stderr) < 5000
            else proc.stderr[:3000] + "\n...\n" + proc.stderr[-2000:]
        )
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{err}")
    return elapsed


@contextlib.contextmanager
def local_ray(num_cpus: int = 4, *, settle: bool = False, raysgd: bool = False) -> Iterator[None]:
    """A private local Ray cluster (never someone else's: address="local"), dashboard off.

    `settle=True` makes it warm: one task has run and Ray's start-up work (prestarting idle
    workers) has had a second to finish before the caller starts its clock. `raysgd=True` starts
    it the way raysgd starts its embedded Ray (`raysgd_core.local_ray_options()`: no dashboard, no
    metrics export); the other sides get Ray's defaults with the dashboard off.
    """
    import ray

    options: dict[str, Any] = {"include_dashboard": False}
    if raysgd:
        from raysgd_core import local_ray_options

        options = local_ray_options()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        log_to_driver=False,
        configure_logging=False,
        **options,
    )
    try:
        if settle:
            ray.get(ray.remote(num_cpus=0)(_noop).remote())
            time.sleep(1.0)
        yield
    finally:
        ray.shutdown()


def _noop() -> None:
    return None


def dispatch(
    module: str,
    measure: Callable[[str, argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    known_sides: Sequence[str],
) -> Optional[dict[str, list[dict[str, Any]]]]:
    """The shape of every benchmark's main: in a child process, measure one side and return None;
    in the parent, run each selected side in its own child, repeat after repeat, and return the runs.
    """
    if args.child:
        child_main(measure, args)
        return None
    return run_rounds(
        lambda side: run_child(module, side, args.argv, args.timeout),
        selected_sides(args, known_sides),
        args.repeats,
    )


def run_rounds(
    run_one: Callable[[str], dict[str, Any]],
    sides: Sequence[str],
    repeats: int,
    *,
    alternate: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Call ``run_one(side)`` for every side, round-robin, `repeats` times.

    With `alternate`, every other round runs the sides in reverse order (A-B-C, C-B-A, ...), so
    that a side never always runs right after the same other one. A side that fails is reported
    and skipped from then on; the others go on.
    """
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    failed: dict[str, str] = {}
    for rep in range(repeats):
        for side in list(sides)[:: -1 if alternate and rep % 2 else 1]:
            if side in failed:
                continue
            try:
                results[side].append(run_one(side))
                print(f"  [{rep + 1}/{repeats}] {side}: {results[side][-1]}", flush=True)
            except Exception as exc:  # a broken side must not hide the others' numbers
                failed[side] = f"{type(exc).__name__}: {exc}"
                print(f"  [{rep + 1}/{repeats}] {side} FAILED: {failed[side]}", flush=True)
                if os.environ.get("RAYSGD_BENCH_DEBUG"):
                    traceback.print_exc()
    for side, error in failed.items():
        results[side] = [{"error": error}]
    return results


def metric(
    name: str,
    unit: str,
    higher_is_better: bool,
    runs: dict[str, list[dict[str, Any]]],
    key: str,
    note: str = "",
    reference: str = REFERENCE,
) -> dict[str, Any]:
    """One metric's summary: per side the values of `key`, their median, and the ratio to the
    `reference` side's median (``ratio_vs_<reference>``; torchrun unless told otherwise)."""
    sides: dict[str, Any] = {}
    for side, side_runs in runs.items():
        errors = [r["error"] for r in side_runs if "error" in r]
        values = [float(r[key]) for r in side_runs if key in r]
        if values:
            sides[side] = {"values": values, "median": statistics.median(values)}
        else:
            sides[side] = {"error": errors[0] if errors else f"no {key!r} in results"}
    ref = sides.get(reference, {}).get("median")
    ratios = {
        side: s["median"] / ref
        for side, s in sides.items()
        if side != reference and "median" in s and ref
    }
    return {
        "metric": name,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "sides": sides,
        f"ratio_vs_{reference}": ratios,
        "note": note,
    }


def print_metric(m: dict[str, Any]) -> None:
    """A small table: side, median, ratio to the reference, and which direction is better."""
    better = "higher" if m["higher_is_better"] else "lower"
    reference = next((k[len("ratio_vs_") :] for k in m if k.startswith("ratio_vs_")), REFERENCE)
    print(f"\n{m['metric']} ({m['unit']}, {better} is better)")
    for side, s in m["sides"].items():
        if "error" in s:
            print(f"  {side:<22} error: {s['error'].splitlines()[0][:100]}")
            continue
        ratio = m.get(f"ratio_vs_{reference}", {}).get(side)
        rtxt = f"{ratio:6.3f}x {reference}" if ratio is not None else ""
        print(f"  {side:<22} {s['median']:10.3f}  (n={len(s['values'])})  {rtxt}")
    if m.get("note"):
        print(f"  note: {m['note']}")


def machine_info() -> dict[str, Any]:
    """Where the numbers were taken (to print next to the table)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    for mod in ("torch", "ray"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def write_results(
    out: str, name: str, metrics: list[dict[str, Any]], args: argparse.Namespace, **extra: Any
) -> Path:
    """Write ``<out>/<name>.json`` with the metrics, the machine and the arguments; print the path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "argv")},
        "metrics": metrics,
        **extra,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (a zombie waiting for its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gpu_count() -> int:
    """CUDA devices this process sees (0 without torch, without CUDA or without a GPU)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (a benchmark machine has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay `fig` out, write it to `path` (its folder made if missing) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
