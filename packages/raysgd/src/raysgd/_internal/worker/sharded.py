"""A sharded training state (``fsdp``): each worker holds its part, and in-memory snapshots of its
part and of a peer's, so that a lost worker's part comes back without a disk.

Every `snapshot_every` steps, or as often as their measured cost allows (`snapshot_schedule`), and
when the trainer asks (at start-up, after a restore or a load, before workers leave) every worker,
at the same step boundary:

1. hands its part of the models and optimizers to `torch.distributed.checkpoint.async_save`, which
   copies it to CPU memory before training goes on and writes it in a thread of its own;
2. keeps the small rest of the state (epoch, position, schedulers, the call in progress with its
   metrics so far);
3. in a background thread, once the files exist, reads them into memory and swaps parts with its
   ring peers over a separate gloo group: worker r keeps its own part and that of worker r - 1.

So a snapshot costs the training loop the copy in step 1; the writing, reading and swapping
overlap with the next steps. A lost worker's part is gone only when its peer is lost too. The
parts of the last two finished snapshots are kept, so a snapshot interrupted by a failure never
leaves a worker without the one before it. After a resize every worker is rebuilt from the newest
snapshot whose every part survived (`restore_plan.plan_from_snapshots`), resharded to the new
size. A checkpoint is written from the live parts, straight into its folder (`save`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import ray
import torch

from raysgd._internal.driver.restore_plan import HeldSnapshot, Holding, RestorePlan
from raysgd._internal.storage.format import METADATA_FILE, SHARDED, STATE_FILE, write_state
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.runner import (
    RunnerArgs,
    build_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.slot import this_worker
from raysgd._internal.worker.snapshot_schedule import SnapshotSchedule
from raysgd._internal.worker.state import (
    RANK_STATES,
    HostCopy,
    LoadSource,
    WorkerState,
    gather_rank_states,
    keep,
    load_into,
)
from raysgd_core import get_context, scratch_dir
from raysgd_operator import AverageMeterCollection, CallRecord, OperatorRunner

__all__ = ["Generation", "ShardedState", "Snapshots"]

logger = logging.getLogger("raysgd")

#: How long the gloo group that swaps parts waits for a peer before giving up on a snapshot.
SWAP_TIMEOUT_S = 300.0


@dataclass
class Generation:
    """One finished snapshot as a worker holds it."""

    step: int
    world_size: int
    metadata: bytes
    #: The small rest of the state (`OperatorRunner.save_sharded`'s dict).
    state: dict[str, Any]
    #: The call in progress when it was taken (its rows so far), or None.
    call: Optional[CallRecord]
    #: old rank -> (its files, its call metrics): this worker's own part and its peer's.
    parts: dict[int, tuple[dict[str, Data], Optional[AverageMeterCollection]]] = field(
        default_factory=dict
    )


#: A file's contents, as read from disk (`bytes`) or straight into a tensor (`torch.uint8`).
Data = Union[bytes, torch.Tensor]


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


#: How long dropping a sharded state waits for the snapshot in flight to finish.
CLOSE_WAIT_S = 5.0

#: The start of a snapshot's folder's name (in this process's scratch folder).
SNAPSHOT_PREFIX = "snapshot-"
#: Memory as a folder, where a snapshot's folder goes when it fits (`_scratch_dir`).
_SHM = "/dev/shm"


def _scratch_dir(expected_bytes: int) -> str:
    """Where a snapshot's files go for the moment between DCP writing them and this worker
    reading them back: this process's scratch folder in memory (/dev/shm) when it has room for
    them twice over, else in the default temporary directory."""
    try:
        if shutil.disk_usage(_SHM).free > 2 * expected_bytes:
            return scratch_dir(_SHM)
    except OSError:
        pass
    return scratch_dir()


class Snapshots:
    """This worker's snapshots and the step hook that takes them (see the module docstring)."""

    def __init__(self, runner: OperatorRunner, every: Union[int, str]) -> None:
        self.runner = runner
        self.schedule = SnapshotSchedule(every)
        self.held: dict[int, Generation] = {}
        self._group: Any = None
        self._thread: Optional[threading.Thread] = None
        #: (step, thread) of the snapshot taken last (held once its thread has finished).
        self.taking: Optional[tuple[int, threading.Thread]] = None
        self._failed: Optional[BaseException] = None
        # The last step boundary (after its snapshot, if any), and the call it was in.
        self._boundary: Optional[tuple[float, Any]] = None
        if self.schedule.every > 0:
            runner.add_step_hook(self._on_step)

    def _on_step(self) -> None:
        now, call = time.perf_counter(), self.runner.call
        running = self._thread is not None and self._thread.is_alive()
        if self._boundary is not None and _same_call(self._boundary[1], call):
            self.schedule.stepped(now - self._boundary[0], running)
        if not running:
            self.schedule.finished()
        if self.schedule.due(self.runner.step):
            self.take(wait=False)
        self._boundary = (time.perf_counter(), call)

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
        if self.schedule.auto:
            # Each worker measured its own cost; the next snapshot must fall on the same step
            # on all of them.
            wanted = torch.tensor([self.schedule.wanted()], dtype=torch.int64)
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=self._group)
            self.schedule.agree(int(wanted.item()))
        tensors, state = runner.sharded_parts()
        # Every worker keeps every rank's per-rank state (small): whichever survives has the
        # lost ones' for their replacements.
        rank_states = gather_rank_states(runner, None)
        if rank_states is not None:
            state[RANK_STATES] = rank_states
        meters = runner.call_meters()
        call = runner.call
        size_estimate = sum(
            t.numel() * t.element_size() for t in _tensors_of(tensors) if t.device.type != "meta"
        )
        directory = tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=_scratch_dir(size_estimate))
        future = dcp.async_save(
            tensors,
            storage_writer=FileSystemWriter(directory, single_file_per_rank=True),
            process_group=self._group,
        )
        step, size = runner.step, dist.get_world_size()
        copied = time.perf_counter()
        self.schedule.taken(step, copied - started)

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
                    copied - started,
                    saved - copied,
                    time.perf_counter() - saved,
                )
            except BaseException as exc:  # kept for `join`; a lost peer ends the swap here
                self._failed = exc
            finally:
                shutil.rmtree(directory, ignore_errors=True)

        self._thread = threading.Thread(target=finish, name="raysgd-snapshot", daemon=True)
        self._thread.start()
        self.taking = (step, self._thread)
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

    def on_new_group(self) -> None:
        """The process group was re-formed: the snapshots held belong to the old one, and the
        swap group is made again over the new one at the next snapshot."""
        self.join()
        self.held.clear()
        self.taking, self._group, self._boundary = None, None, None

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


def _same_call(a: Any, b: Any) -> bool:
    """Whether two call records are of one call (a step's time across two calls includes the
    driver's time between them)."""
    if a is None or b is None:
        return False
    return (a.call_id, a.start_step) == (b.call_id, b.start_step)


def _tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        return [local() if callable(local) else tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors_of(value)]
    return []


class ShardedState(WorkerState):
    """Each worker holds its part of the state, with snapshots (see the module docstring)."""

    kind = SHARDED

    def __init__(self, runner: OperatorRunner) -> None:
        super().__init__(runner)
        self.snapshots = Snapshots(runner, runner.options.snapshot_every)

    def holding(self) -> Holding:
        self.snapshots.join(timeout_s=0)
        held = tuple(
            HeldSnapshot(
                step=generation.step,
                world_size=generation.world_size,
                metadata=generation.metadata,
                state=generation.state,
                call=generation.call,
                parts={
                    rank: (sorted(files), ray.put(files), meters)
                    for rank, (files, meters) in generation.parts.items()
                },
            )
            for generation in list(self.snapshots.held.values())
        )
        return Holding(self.runner.progress(), held)

    @classmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> ShardedState:
        """Shard this worker's models over the new group (a survivor keeps its runner and
        operator, with models sharded anew; a new worker builds them), load the snapshot into
        them, resharded, and go on with the plan's call from the snapshot's step (with this
        rank's share of the call's metrics up to there); or load the fallback."""
        ctx = get_context()
        slot = this_worker()
        runner, kept = slot.runner, slot.state
        if runner is not None and isinstance(kept, cls) and kept.runner is runner:
            if runner.rebind(
                world_rank=ctx.world_rank,
                local_rank=ctx.local_rank,
                world_size=ctx.world_size,
                config=dict(args.config),
                datasets=my_dataset_splits(args.dataset_splits),
                group=ctx.generation,
            ):
                kept.snapshots.on_new_group()
                state = kept
            else:
                # A strategy without unwrapped copies, or loaders that cannot follow: set up again.
                runner.shutdown()
                runner = None
        elif runner is not None:
            runner.shutdown()
            runner = None
        if runner is None:
            slot.runner = None
            runner = build_runner(args, restoring=True)
            state = keep(cls(runner))
        rank = ctx.world_rank
        if plan.snapshot is None:
            load_into(runner, plan.fallback, plan.rank_source(rank))
            runner.adopt_snapshot(None, None)
            return state
        snapshot = plan.snapshot
        # Every worker goes back to the snapshot, its per-rank state too: a survivor its own as
        # it was then, a replacement the lost worker's.
        load_into(
            runner,
            LoadSource(None, snapshot.metadata, snapshot.state, snapshot.files),
            plan.rank_source(rank),
        )
        runner.adopt_snapshot(
            plan.call, snapshot.meters[rank] if rank < len(snapshot.meters) else None
        )
        return state

    def capture(self) -> int:
        """Snapshot every worker's part now, with its peer's copy (a collective), and wait for
        it; the snapshot's step."""
        generation = self.snapshots.take(wait=True)
        assert generation is not None
        return generation.step

    def save(self, folder: Storage) -> Optional[dict[str, Any]]:
        """This worker's part, written with DCP straight into `folder` when this worker sees it
        (the local disk it shares with the driver), else into scratch and uploaded (an object
        store) or handed back for the driver to write; rank 0 adds the rest of the state."""
        rank = get_context().world_rank
        direct = folder.is_local and os.path.isdir(folder.path)
        directory = folder.path if direct else tempfile.mkdtemp(prefix="part-", dir=scratch_dir())
        try:
            rest = self.runner.save_sharded(directory)
            rank_states = gather_rank_states(self.runner, 0)
            if rank_states is not None:
                rest[RANK_STATES] = rank_states
            if rank == 0:
                torch.save(rest, os.path.join(directory, STATE_FILE))
            if direct:
                return None
            mine = {name: _read(directory, name) for name in os.listdir(directory)}
            if folder.is_local:
                return {name: ray.put(mine) for name in mine}
            for name, data in mine.items():
                folder.write_bytes(name, data)
            return None
        finally:
            if not direct:
                shutil.rmtree(directory, ignore_errors=True)

    def copy_to_host(self) -> Optional[HostCopy]:
        """A snapshot of this step (the one the step hook took, or one taken now): DCP stages the
        part in host memory; the rest happens in the snapshot's thread."""
        step = self.runner.step
        taking = self.snapshots.taking
        if taking is None or taking[0] != step:
            self.snapshots.take(wait=False)
            taking = self.snapshots.taking
        assert taking is not None
        return _SnapshotHostCopy(self.snapshots, step, taking[1])

    @classmethod
    def parts(cls, world_size: int) -> list[str]:
        return [METADATA_FILE, STATE_FILE, *(f"__{rank}_0.distcp" for rank in range(world_size))]

    def adopt_parts(self, step: int, parts: Mapping[int, Any]) -> None:
        if not parts:
            return
        generation = self.snapshots.held.get(step)
        if generation is None:
            raise RuntimeError(f"this worker holds no snapshot at step {step}")
        for rank, (_, ref, meters) in parts.items():
            files = ray.get(ref)
            generation.parts[rank] = (
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in files.items()},
                meters,
            )

    def close(self) -> None:
        # A snapshot in flight is of no use once the state is dropped; its swap may wait for a
        # peer that is already gone, so it is not waited for long.
        self.snapshots.join(timeout_s=CLOSE_WAIT_S)


class _SnapshotHostCopy(HostCopy):
    """This worker's part of the snapshot at `step`, once its thread has finished it."""

    def __init__(self, snapshots: Snapshots, step: int, thread: threading.Thread) -> None:
        self.snapshots, self.step, self.thread = snapshots, step, thread

    def write(self, folder: Storage) -> None:
        self.thread.join()
        generation = self.snapshots.held.get(self.step)
        rank = get_context().world_rank
        if generation is None or rank not in generation.parts:
            raise RuntimeError(f"the snapshot at step {self.step} did not finish on this worker")
        for name, data in generation.parts[rank][0].items():
            # A tensor's memory as it is: no copy of the shard on its way to the local disk.
            folder.write_bytes(
                name, memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data
            )
        if rank == 0:
            folder.write_bytes(METADATA_FILE, generation.metadata)
            write_state(folder, STATE_FILE, generation.state)


def _read(directory: str, name: str) -> bytes:
    with open(os.path.join(directory, name), "rb") as handle:
        return handle.read()
