"""Ranks of a real gloo group as plain processes, for checks of torch.distributed code without Ray.

`run_ranks` starts a script once per rank and waits for all of them; the script forms the group
itself (a file store) from the arguments it is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["run_ranks"]


def run_ranks(
    script: Path, world_size: int, argv: Callable[[int], Sequence[str]], timeout_s: float = 90
) -> None:
    """Run `script` as ranks 0 .. `world_size` - 1, each with ``argv(rank)``, one thread each
    for torch; fail with a rank's output when it fails or outlives `timeout_s`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *argv(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
