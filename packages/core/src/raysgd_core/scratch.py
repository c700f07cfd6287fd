"""A worker's scratch folder: files a worker writes for a moment, removed even when it is killed.

Some files live only for a moment: a checkpoint on its way to Tune, a snapshot between
`torch.distributed.checkpoint` and memory, a state being loaded. A process that is killed (out of
memory, preempted, a trial stopped by its scheduler, a test's fault) never removes them, and on a
node whose workers die again and again they pile up, on disk or in memory (/dev/shm).

So each process keeps them in one folder of its own per parent folder, `scratch_dir()`, and holds a
lock on a file in it for as long as it lives. The kernel releases that lock when the process ends,
however it ends. Every worker that starts on the node removes the folders whose lock is free
(`sweep_scratch`): their process is gone. A lock, unlike a process id, also holds where processes
of several containers share one folder without seeing each other's process ids.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Optional

__all__ = ["SCRATCH_PREFIX", "scratch_dir", "sweep_scratch"]

logger = logging.getLogger(__name__)

#: What every scratch folder's name starts with (the process id follows, for people reading).
SCRATCH_PREFIX = "raysgd-scratch-"
_LOCK_FILE = ".owner"
#: Memory as a folder: scratch folders there are swept too.
_SHM = "/dev/shm"
#: A folder younger than this is left alone: its process may not have taken its lock yet.
_MIN_AGE_S = 60.0

#: This process's scratch folder per parent folder, and the descriptors that hold their locks.
_mine: dict[str, str] = {}
_held: list[int] = []


def scratch_dir(parent: Optional[str] = None) -> str:
    """This process's scratch folder in `parent` (default: the temporary directory), made on
    first use. Make a folder of its own inside it per use (`tempfile.mkdtemp(dir=...)`) and
    remove it when done; whatever is left goes once the process is gone."""
    parent = os.path.realpath(parent or tempfile.gettempdir())
    path = _mine.get(parent)
    if path is not None and os.path.isdir(path):
        return path
    path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent)
    fd = os.open(os.path.join(path, _LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o600)
    # Held until the process ends; a forked child shares it, which keeps the folder for the
    # child's life too.
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held.append(fd)
    _mine[parent] = path
    return path


def sweep_scratch(parents: Optional[Iterable[str]] = None, *, min_age_s: float = _MIN_AGE_S) -> int:
    """Remove the scratch folders in `parents` (default: the temporary directory and /dev/shm)
    whose process is gone; how many went."""
    if parents is None:
        parents = [tempfile.gettempdir(), *([_SHM] if os.path.isdir(_SHM) else [])]
    now, removed = time.time(), 0
    for parent in parents:
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            try:
                candidate = (
                    entry.name.startswith(SCRATCH_PREFIX)
                    and entry.is_dir(follow_symlinks=False)
                    and now - entry.stat(follow_symlinks=False).st_mtime >= min_age_s
                )
            except OSError:  # gone meanwhile
                continue
            if candidate and _owner_gone(entry.path):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    if removed:
        logger.debug("removed %d scratch folders of processes that are gone", removed)
    return removed


def _owner_gone(path: str) -> bool:
    """Whether no process holds the lock of the scratch folder at `path`."""
    try:
        fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDWR)
    except FileNotFoundError:
        return True  # its process ended before it took the lock (the folder is old enough)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process lives (this one's own folders too), or cannot tell
        return False
    finally:
        os.close(fd)
    return True
