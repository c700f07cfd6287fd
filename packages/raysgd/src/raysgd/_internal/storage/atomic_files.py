"""Local files and folders replaced atomically: a reader sees the old one or the new one, never a
part, and a new file survives a crash once written (fsync of the file, then of its folder)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Union

from raysgd._internal.storage.direct_writes import DirectFile, open_flags

__all__ = ["SCRATCH_PREFIX", "atomic_local_file", "atomic_local_folder", "write_file"]

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
def atomic_local_file(path: str, *, direct: bool = False) -> Iterator[IO[bytes]]:
    """A binary file that becomes the local `path` only when the block ends without an error: a
    temp file in the same folder, fsynced, renamed over `path` with `os.replace`, then the folder
    fsynced so that the rename itself survives a crash. The file gets the permissions of any new
    file (0666 less the umask). With `direct`, for a large file written in order, the bytes go
    around the page cache where the file system allows (`direct_writes.DirectFile`)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{SCRATCH_PREFIX}{uuid.uuid4().hex}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = _open_new(tmp, flags | (open_flags() if direct else 0))
    open_fd = True
    try:
        if direct:
            handle = DirectFile(fd)
            try:
                yield handle  # type: ignore[misc]
            except BaseException:
                handle.discard()
                raise
            handle.close()
        else:
            with os.fdopen(fd, "wb", closefd=False) as stream:
                yield stream
        os.fsync(fd)
        open_fd = False
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if open_fd:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)


def _open_new(path: str, flags: int) -> int:
    """`os.open` with `flags` (mode 0666 less the umask), without the direct-write flag where the
    file system refuses it."""
    try:
        return os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not flags & open_flags():
            raise
        return os.open(path, flags & ~open_flags(), 0o666)


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


@contextmanager
def atomic_local_folder(path: str) -> Iterator[str]:
    """A folder (its path) that becomes the local `path` only when the block ends without an
    error: written beside it under a scratch name and renamed into place, an older folder at
    `path` moved aside first and removed only once the new one is there (put back if the rename
    fails). Removed when the block raises."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}folder-", dir=parent)
    try:
        yield tmp
        if not os.path.exists(path):
            os.replace(tmp, path)
            return
        old = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}old-", dir=parent)
        os.rmdir(old)
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)  # the older folder back
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
