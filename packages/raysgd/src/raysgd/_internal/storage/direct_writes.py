"""Large local files written around the system's page cache (``O_DIRECT`` on Linux).

A checkpoint part of a billion-parameter model is gigabytes written in the background while the
training runs. Through the page cache every byte costs a copy into freshly mapped cache pages and
later the kernel's writeback, both on the training's cores; and the checkpoint fills memory the
training may want. Written directly, the bytes go from one reused, aligned buffer to the device,
and the cache is left alone. A file system that refuses direct writes (tmpfs, some network
mounts) gets the same bytes through the cache: the file is identical either way.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from typing import Union

try:
    import fcntl
except ImportError:  # Windows: no direct writes, and nothing here calls fcntl
    fcntl = None  # type: ignore[assignment]

__all__ = ["DirectFile", "open_flags"]

logger = logging.getLogger("raysgd")

#: Direct writes must start and end on the device's block boundaries, from memory aligned the
#: same way: 4096 is a multiple of every common logical block size (512 and 4096 bytes).
BLOCK = 4096
#: The aligned buffer the bytes pass through: large enough that a write is one big request.
CHUNK = 8 << 20

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def open_flags() -> int:
    """The extra `os.open` flag for a file meant for `DirectFile` (0 where there is none)."""
    return _O_DIRECT


class DirectFile:
    """A binary file for sequential `write`s onto an open descriptor (opened with `open_flags()`
    or not), from where it stands: the bytes are gathered in an aligned buffer and written a chunk
    at a time; `close` writes the last, partial block padded and truncates the file to the bytes
    written. Closing leaves the descriptor open (its owner syncs and closes it)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as direct writes need
        self._view = memoryview(self._buffer)
        self._filled = 0
        self._start = os.lseek(fd, 0, os.SEEK_CUR)
        self._size = 0
        self._closed = False

    def write(self, data: Union[bytes, bytearray, memoryview]) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            take = min(len(view) - done, CHUNK - self._filled)
            self._view[self._filled : self._filled + take] = view[done : done + take]
            self._filled += take
            done += take
            if self._filled == CHUNK:
                self._drain(CHUNK)
        self._size += done
        return done

    @property
    def direct(self) -> bool:
        """Whether the writes go around the page cache (False once the file system refused)."""
        return _direct(self._fd)

    def flush(self) -> None:
        """Nothing to do: only whole blocks can be written before `close`."""

    def close(self) -> None:
        """Write what is left (the last block padded) and cut the file to the bytes written."""
        if self._closed:
            return
        try:
            if self._filled:
                padded = -(-self._filled // BLOCK) * BLOCK
                self._view[self._filled : padded] = bytes(padded - self._filled)
                self._drain(padded)
            os.ftruncate(self._fd, self._start + self._size)
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop what is not written yet and free the buffer (the file is being given up)."""
        if not self._closed:
            self._closed = True
            self._view.release()
            self._buffer.close()

    def _drain(self, length: int) -> None:
        written = 0
        while written < length:
            try:
                written += os.write(self._fd, self._view[written:length])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _direct(self._fd):
                    raise
                # The file system took the flag at open but refuses direct writes: go on cached.
                logger.debug("direct writes refused; writing through the page cache")
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self._filled = 0


def _direct(fd: int) -> bool:
    return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)
