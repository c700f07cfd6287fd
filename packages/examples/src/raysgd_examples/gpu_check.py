"""Check every GPU path of raysgd on the GPUs this machine has, in a few minutes.

    hatch run gpu-check                     # every check, on every visible GPU
    hatch run gpu-check --checks ddp,fp16   # some of them
    hatch run gpu-check --cpu-dry-run       # the same checks on CPU workers (gloo): the harness

Each check trains a tiny model for a few steps with `TorchTrainer` on a local Ray cluster started
once with the machine's GPUs, and prints one row of a table: the check, the placement and backend
it ran on, pass / FAIL / skip with a one-line reason, and its seconds. A check that raises fails
alone; the others still run. The exit status is 1 when a check failed, 0 when all passed or were
skipped, and 0 on a machine without a GPU, where it says so and checks nothing.

Placement: two workers per check. With two GPUs or more each worker has its own and the group uses
NCCL. With one GPU the two workers share it (`num_gpus_per_worker=0.5`) over gloo, because NCCL
refuses two ranks on one device; gloo carries CUDA tensors for all-reduce and broadcast only,
which is what ddp needs. fsdp also needs reduce-scatter and all-gather, so on one GPU the fsdp
checks run one worker on it (NCCL), which still takes the sharded state, snapshot and checkpoint
paths on the device; the table says which ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from raysgd_examples._gpu_checks import CHECKS, CheckFailed, CheckRun, Skipped, placements

__all__ = ["CheckResult", "format_table", "gpu_count", "main", "run_checks"]


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: status is "pass", "FAIL" or "skip"."""

    name: str
    placement: str
    status: str
    reason: str
    seconds: float
    traceback: str = ""


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(error, CheckFailed):
        return first
    return f"{type(error).__name__}: {first}"[:200]


def run_checks(
    names: Sequence[str], gpus: int, workdir: Path, *, echo: bool = True
) -> list[CheckResult]:
    """Run the named checks one after the other on a running Ray cluster; a check that raises
    fails alone. `gpus` is the GPUs the checks place their workers on (0: CPU workers)."""
    where = placements(gpus)
    run = CheckRun(workdir)
    results = []
    for name in names:
        check = CHECKS[name]
        placement = where["fsdp" if check.sharded else "ddp"]
        started = time.perf_counter()
        trace = ""
        try:
            status, reason = "pass", check.run(run, placement)
        except Skipped as skipped:
            status, reason = "skip", str(skipped)
        except Exception as error:
            status, reason, trace = "FAIL", _one_line(error), traceback.format_exc()
        result = CheckResult(
            name, placement.description, status, reason, time.perf_counter() - started, trace
        )
        results.append(result)
        if echo:
            print(f"  {name}: {status} ({result.seconds:.1f} s)", flush=True)
    return results


def format_table(results: Sequence[CheckResult]) -> str:
    """The results as an aligned text table: check, placement, result, seconds, reason."""
    rows = [("check", "placement", "result", "seconds", "reason")]
    rows += [(r.name, r.placement, r.status, f"{r.seconds:.1f}", r.reason) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [row[i].ljust(widths[i]) if i != 3 else row[i].rjust(widths[i]) for i in range(4)]
        lines.append("  ".join([*cells, row[4]]).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths) + "  ------")
    return "\n".join(lines)


def _machine_line(gpus: int) -> str:
    if gpus == 0:
        return (
            "CPU dry run: CPU workers over gloo stand in for the GPUs; this checks the checks, "
            "not the GPU paths"
        )
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    return (
        f"{gpus} GPU(s): {', '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def _notes(gpus: int, names: Sequence[str]) -> list[str]:
    if gpus != 1:
        return []
    notes = [
        "one GPU: the ddp-style checks ran two workers on it over gloo (NCCL refuses two ranks "
        "on one device; gloo carries CUDA all-reduce and broadcast, enough for ddp)"
    ]
    if any(CHECKS[n].sharded for n in names):
        notes.append(
            "one GPU: fsdp ran one worker (gloo has no CUDA reduce-scatter or all-gather), so "
            "fsdp_snapshot recovered from a checkpoint, not from a peer's snapshot"
        )
    return notes


@contextmanager
def _ray_cluster(gpus: int, verbose: bool) -> Iterator[None]:
    """The caller's Ray when one is running, else a private local one with this machine's GPUs."""
    import ray

    if ray.is_initialized():
        yield
        return
    from raysgd_core import local_ray_options

    ray.init(
        address="local",
        # Two workers and the driver's and Ray Data's tasks, also on a small machine.
        num_cpus=max(4, os.cpu_count() or 1),
        num_gpus=gpus,
        log_to_driver=verbose,
        configure_logging=False,
        **local_ray_options(),
    )
    try:
        yield
    finally:
        ray.shutdown()


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the checks and print their table; the exit status (1: a check failed)."""
    parser = argparse.ArgumentParser(
        prog="gpu-check", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated subset of: {', '.join(CHECKS)}",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the checks on CPU workers over gloo (checks the harness, not the GPU paths)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--verbose", action="store_true", help="raysgd's and the workers' logs")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        parser.error(f"--checks: unknown {unknown}; known: {', '.join(CHECKS)}")
    gpus = 0 if args.cpu_dry_run else gpu_count()
    if gpus == 0 and not args.cpu_dry_run:
        print(
            "gpu-check: no GPU here (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}): nothing was checked. Run it on a machine with an NVIDIA GPU "
            "and a CUDA build of torch, or with --cpu-dry-run to run the checks on CPU workers."
        )
        return 0
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    print(f"gpu-check: {_machine_line(gpus)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="raysgd-gpu-check-") as workdir:
        with _ray_cluster(gpus, args.verbose):
            results = run_checks(names, gpus, Path(workdir))
    print("\n" + format_table(results))
    for note in _notes(gpus, names):
        print(f"note: {note}")
    for result in results:
        if result.traceback:
            print(f"\n{result.name} failed:\n{result.traceback}", file=sys.stderr)
    failed = [r.name for r in results if r.status == "FAIL"]
    passed = sum(r.status == "pass" for r in results)
    print(
        f"\n{passed} passed, {len(failed)} failed, {len(results) - passed - len(failed)} skipped"
        + (f": {', '.join(failed)}" if failed else "")
    )
    if args.json:
        payload = {
            "machine": _machine_line(gpus),
            "gpus": gpus,
            "dry_run": bool(args.cpu_dry_run),
            "results": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
