"""Worker-side snapshots of a sharded state (`fsdp`): taken in the training loop, kept in memory,
each worker's part also on a peer, so that a lost worker's part comes back without a disk.

Every `snapshot_every` steps (and when the trainer asks: at start-up, after a restore, before a
checkpoint) every worker, at the same step boundary:

1. hands its part of the models and optimizers to `torch.distributed.checkpoint.async_save`, which
   copies it to CPU memory before training goes on and writes it in a thread of its own;
2. keeps the small rest of the state (epoch, position, schedulers, the call in progress with its
   metrics so far);
3. in a background thread, once the files exist, reads them into memory and swaps parts with its
   ring peers over a separate gloo group: worker r keeps its own part and that of worker r - 1.

So a snapshot costs the training loop the copy in step 1; the writing, reading and swapping
overlap with the next steps. A lost worker's part is gone only when its peer is lost too. The
parts of the last two finished snapshots are kept, so a snapshot interrupted by a failure never
leaves a worker without the one before it.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import ray
import torch

from raysgd._internal.worker import RUNNER_KEY, _build, _runner
from raysgd_core import get_context
from raysgd_operator import AverageMeterCollection, CallRecord, OperatorRunner, TrainingOptions

__all__ = [
    "METADATA_FILE",
    "SNAPSHOTS_KEY",
    "Generation",
    "Snapshots",
    "adopt_parts",
    "adopt_parts_of",
    "load_checkpoint",
    "offer",
    "restore",
    "snapshot_now",
    "start_snapshots",
    "write_own",
]

logger = logging.getLogger("raysgd")

#: Key of this worker's `Snapshots` in its store.
SNAPSHOTS_KEY = "raysgd.snapshots"
#: DCP's metadata file.
METADATA_FILE = ".metadata"
#: How long the gloo group that swaps parts waits for a peer before giving up on a snapshot.
SWAP_TIMEOUT_S = 300.0

#: Where the parts of a checkpoint come from: a directory this worker can read, or, for a worker
#: on another node, `{file name: (ObjectRef of {file name: bytes})}` shipped through the object store.
Source = Union[str, dict[str, Any]]


@dataclass
class Generation:
    """One finished snapshot as a worker holds it."""

    step: int
    world_size: int
    metadata: bytes
    #: The small rest of the state (`OperatorRunner.sharded_snapshot`'s dict).
    state: dict[str, Any]
    #: The call in progress when it was taken (its rows so far), or None.
    call: Optional[CallRecord]
    #: old rank -> (its files, its call metrics): this worker's own part and its peer's.
    parts: dict[int, tuple[dict[str, Data], Optional[AverageMeterCollection]]] = field(
        default_factory=dict
    )


#: A file's contents, as read from disk (`bytes`) or straight into a tensor (`torch.uint8`).
Data = Union[bytes, torch.Tensor]


def _read_dir(directory: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as handle:
            files[name] = handle.read()
    return files


def _read_into_tensors(directory: str) -> dict[str, torch.Tensor]:
    """The files of `directory` as uint8 tensors, read straight into them (no copy in between):
    what the swap sends and a snapshot keeps."""
    files = {}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        data = torch.empty(os.path.getsize(path), dtype=torch.uint8)
        with open(path, "rb") as handle:
            handle.readinto(memoryview(data.numpy()))
        files[name] = data
    return files


def _write_dir(directory: str, files: Mapping[str, Data]) -> None:
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)
            handle.flush()
            os.fsync(handle.fileno())


def _scratch_dir(expected_bytes: int) -> Optional[str]:
    """Where a snapshot's files go for the moment between DCP writing them and this worker
    reading them back: memory (/dev/shm) when it has room for them twice over, else the default
    temporary directory."""
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * expected_bytes:
            return "/dev/shm"
    except OSError:
        pass
    return None


class Snapshots:
    """This worker's snapshots and the step hook that takes them (see the module docstring)."""

    def __init__(self, runner: OperatorRunner, every: int) -> None:
        self.runner = runner
        self.every = int(every)
        self.held: dict[int, Generation] = {}
        self._group: Any = None
        self._thread: Optional[threading.Thread] = None
        self._failed: Optional[BaseException] = None
        if self.every > 0:
            runner.add_step_hook(self._on_step)

    def _on_step(self) -> None:
        if self.runner.step % self.every == 0:
            self.take(wait=False)

    def take(self, *, wait: bool) -> Generation | None:
        """Snapshot this worker's part now (every worker calls it at the same step). With `wait`,
        return once the snapshot is held here and on the peer."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.join()
        if self._group is None:
            # Collectives of this group run in threads beside training's: a group of their own,
            # on the CPU (DCP stages to CPU memory), never in the way of the training group.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SWAP_TIMEOUT_S))
        runner, rank = self.runner, dist.get_rank()
        started = time.perf_counter()
        tensors, state = runner.sharded_parts()
        meters = runner.call_meters()
        call = runner.call
        size_estimate = sum(
            t.numel() * t.element_size() for t in _tensors_of(tensors) if t.device.type != "meta"
        )
        directory = tempfile.mkdtemp(prefix="raysgd-snapshot-", dir=_scratch_dir(size_estimate))
        future = dcp.async_save(
            tensors,
            storage_writer=FileSystemWriter(directory, single_file_per_rank=True),
            process_group=self._group,
        )
        step, size = runner.step, dist.get_world_size()
        staged = time.perf_counter()

        def finish() -> None:
            try:
                future.result()
                saved = time.perf_counter()
                files: dict[str, Data] = dict(_read_into_tensors(directory))
                raw = files.pop(METADATA_FILE, None)
                metadata = bytes(raw.numpy()) if isinstance(raw, torch.Tensor) else raw
                holder = [metadata]
                dist.broadcast_object_list(holder, src=0, group=self._group)
                generation = Generation(step, size, holder[0], state, call)
                generation.parts[rank] = (files, meters)
                if size > 1:
                    peer = (rank - 1) % size
                    generation.parts[peer] = self._swap(rank, size, (files, meters))
                self.held[step] = generation
                for old in sorted(self.held)[:-2]:
                    del self.held[old]
                logger.debug(
                    "snapshot at step %d: %.3f s in the loop, %.3f s saving, %.3f s swapping",
                    step,
                    staged - started,
                    saved - staged,
                    time.perf_counter() - saved,
                )
            except BaseException as exc:  # kept for `join`; a lost peer ends the swap here
                self._failed = exc
            finally:
                shutil.rmtree(directory, ignore_errors=True)

        self._thread = threading.Thread(target=finish, name="raysgd-snapshot", daemon=True)
        self._thread.start()
        if wait:
            self.join()
            if self._failed is not None:
                raise RuntimeError(f"the snapshot at step {step} failed: {self._failed}")
            return self.held[step]
        return None

    def _swap(self, rank: int, size: int, mine: Any) -> Any:
        """Send `mine` (files as tensors, and metrics) to rank + 1 and receive rank - 1's, over the
        snapshot group: a small header (names, sizes, metrics) first, then each file's bytes as
        they are, with no copy on either side."""
        import torch.distributed as dist

        files, meters = mine
        names = sorted(files)
        header = pickle.dumps(([(n, files[n].numel()) for n in names], meters))
        to, frm = (rank + 1) % size, (rank - 1) % size
        theirs = pickle.loads(
            self._exchange(torch.frombuffer(bytearray(header), dtype=torch.uint8), to, frm)
            .numpy()
            .tobytes()
        )
        their_files = {}
        sends = [dist.isend(files[n], to, group=self._group) for n in names]
        for name, count in theirs[0]:
            data = torch.empty(count, dtype=torch.uint8)
            dist.irecv(data, frm, group=self._group).wait()
            their_files[name] = data
        for request in sends:
            request.wait()
        return their_files, theirs[1]

    def _exchange(self, payload: torch.Tensor, to: int, frm: int) -> torch.Tensor:
        """Send `payload` to `to` and receive one of any size from `frm` (sizes go first)."""
        import torch.distributed as dist

        send_size = torch.tensor([payload.numel()], dtype=torch.int64)
        recv_size = torch.zeros(1, dtype=torch.int64)
        for request in (
            dist.isend(send_size, to, group=self._group),
            dist.irecv(recv_size, frm, group=self._group),
        ):
            request.wait()
        received = torch.empty(int(recv_size.item()), dtype=torch.uint8)
        for request in (
            dist.isend(payload, to, group=self._group),
            dist.irecv(received, frm, group=self._group),
        ):
            request.wait()
        return received

    def join(self, timeout_s: Optional[float] = None) -> None:
        """Wait for the snapshot in flight (if any) to be held."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if not thread.is_alive():
                self._thread = None
        if self._failed is not None:
            logger.warning("a sharded snapshot failed: %s", self._failed)
            self._failed = None


def _tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        return [local() if callable(local) else tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors_of(value)]
    return []


def _snapshots() -> Snapshots:
    snapshots = get_context().store.get(SNAPSHOTS_KEY)
    if snapshots is None:
        raise RuntimeError("this worker keeps no sharded snapshots")
    return snapshots


def start_snapshots() -> None:
    """Keep snapshots on this worker (its runner built), taken every `snapshot_every` steps of its
    options (0: only when the trainer asks)."""
    runner = _runner()
    get_context().store[SNAPSHOTS_KEY] = Snapshots(runner, runner.options.snapshot_every)


def snapshot_now() -> tuple[int, Optional[bytes], Optional[dict[str, Any]]]:
    """Take a snapshot on every worker now and wait for it (a collective). Returns (step,
    metadata, state) from rank 0, (step, None, None) elsewhere."""
    generation = _snapshots().take(wait=True)
    assert generation is not None
    if get_context().world_rank == 0:
        return generation.step, generation.metadata, generation.state
    return generation.step, None, None


def offer() -> dict[str, Any]:
    """What this worker holds for a restore: per snapshot step, its world size and the old ranks
    whose parts are here (with a reference to each part's files), plus the call it was in."""
    snapshots: Optional[Snapshots] = get_context().store.get(SNAPSHOTS_KEY)
    runner: Optional[OperatorRunner] = get_context().store.get(RUNNER_KEY)
    held: dict[int, Any] = {}
    if snapshots is not None:
        snapshots.join(timeout_s=0)
        for step, generation in list(snapshots.held.items()):
            held[step] = {
                "world_size": generation.world_size,
                "metadata": generation.metadata,
                "state": generation.state,
                "call": generation.call,
                "parts": {
                    rank: (sorted(files), ray.put(files), meters)
                    for rank, (files, meters) in generation.parts.items()
                },
            }
    return {
        "held": held,
        "call": None if runner is None else runner.call,
        "progress": None if runner is None else runner.progress(),
    }


def adopt_parts(step: int, parts: Mapping[int, tuple[list[str], Any, Any]]) -> None:
    """Keep copies of other workers' parts of the snapshot at `step` (`offer`'s entries), before
    those workers leave the group on purpose (their node is being drained)."""
    if not parts:
        return
    generation = _snapshots().held.get(step)
    if generation is None:
        raise RuntimeError(f"this worker holds no snapshot at step {step}")
    for rank, (_, ref, meters) in parts.items():
        files = ray.get(ref)
        generation.parts[rank] = (
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in files.items()},
            meters,
        )


def adopt_parts_of(step: int, given: Sequence[Mapping[int, Any]]) -> None:
    """`adopt_parts` with this worker's share of `given` (every worker's, in rank order)."""
    adopt_parts(step, given[get_context().world_rank])


def write_own(step: int, directory: str, driver_node: str) -> Any:
    """Write this worker's part of snapshot `step` into `directory` when that is on this node;
    otherwise return a reference to it for the driver to write."""
    ctx = get_context()
    generation = _snapshots().held.get(step)
    if generation is None or ctx.world_rank not in generation.parts:
        raise RuntimeError(f"worker {ctx.world_rank} holds no part of the snapshot at step {step}")
    files = generation.parts[ctx.world_rank][0]
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
    dataset_splits: Sequence[Mapping[str, Any]] = (),
    call: Optional[CallRecord] = None,
    meters: Sequence[Optional[AverageMeterCollection]] = (),
) -> None:
    """After a resize: build a new runner (sharded modules cannot change their group), load the
    snapshot into it, resharded for the new group, and go on with `call` from the snapshot's step
    (`meters[rank]`: this rank's share of the call's metrics up to there). `dataset_splits`: every
    rank's split of the datasets over the new group (each worker takes its own)."""
    ctx = get_context()
    old: Optional[OperatorRunner] = ctx.store.pop(RUNNER_KEY, None)
    ctx.store.pop(SNAPSHOTS_KEY, None)  # its parts belong to the old group's layout
    if old is not None:
        old.shutdown()
    runner = _build(operator_cls, config, options, dataset_splits, restoring=True)
    _load_into(runner, metadata, state, source)
    mine = meters[ctx.world_rank] if ctx.world_rank < len(meters) else None
    runner.adopt_snapshot(call, mine)
