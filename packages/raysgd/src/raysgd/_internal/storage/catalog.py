"""The checkpoints under a root (a `checkpoint_dir`): their names, which are complete, the newest,
pruning, and those a load that went back abandoned. What one checkpoint holds and how it is
written and read is `format`'s.

Under a root each checkpoint is a folder of its own, named per attempt (`checkpoint_name`: epoch,
step, a random suffix), so that a retry never writes into the folder of an interrupted attempt,
on an object store too (which has no rename). A folder counts as a checkpoint only when its
manifest is there and every part it lists is there with the size it lists (`format`); the
listings here (`newest_complete`, `resolve_checkpoint`, `prune`) see nothing else, nor the
checkpoints a load that went back abandoned (`abandon`: those of the timeline it replaced, named
in `ABANDONED_NAME`). Training progress orders them, never the clocks of the machines that wrote
them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from raysgd._internal.storage.format import (
    MANIFEST_NAME,
    Checkpoint,
    checkpoint_position,
    parts_problem,
    read_manifest,
)
from raysgd._internal.storage.location import PathLike, Storage, as_storage
from raysgd_base import check_int

__all__ = [
    "ABANDONED_NAME",
    "abandon",
    "abandoned",
    "checkpoint_name",
    "complete_checkpoints",
    "newest_complete",
    "prune",
    "reclaim",
    "resolve_checkpoint",
    "state_to_load",
]

logger = logging.getLogger("raysgd")

#: The file under a root of checkpoints that names the abandoned ones (`abandon`).
ABANDONED_NAME = "raysgd-abandoned.json"

#: A checkpoint folder's name: epoch, step (zero-padded so that listings sort in training order)
#: and a random suffix unique to the attempt.
_NAME = re.compile(r"^ckpt-e(\d+)-s(\d+)-([0-9a-f]{8,32})$")


def checkpoint_name(epoch: int, step: int, token: Optional[str] = None) -> str:
    """A new folder name for one attempt at a checkpoint at (epoch, step). Random, unless every
    writer of the attempt must find the same folder on its own: then derived from `token`, which
    the caller makes unique per attempt."""
    check_int("epoch", epoch, minimum=0)
    check_int("step", step, minimum=0)
    suffix = (
        uuid.uuid4().hex[:12]
        if token is None
        else hashlib.sha1(f"{token}/{epoch}/{step}".encode()).hexdigest()[:12]
    )
    return f"ckpt-e{epoch:06d}-s{step:09d}-{suffix}"


def complete_checkpoints(
    root: Union[Storage, PathLike], storage_options: Optional[Mapping[str, Any]] = None
) -> list[Checkpoint]:
    """Every complete checkpoint folder directly under `root`, oldest first (see `newest_complete`
    for the order). Reads every candidate's manifest: prefer `newest_complete` for one."""
    attempts = _attempts(as_storage(root, storage_options))
    complete = [a.checkpoint for a in attempts if a.checkpoint is not None]
    return sorted(complete, key=_order)


def newest_complete(
    root: Union[Storage, PathLike], storage_options: Optional[Mapping[str, Any]] = None
) -> Optional[Checkpoint]:
    """The newest complete checkpoint folder directly under `root`, or None; an abandoned one
    (`abandon`) never.

    The order is training progress: the manifest's (epoch, step), which the folder's name
    repeats; between attempts at the same (epoch, step), the later `created`, then the larger
    name. Training progress rather than time, so that clocks of different machines never
    matter; a run that went back to an older checkpoint abandons those past it, so that they
    are not taken for its progress. Only folders named by `checkpoint_name` are considered,
    newest name first, so that the manifests of older ones are not read.
    """
    root = as_storage(root, storage_options)
    by_key: dict[tuple[int, int], list[str]] = {}
    for name, key in _candidates(root, skip_abandoned=True):
        by_key.setdefault(key, []).append(name)
    for key in sorted(by_key, reverse=True):
        found = [_inspect(root, name, key).checkpoint for name in by_key[key]]
        complete = [c for c in found if c is not None]
        if complete:
            return max(complete, key=_order)
    return None


def resolve_checkpoint(
    location: Union[Storage, PathLike], storage_options: Optional[Mapping[str, Any]] = None
) -> Checkpoint:
    """The checkpoint to load from `location`: the folder itself when it has a manifest (it must
    then be complete), else the newest complete checkpoint directly under it.

    Raises:
        ValueError: `location` has a manifest but is incomplete, or its manifest cannot be read.
        FileNotFoundError: no complete checkpoint is there.
    """
    location = as_storage(location, storage_options)
    manifest = read_manifest(location)
    if manifest is not None:
        problem = parts_problem(location, manifest)
        if problem:
            raise ValueError(f"checkpoint {location.url} is incomplete: {problem}")
        return Checkpoint(location, manifest)
    newest = newest_complete(location)
    if newest is not None:
        return newest
    raise FileNotFoundError(
        errno.ENOENT,
        f"no complete raysgd checkpoint (a folder with {MANIFEST_NAME} and every part it lists) "
        "is there or directly under it",
        location.url,
    )


def state_to_load(location: Storage) -> tuple[Storage, Optional[int]]:
    """Where the state to load from `location` is, and its step when the format says it without
    reading the state: a file is the state itself (its step is known once loaded); a folder is a
    checkpoint, or holds them (`resolve_checkpoint`), and the checkpoint's state location is
    read (`Checkpoint.state_location`)."""
    if not location.is_folder():
        return location, None
    checkpoint = resolve_checkpoint(location)
    return checkpoint.state_location, checkpoint.step


def prune(
    root: Union[Storage, PathLike],
    keep: int = 1,
    storage_options: Optional[Mapping[str, Any]] = None,
) -> list[str]:
    """Remove what the newest `keep` complete checkpoints under `root` make useless; return the
    names of the folders removed.

    Removed: complete checkpoints older than the newest `keep`, and incomplete attempts (no
    manifest, or a part missing) at an (epoch, step) before the newest complete one's. Kept, at
    all times: the newest `keep` complete checkpoints; incomplete folders at the newest complete
    one's (epoch, step) or later (they may be uploads still in flight); folders whose manifest
    this raysgd cannot read (a newer raysgd's); abandoned ones (`abandon`: the pruning of the
    timeline a load went back from would otherwise count them as the newest and remove the new
    timeline's); anything not named by `checkpoint_name`. Nothing is removed while no checkpoint
    is complete. A folder's manifest goes first, so that a removal
    cut short leaves an invisible folder, never a torn checkpoint.
    """
    check_int("keep", keep)
    root = as_storage(root, storage_options)
    attempts = _attempts(root, skip_abandoned=True)
    complete = sorted(
        (a for a in attempts if a.checkpoint is not None), key=lambda a: _order(a.checkpoint)
    )
    if not complete:
        return []
    newest = complete[-1].key
    doomed = [a.name for a in complete[:-keep]]
    doomed += [a.name for a in attempts if a.stale and a.key < newest]
    for name in sorted(doomed):
        folder = root.join(name)
        folder.remove(MANIFEST_NAME)
        folder.remove()
        logger.info("removed checkpoint folder %s", folder.url)
    return sorted(doomed)


@dataclass(frozen=True)
class _Attempt:
    """One folder named by `checkpoint_name` under a root, as found."""

    name: str
    key: tuple[int, int]
    checkpoint: Optional[Checkpoint]
    #: Incomplete and ours to remove once older than a complete one (no manifest, or a manifest
    #: whose parts are not all there); False for a complete one and for a manifest we cannot read.
    stale: bool


def abandon(root: Storage, step: int, also: Sequence[str] = ()) -> frozenset[str]:
    """A load went back to `step`: abandon the checkpoint folders under `root` past it (complete
    or not, read from their names alone), which hold the timeline the load replaced. They stay
    where they are and load by their path, but are never taken for the newest checkpoint
    (`newest_complete`, a fall-back, `resume=True`) nor counted or removed by `prune`. `also`
    names other checkpoints under `root`, a file or a folder each (the one `train(checkpoint=
    "auto")` rewrites), abandoned alike when their own counters are past `step`, until one is
    written anew (`reclaim`). The names are kept in `ABANDONED_NAME` under `root`, beside those
    abandoned before; returns the names abandoned now."""
    names = {name for name, (_, at) in _candidates(root) if at > step}
    for name in also:
        location = root.join(name)
        if location.exists() and checkpoint_position(location)[1] > step:
            names.add(name)
    if names:
        _write_abandoned(root, abandoned(root) | names)
    return frozenset(names)


def reclaim(root: Storage, name: str) -> None:
    """The checkpoint `name` under `root` was written anew: it is this run's again, no longer
    abandoned (`abandon`'s `also`)."""
    marked = abandoned(root)
    if name in marked:
        _write_abandoned(root, marked - {name})


def _write_abandoned(root: Storage, names: frozenset[str]) -> None:
    root.write_bytes(ABANDONED_NAME, json.dumps(sorted(names)).encode())


def abandoned(root: Storage) -> frozenset[str]:
    """The names of the checkpoint folders abandoned under `root` (`abandon`)."""
    try:
        data = root.read_bytes(ABANDONED_NAME)
    except FileNotFoundError:
        return frozenset()
    try:
        names = json.loads(data)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("not a list of names")
    except ValueError as exc:
        logger.warning("ignoring %s: %s", root.display(ABANDONED_NAME), exc)
        return frozenset()
    return frozenset(names)


def _candidates(root: Storage, skip_abandoned: bool = False) -> list[tuple[str, tuple[int, int]]]:
    try:
        entries = root.entries()
    except FileNotFoundError:
        return []
    skip = abandoned(root) if skip_abandoned else frozenset()
    out = []
    for name, is_folder in entries:
        match = _NAME.match(name)
        if is_folder and match and name not in skip:
            out.append((name, (int(match.group(1)), int(match.group(2)))))
    return out


def _attempts(root: Storage, skip_abandoned: bool = False) -> list[_Attempt]:
    return [_inspect(root, name, key) for name, key in _candidates(root, skip_abandoned)]


def _inspect(root: Storage, name: str, key: tuple[int, int]) -> _Attempt:
    folder = root.join(name)
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        logger.warning("ignoring checkpoint folder %s: %s", folder.url, exc)
        return _Attempt(name, key, None, stale=False)
    if manifest is None:
        return _Attempt(name, key, None, stale=True)
    if (manifest.epoch, manifest.step) != key:
        # Not what this module writes: someone renamed or edited it. Neither load nor remove it.
        logger.warning(
            "ignoring checkpoint folder %s: its manifest says epoch %d step %d",
            folder.url,
            manifest.epoch,
            manifest.step,
        )
        return _Attempt(name, key, None, stale=False)
    if parts_problem(folder, manifest):
        return _Attempt(name, key, None, stale=True)
    return _Attempt(name, key, Checkpoint(folder, manifest), stale=False)


def _order(checkpoint: Checkpoint) -> tuple[int, int, float, str]:
    return (*checkpoint.manifest.order, checkpoint.name)
