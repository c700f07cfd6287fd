"""The trainer's state as bytes and as files.

The state is the dict of `OperatorRunner.state_dict()` (`epoch`, `operator`, `models`, `optimizers`,
`schedulers`, `precision`, `position`), serialised with `torch.save`. Reading never runs code from the
bytes (`torch.load(weights_only=True)`), and files are written atomically so that a crash mid-write
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any, Union

import torch

from raysgd_operator import load_failure_reason

__all__ = ["CHECKPOINT_KEYS", "read_file", "state_from_bytes", "state_to_bytes", "write_file"]

#: Keys every raysgd (and RaySGD 1.x) checkpoint has; used to tell a checkpoint from another file.
CHECKPOINT_KEYS = ("models",)

PathLike = Union[str, "os.PathLike[str]"]


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """`torch.save` into memory."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes, *, source: str = "state") -> dict[str, Any]:
    """Load a state dict safely onto the CPU; anything that is not one is a ValueError."""
    if not data:
        raise ValueError(f"{source} is empty (0 bytes): not a raysgd checkpoint")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types; all mean "not a checkpoint"
        raise ValueError(
            f"{source} is not a raysgd checkpoint that can be loaded safely: "
            f"{load_failure_reason(exc)}"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in CHECKPOINT_KEYS):
        raise ValueError(
            f"{source} is not a raysgd checkpoint: expected a dict with keys {CHECKPOINT_KEYS}"
        )
    return state


def write_file(path: PathLike, data: bytes) -> str:
    """Write `data` to `path` atomically: a temp file in the same folder, fsynced, renamed over
    `path` with `os.replace`, then the folder fsynced so that the rename itself survives a crash.

    The file gets the permissions of any new file (0666 less the umask), not `mkstemp`'s 0600.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".raysgd-ckpt-{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)
    return path


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


def read_file(path: PathLike) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a checkpoint file and the state they hold (validated, loaded safely)."""
    path = os.fspath(path)
    with open(path, "rb") as handle:
        data = handle.read()
    return data, state_from_bytes(data, source=f"file {path!r}")
