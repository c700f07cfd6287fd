"""One checkpoint: the formats raysgd writes and reads, on any `Storage`. Which checkpoints a
root holds, their names and which is the newest are `catalog`'s.

Two formats, and either loads into a trainer of any strategy and any number of workers:

- a **file**: the whole training state (`TorchTrainer.state_dict()`: `epoch`, `models`,
  `optimizers`, `schedulers`, the precision backend's state, the position in the epoch), written
  with `torch.save`; RaySGD 1.x's format, what `save(path)` writes when every worker holds the
  whole model (``ddp``, ``none``). One worker writes it, atomically.
- a **folder** with a manifest: its parts and a small JSON manifest (`MANIFEST_NAME`) written
  last. A sharded state (``fsdp``) is DCP's `.metadata`, one `__<rank>_0.distcp` per worker (each
  written by its worker) and `STATE_FILE` (the small rest); a whole state in a folder (the
  checkpoints `checkpoint_every` writes) is `WHOLE_FILE`. The manifest's `kind` says which.

A checkpoint is complete or invisible. A file is replaced atomically (a local temp file renamed over
it; an object store's upload, which shows the object only once it is complete). A whole state is
streamed into its file (`write_state`), never serialised into memory first. A folder's parts come
first (each worker writes its own) and the manifest last (`write_manifest`, which checks the parts
it was told to expect); a folder whose parts do not match its manifest (`parts_problem`) is no
checkpoint. The one `train(checkpoint="auto")` writes, replaced each time, has a fixed name
(`AUTO_NAMES`, by kind).

Reading never runs code from a checkpoint: states load with `torch.load(weights_only=True)`
(`state_from_bytes`) and DCP's metadata through raysgd_operator's restricted reader.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional, Union

import torch

from raysgd._internal.storage.location import PathLike, Storage, as_storage, is_scratch
from raysgd_operator import load_failure_reason, read_dcp_metadata
from raysgd_operator.sharded_files import METADATA_FILE

__all__ = [
    "AUTO_NAMES",
    "CHECKPOINT_KEYS",
    "GATHERED_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "METADATA_FILE",
    "SHARDED",
    "STATE_FILE",
    "WHOLE",
    "WHOLE_FILE",
    "Checkpoint",
    "Manifest",
    "checkpoint_position",
    "gathered",
    "gathered_files",
    "parts_problem",
    "read_file",
    "read_manifest",
    "read_sharded",
    "state_from_bytes",
    "state_to_bytes",
    "write_manifest",
    "write_state",
]

logger = logging.getLogger("raysgd")

#: Keys every raysgd (and RaySGD 1.x) whole state has; used to tell a checkpoint from another file.
CHECKPOINT_KEYS = ("models",)
#: The small rest of a sharded state in its folder (epoch, position, schedulers, ...).
STATE_FILE = "raysgd_state.pt"
#: The whole state in a folder of kind `WHOLE`.
WHOLE_FILE = "raysgd_checkpoint.pt"
#: Manifest kinds: the parts of a sharded state, or one whole state.
SHARDED = "sharded"
WHOLE = "whole"
#: The name of the checkpoint `train(checkpoint="auto")` writes, and replaces, in `checkpoint_dir`,
#: by kind: one file for a whole state, a folder for a sharded one.
AUTO_NAMES = {WHOLE: "raysgd_checkpoint.pt", SHARDED: "raysgd_checkpoint"}
#: `format` of the dict a sharded trainer's `state_dict()` returns (its folder's files as bytes).
GATHERED_FORMAT = "raysgd-dcp"


# -- the whole state as bytes --


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """`torch.save` into memory."""
    buffer = io.BytesIO()
    _save(state, buffer)
    return buffer.getvalue()


def write_state(folder: Storage, name: str, state: dict[str, Any]) -> None:
    """`torch.save` straight into the file `name` of `folder`, streamed: a large state is not
    serialised into memory first (a copy of its size), and the writing thread holds the GIL in
    short stretches instead of for each whole copy, so the training loop beside it keeps going."""
    folder.write_stream(name, lambda handle: _save(state, handle))


try:  # torch >= 2.6; earlier releases always compute the checksum
    from torch.utils.serialization import config as _serialization_config
except ImportError:
    _serialization_config = None  # type: ignore[assignment]
#: The serialization config is the process's: two saves interleaving in threads could restore
#: each other's setting out of order and leave the checksum off for the user's own saves.
_SAVE_CONFIG_LOCK = threading.Lock()


def _save(state: dict[str, Any], handle: Any) -> None:
    """`torch.save` without a CRC-32 of each record: `torch.load` never checks it (a flipped byte
    loads all the same), and computing it is most of the CPU a save of tensors costs (about three
    quarters for a 300 MB state on a 2-core CPU machine), CPU that a background checkpoint takes
    from the training loop beside it. A checkpoint's integrity is its manifest's part sizes."""
    if _serialization_config is None:
        torch.save(state, handle)
        return
    with _SAVE_CONFIG_LOCK, _serialization_config.patch({"save.compute_crc32": False}):
        torch.save(state, handle)


def state_from_bytes(data: bytes, *, source: str = "state") -> dict[str, Any]:
    """Load a whole state safely onto the CPU; anything that is not one is a ValueError."""
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


def read_file(location: Storage) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a checkpoint file and the whole state they hold (validated, loaded safely)."""
    data = location.parent().read_bytes(location.name)
    return data, state_from_bytes(data, source=f"file {location.url!r}")


def checkpoint_position(location: Storage) -> tuple[int, int]:
    """(epoch, step) of the checkpoint at `location` (a file or a folder), to order it among
    others; only its counters are read."""
    if location.is_folder():
        manifest = read_manifest(location)
        if manifest is not None:
            return manifest.epoch, manifest.step
        _, rest = read_sharded(location)
        return int(rest.get("epoch", 0)), int(rest.get("step", 0))
    # The tensors land on the meta device, so their bytes are never read: on an object store the
    # file is read by ranges (the archive's index and its pickle), not downloaded whole.
    try:
        with location.fs.open(location.path, "rb") as file:
            state = torch.load(file, map_location="meta", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types; all mean "not a checkpoint"
        raise ValueError(
            f"file {location.url!r} is not a raysgd checkpoint: {load_failure_reason(exc)}"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"file {location.url!r} is not a raysgd checkpoint")
    return int(state.get("epoch", 0)), int(state.get("step", 0))


def gathered(files: Mapping[str, bytes]) -> dict[str, Any]:
    """A sharded state in one process: its checkpoint folder's files as bytes."""
    return {"format": GATHERED_FORMAT, "files": dict(files)}


def gathered_files(state: Mapping[str, Any]) -> Optional[dict[str, bytes]]:
    """The files of a state made by `gathered`, their names checked (plain file names only);
    None for a whole state's dict."""
    if state.get("format") != GATHERED_FORMAT:
        return None
    files = state.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, bytes) for v in files.values()):
        raise ValueError("a sharded state dict must hold {'files': {name: bytes}}")
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"bad file name in sharded state: {name!r}")
    return files


def read_sharded(folder: Storage) -> tuple[bytes, dict[str, Any]]:
    """(DCP metadata, the rest of the state) of a sharded checkpoint folder, validated; nothing in
    it runs as code."""
    metadata = folder.read_bytes(METADATA_FILE)
    read_dcp_metadata(metadata)  # raises ValueError unless it is plain DCP metadata
    where = folder.display(STATE_FILE)
    try:
        state = torch.load(
            io.BytesIO(folder.read_bytes(STATE_FILE)), map_location="cpu", weights_only=True
        )
    except FileNotFoundError:
        raise ValueError(f"{where} is missing: not a raysgd checkpoint folder") from None
    except Exception as exc:  # unpickling errors come in many types; all mean "not ours"
        raise ValueError(
            f"{where} is not a raysgd checkpoint file that can be loaded safely: "
            f"{load_failure_reason(exc)}"
        ) from None
    if not isinstance(state, dict) or "epoch" not in state:
        raise ValueError(f"{where} is not a raysgd state")
    return metadata, state


#: The file that makes a folder a checkpoint; written after every part.
MANIFEST_NAME = "raysgd-manifest.json"
#: The manifest format this code writes; it reads this one and older ones.
MANIFEST_VERSION = 1
#: `format` of every manifest, to tell it from another JSON file of the same name.
_MANIFEST_FORMAT = "raysgd-checkpoint"

# -- folders: complete or invisible --


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint folder holds; written last, so its presence means the parts are there.

    `parts` maps each file's path inside the folder to its size in bytes. `meta` is small
    JSON-able data of the writer's own (never credentials). `created` is the writer's clock, in
    seconds since the epoch.
    """

    kind: str
    epoch: int
    step: int
    parts: Mapping[str, int]
    created: float = field(default_factory=time.time)
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    @property
    def order(self) -> tuple[int, int, float]:
        """How checkpoints are ordered: (epoch, step), then creation time; larger is newer."""
        return (self.epoch, self.step, self.created)

    def to_bytes(self) -> bytes:
        """The manifest as JSON (UTF-8)."""
        document = {
            "format": _MANIFEST_FORMAT,
            "version": self.version,
            "kind": self.kind,
            "epoch": self.epoch,
            "step": self.step,
            "created": self.created,
            "parts": [{"path": p, "size": s} for p, s in sorted(self.parts.items())],
            "meta": dict(self.meta),
        }
        return (json.dumps(document, indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "manifest") -> Manifest:
        """Parse and check a manifest; anything else is a ValueError naming `source`."""

        def bad(why: str) -> NoReturn:
            raise ValueError(f"{source} is not a raysgd checkpoint manifest: {why}")

        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            bad(f"not JSON ({exc})")
        if not isinstance(doc, dict) or doc.get("format") != _MANIFEST_FORMAT:
            bad(f"no 'format': {_MANIFEST_FORMAT!r}")
        version = doc.get("version")
        if not _is_int(version) or version < 1:
            bad(f"bad version {version!r}")
        if version > MANIFEST_VERSION:
            raise ValueError(
                f"{source} was written by a newer raysgd (manifest version {version}; this one "
                f"reads up to {MANIFEST_VERSION})"
            )
        kind, epoch, step, created = (doc.get(k) for k in ("kind", "epoch", "step", "created"))
        if not isinstance(kind, str) or not kind:
            bad("'kind' must be a non-empty string")
        if not _is_int(epoch) or not _is_int(step) or epoch < 0 or step < 0:
            bad("'epoch' and 'step' must be ints >= 0")
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            bad("'created' must be a number")
        parts: dict[str, int] = {}
        raw_parts = doc.get("parts")
        if not isinstance(raw_parts, list):
            bad("'parts' must be a list")
        for entry in raw_parts:
            path = entry.get("path") if isinstance(entry, dict) else None
            size = entry.get("size") if isinstance(entry, dict) else None
            if not _is_part_name(path) or not _is_int(size) or size < 0 or path in parts:
                bad(f"bad part {entry!r}")
            parts[path] = size
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            bad("'meta' must be an object")
        return cls(kind, epoch, step, parts, float(created), meta, version)


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: its folder and its manifest."""

    location: Storage
    manifest: Manifest

    @property
    def url(self) -> str:
        """The folder's URL (its absolute path when local)."""
        return self.location.url

    @property
    def name(self) -> str:
        """The folder's name."""
        return self.location.name

    @property
    def epoch(self) -> int:
        """The manifest's epoch."""
        return self.manifest.epoch

    @property
    def step(self) -> int:
        """The manifest's step."""
        return self.manifest.step

    @property
    def kind(self) -> str:
        """The manifest's kind (what the parts are, for the loader)."""
        return self.manifest.kind

    @property
    def state_location(self) -> Storage:
        """What a load reads: the folder of a sharded checkpoint, the one state file of a
        whole one."""
        return self.location.join(WHOLE_FILE) if self.kind == WHOLE else self.location


def write_manifest(
    folder: Storage,
    kind: str,
    epoch: int,
    step: int,
    *,
    expected: Optional[Mapping[str, Optional[int]]] = None,
    meta: Optional[Mapping[str, Any]] = None,
) -> Checkpoint:
    """Make `folder` a checkpoint: list its parts (every file but the manifest and scratch files)
    and write the manifest naming them, last.

    Raises:
        ValueError: no part at all, or a part of `expected` (name -> size, None for any) is
            missing or has another size (no manifest is written: the folder stays invisible).
    """
    try:
        found = folder.file_sizes()
    except FileNotFoundError:
        found = {}
    parts = {p: s for p, s in found.items() if not is_scratch(p) and p != MANIFEST_NAME}
    for part, size in (expected or {}).items():
        if part not in parts:
            raise ValueError(f"checkpoint {folder.url}: part {part!r} was not written")
        if size is not None and parts[part] != size:
            raise ValueError(
                f"checkpoint {folder.url}: part {part!r} has {parts[part]} bytes, expected {size}"
            )
    if not parts:
        raise ValueError(f"checkpoint {folder.url}: no part was written")
    manifest = Manifest(kind, epoch, step, parts, meta=dict(meta or {}))
    data = manifest.to_bytes()  # raises before writing anything if meta is not JSON
    folder.write_bytes(MANIFEST_NAME, data)
    return Checkpoint(folder, manifest)


def read_manifest(
    folder: Union[Storage, PathLike], storage_options: Optional[Mapping[str, Any]] = None
) -> Optional[Manifest]:
    """The manifest of `folder`, or None when it has none (the folder may be missing too).

    Raises:
        ValueError: a manifest is there but is not one this raysgd can read.
    """
    folder = as_storage(folder, storage_options)
    try:
        data = folder.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    return Manifest.from_bytes(data, source=f"{folder.url}/{MANIFEST_NAME}")


# -- inside --


def parts_problem(folder: Storage, manifest: Manifest) -> Optional[str]:
    """Why the parts of `folder` do not match its manifest (naming the part's path), or None when
    they do."""
    try:
        sizes = folder.file_sizes()
    except FileNotFoundError:
        sizes = {}
    for part, size in sorted(manifest.parts.items()):
        if part not in sizes:
            return f"{folder.display(part)} is missing"
        if sizes[part] != size:
            return f"{folder.display(part)} has {sizes[part]} bytes, the manifest says {size}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_part_name(path: Any) -> bool:
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        return False
    return all(name not in ("", ".", "..") for name in path.split("/"))
