"""Scratch folders: what a killed worker left goes with the next sweep; nothing of a live process
does. Real processes, no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raysgd_core import scratch_dir
from raysgd_core.scratch import SCRATCH_PREFIX, sweep_scratch

# A process that makes its scratch folder, puts a file in it, prints the folder's path and then
# dies without cleaning up (SIGKILL-like: no exit handlers) or sleeps until it is killed.
_CHILD = """
import os, sys, time
from raysgd_core import scratch_dir
path = scratch_dir(sys.argv[1])
open(os.path.join(path, "part.distcp"), "wb").write(b"x" * 1000)
print(path, flush=True)
if sys.argv[2] == "die":
    os._exit(0)
time.sleep(60)
"""


def _child(parent: Path, how: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(parent), how], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_processes_scratch_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    dead, dead_path = _child(tmp_path, "die")
    dead.wait(timeout=30)
    live, live_path = _child(tmp_path, "live")
    try:
        mine = scratch_dir(str(tmp_path))
        assert scratch_dir(str(tmp_path)) == mine  # one per process and parent folder
        assert os.path.basename(dead_path).startswith(f"{SCRATCH_PREFIX}{dead.pid}-")
        not_ours = tmp_path / "someone-elses"
        not_ours.mkdir()
        # Too young to judge: its process may not have taken its lock yet.
        assert sweep_scratch([str(tmp_path)]) == 0 and os.path.isdir(dead_path)

        assert sweep_scratch([str(tmp_path), str(tmp_path / "missing")], min_age_s=0) == 1
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {os.path.basename(live_path), os.path.basename(mine), not_ours.name}

        live.kill()
        live.wait(timeout=30)  # its lock is released with its last descriptor
        assert sweep_scratch([str(tmp_path)], min_age_s=0) == 1
        assert {p.name for p in tmp_path.iterdir()} == {os.path.basename(mine), not_ours.name}
    finally:
        live.kill()
