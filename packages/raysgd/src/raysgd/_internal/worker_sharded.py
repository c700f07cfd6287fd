"""Worker-side functions for sharded strategies (`fsdp`): snapshots, peer replicas, checkpoints.

Every worker keeps its own part of the last good state in memory (the `torch.distributed.checkpoint`
data file it wrote, as bytes) and a copy of one peer's part: worker r holds the part of worker
r - 1 (mod N). A lost worker's part is thus still in memory unless its replica holder died too.
The parts of the last two snapshots are kept, so that a snapshot interrupted by a failure never
leaves a worker without the previous, complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import ray

from raysgd._internal.worker import RUNNER_KEY, _build, _runner
from raysgd_core import get_context
from raysgd_operator import OperatorRunner, TrainingOptions

__all__ = [
    "METADATA_FILE",
    "SHARDS_KEY",
    "keep_replica",
    "load_checkpoint",
    "offer",
    "restore",
    "snapshot",
    "write_own",
]

#: Key of `{generation: {rank: {file name: bytes}}}` in the worker's store.
SHARDS_KEY = "raysgd.shards"
#: DCP's metadata file (held by the driver, which ships it with every load).
METADATA_FILE = ".metadata"

#: Where the parts of a checkpoint come from: a directory this worker can read, or, for a worker
#: on another node, `{file name: (ObjectRef of {file name: bytes})}` shipped through the object store.
Source = Union[str, dict[str, Any]]


def _read_dir(directory: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            files[name] = handle.read()
    return files


def _write_dir(directory: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def _keep(generation: int, rank: int, files: dict[str, bytes]) -> None:
    held = get_context().store.setdefault(SHARDS_KEY, {})
    held.setdefault(generation, {})[rank] = files
    for old in [g for g in held if g < generation - 1]:
        del held[old]


def snapshot(generation: int) -> tuple[Optional[bytes], Optional[dict], Any]:
    """Write this worker's part of the state (a collective), keep it, and offer it to its peer.

    Returns (metadata, state, ref): the DCP metadata and the replicated rest of the state from
    rank 0 only (None elsewhere), and a reference to this worker's part for its replica holder.
    """
    ctx = get_context()
    directory = tempfile.mkdtemp(prefix="raysgd-shards-")
    try:
        state = _runner().sharded_snapshot(directory)
        files = _read_dir(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    metadata = files.pop(METADATA_FILE, None)
    _keep(generation, ctx.world_rank, files)
    ref = ray.put(files)
    if ctx.world_rank == 0:
        return metadata, state, ref
    return None, None, ref


def keep_replica(generation: int, refs: list[Any]) -> None:
    """Keep a copy of the part of worker `rank - 1` (mod N); `refs` are `snapshot`'s, in rank order."""
    rank, size = get_context().world_rank, len(refs)
    if size > 1:
        source = (rank - 1) % size
        _keep(generation, source, ray.get(refs[source]))


def offer(generation: int) -> dict[int, tuple[list[str], Any]]:
    """The parts of snapshot `generation` this worker holds: `{old rank: (file names, ref)}`."""
    held = get_context().store.get(SHARDS_KEY, {}).get(generation, {})
    return {rank: (sorted(files), ray.put(files)) for rank, files in held.items()}


def write_own(generation: int, directory: str, driver_node: str) -> Any:
    """Write this worker's part of snapshot `generation` into `directory` when that is on this
    node; otherwise return a reference to it for the driver to write."""
    ctx = get_context()
    files = ctx.store.get(SHARDS_KEY, {}).get(generation, {}).get(ctx.world_rank)
    if files is None:
        raise RuntimeError(f"worker {ctx.world_rank} holds no part of snapshot {generation}")
    if ctx.node_id == driver_node:
        _write_dir(directory, files)
        return None
    return ray.put(files)


def _load_into(runner: OperatorRunner, metadata: bytes, state: dict, source: Source) -> None:
    if isinstance(source, str):
        runner.load_sharded(source, state)
        return
    # Fetch only the files holding parts of this worker's new shard (all when it cannot tell).
    needed = runner.needed_files(metadata) or set(source)
    directory = tempfile.mkdtemp(prefix="raysgd-load-")
    try:
        _write_dir(directory, {METADATA_FILE: metadata})
        bundles: dict[int, dict[str, bytes]] = {}
        for name in sorted(needed):
            if name not in source:
                raise RuntimeError(f"checkpoint part {name!r} is missing")
            ref = source[name]
            bundle = bundles.setdefault(id(ref), ray.get(ref))
            _write_dir(directory, {name: bundle[name]})
        runner.load_sharded(directory, state)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def load_checkpoint(metadata: bytes, state: dict, source: Source) -> None:
    """Load a sharded checkpoint into this worker's runner (a collective; any strategy)."""
    _load_into(_runner(), metadata, state, source)


def restore(
    operator_cls: type,
    config: dict[str, Any],
    options: TrainingOptions,
    metadata: bytes,
    state: dict,
    source: Source,
    shards: Sequence[Mapping[str, Any]] = (),
) -> None:
    """After a resize: build a new runner (sharded modules cannot change their group) and load
    the last good state into it, resharded for the new group. `shards`: every rank's dataset
    shards of a split over the new group (each worker takes its own)."""
    ctx = get_context()
    old: Optional[OperatorRunner] = ctx.store.pop(RUNNER_KEY, None)
    if old is not None:
        old.shutdown()
    _load_into(_build(operator_cls, config, options, shards), metadata, state, source)
