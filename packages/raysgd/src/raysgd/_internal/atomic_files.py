"""Local files replaced atomically: a reader sees the old file or the new one, never a part, and
the new one survives a crash once written (fsync of the file, then of its folder)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Union

__all__ = ["SCRATCH_PREFIX", "atomic_local_file", "write_file"]

#: The start of the names of files raysgd writes that are never a checkpoint's parts: the atomic
#: writes' temp files and `Storage.check_access`'s probe.
SCRATCH_PREFIX = ".raysgd-"


def write_file(path: Union[str, os.PathLike[str]], data: Union[bytes, memoryview]) -> str:
    """Write `data` to the local `path` atomically (see `atomic_local_file`); the path written."""
    path = os.path.abspath(os.fspath(path))
    with atomic_local_file(path) as handle:
        handle.write(data)
    return path


@contextmanager
def atomic_local_file(path: str) -> Iterator[IO[bytes]]:
    """A binary file that becomes the local `path` only when the block ends without an error: a
    temp file in the same folder, fsynced, renamed over `path` with `os.replace`, then the folder
    fsynced so that the rename itself survives a crash. The file gets the permissions of any new
    file (0666 less the umask)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{SCRATCH_PREFIX}{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Persist the folder's entry for a renamed file (POSIX; folders cannot be opened on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the data itself is synced
        pass
    finally:
        os.close(fd)
