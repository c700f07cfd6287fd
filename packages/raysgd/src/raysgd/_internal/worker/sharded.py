"""A sharded training state (``fsdp``): each worker holds its part of the models and optimizers,
and in-memory snapshots of its part and of a peer's (`snapshots`).

After a resize every worker is rebuilt from the newest snapshot whose every part survived
(`restore_plan.plan_from_snapshots`): the holders send each part to the workers whose new shard
overlaps it and that lack it (`gather_parts`), and DCP loads it resharded to the new size, slice
by slice from memory. A checkpoint at a snapshot's step is written as a DCP folder from that
snapshot's host copy, in the checkpoint's writer thread (`copy_to_host`); `save` writes one from
the live parts, straight into its folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import ray
import torch

from raysgd._internal.protocol import (
    HeldSnapshot,
    Holding,
    LoadSource,
    RestorePlan,
    RunnerArgs,
    SnapshotPlan,
)
from raysgd._internal.storage.format import METADATA_FILE, SHARDED, STATE_FILE, write_state
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.part_exchange import exchange
from raysgd._internal.worker.runner import (
    build_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.slot import keep, this_worker
from raysgd._internal.worker.snapshots import Snapshots, Taken
from raysgd._internal.worker.state import (
    RANK_SLOTS,
    HostCopy,
    WorkerState,
    apply_rank_slot,
    gather_rank_slots,
    load_into,
)
from raysgd_core import get_context, scratch_dir
from raysgd_operator import OperatorRunner

if TYPE_CHECKING:  # the module imports DCP: imported at run time on first use only
    from raysgd_operator.sharded_memory import Chunks

__all__ = ["ShardedState", "gather_parts"]

#: How long dropping a sharded state waits for the snapshot in flight to finish.
CLOSE_WAIT_S = 5.0

#: Memory as a folder, where a checkpoint's files go on their way to storage when they fit.
_SHM = "/dev/shm"


def _files_dir(expected_bytes: int) -> str:
    """Where a checkpoint's files go between DCP writing them and their upload: this process's
    scratch folder in memory (/dev/shm) when it has room for them twice over, else in the
    default temporary directory."""
    try:
        if shutil.disk_usage(_SHM).free > 2 * expected_bytes:
            return scratch_dir(_SHM)
    except OSError:
        pass
    return scratch_dir()


def _nbytes(tree: Any) -> int:
    """The bytes of the tensors of a host copy (a DTensor's local part)."""
    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        tensor = local() if callable(local) else tree
        return tensor.numel() * tensor.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(value) for value in tree.values())
    return 0


def gather_parts(
    snapshot: SnapshotPlan,
    held: dict[int, Chunks],
    needed: set[int],
    group: Any,
) -> Chunks:
    """The chunks of every part in `needed` (this worker's new shard overlaps them), from those it
    holds (`held`) and, for the rest, sent by their holders (a collective over `group`: every
    worker sends the parts it holds for the plan to the workers that lack them)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    mine = sorted(part for part, holder in snapshot.holders.items() if holder == rank)
    lacking = sorted(needed - set(held))
    answers: list[Any] = [None] * size
    dist.all_gather_object(answers, (lacking, [p for p in mine if p not in held]), group=group)
    gone = sorted({p for _, lost in answers for p in lost})
    if gone:
        # Every worker raises the same error, so that none waits for a part that never comes.
        raise RuntimeError(f"the holders of parts {gone} no longer hold them")
    sends = [
        (other, held[part], None)
        for part in mine
        for other in range(size)
        if other != rank and part in answers[other][0]
    ]
    received = exchange(group, sends, [snapshot.holders[part] for part in lacking])
    chunks: Chunks = {}
    for part in sorted(needed & set(held)):
        chunks.update(held[part])
    for part_chunks, _ in received:
        chunks.update(part_chunks)
    return chunks


class ShardedState(WorkerState):
    """Each worker holds its part of the state, with snapshots (see the module docstring)."""

    kind = SHARDED

    def __init__(self, runner: OperatorRunner) -> None:
        super().__init__(runner)
        self.snapshots = Snapshots(runner, runner.options.snapshot_every)

    def load(self, source: LoadSource) -> None:
        super().load(source)
        # The snapshots held are of the state before the load: of later steps when the load goes
        # back. A restore takes the newest snapshot held, so none of them may outlive the load.
        self.snapshots.forget()

    def holding(self) -> Holding:
        snapshots = self.snapshots
        snapshots.join(timeout_s=0)
        generations = list(snapshots.held.values())
        snapshots.reported |= {generation.step for generation in generations}
        held = tuple(
            HeldSnapshot(
                step=generation.step,
                world_size=generation.world_size,
                metadata=generation.metadata,
                state=generation.state,
                call=generation.call,
                parts={rank: meters for rank, (_, meters) in generation.parts.items()},
            )
            for generation in generations
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
        # The parts this worker holds of the planned snapshot, taken before the snapshots of the
        # old group are dropped.
        held: dict[int, Chunks] = {}
        if plan.snapshot is not None and isinstance(kept, cls):
            held = {part: c for part, (c, _) in kept.snapshots.parts_at(plan.step).items()}
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
        from raysgd_operator import sharded_memory

        snapshot = plan.snapshot
        needed = runner.needed_parts(snapshot.metadata) or set(snapshot.holders)
        chunks = gather_parts(snapshot, held, needed, state.snapshots.group())
        del held
        runner.load_sharded(sharded_memory.reader(snapshot.metadata, chunks), snapshot.state)
        del chunks
        # Every worker goes back to the snapshot, its per-rank state too: a survivor its own as
        # it was then, a replacement the lost worker's.
        apply_rank_slot(runner, snapshot.state, plan.rank_source(rank))
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
            rank_slots = gather_rank_slots(self.runner, 0)
            if rank_slots is not None:
                rest[RANK_SLOTS] = rank_slots
            if rank == 0:
                torch.save(rest, os.path.join(directory, STATE_FILE))
            if direct:
                return None
            if folder.is_local:
                mine = {name: _read(directory, name) for name in os.listdir(directory)}
                return {name: ray.put(mine) for name in mine}
            _upload(directory, folder)
            return None
        finally:
            if not direct:
                shutil.rmtree(directory, ignore_errors=True)

    def copy_to_host(self) -> Optional[HostCopy]:
        """The host copy of this step's snapshot (the one the step hook took, or one taken
        now), written as files later in the checkpoint's writer thread."""
        snapshots = self.snapshots
        taking = snapshots.taking
        if taking is None or taking.step != self.runner.step:
            snapshots.take(wait=False)
            taking = snapshots.taking
        assert taking is not None
        return _FilesFromSnapshot(taking, snapshots.files_group(), snapshots.writing_from(taking))

    @classmethod
    def parts(cls, world_size: int) -> list[str]:
        return [METADATA_FILE, STATE_FILE, *(f"__{rank}_0.distcp" for rank in range(world_size))]

    def adopt_parts(self, step: int, moves: Sequence[tuple[int, int, int]]) -> None:
        if not moves:
            return
        import torch.distributed as dist

        rank = dist.get_rank()
        parts = self.snapshots.parts_at(step)
        sends = [(to, *parts[part]) for part, holder, to in moves if holder == rank]
        incoming = [(part, holder) for part, holder, to in moves if to == rank]
        received = exchange(self.snapshots.group(), sends, [holder for _, holder in incoming])
        if incoming:
            generation = self.snapshots.held.get(step)
            if generation is None:
                raise RuntimeError(f"this worker holds no snapshot at step {step}")
            for (part, _), (chunks, meters) in zip(incoming, received):
                generation.parts[part] = (chunks, meters)

    def close(self) -> None:
        # A snapshot in flight is of no use once the state is dropped; its swap may wait for a
        # peer that is already gone, so it is not waited for long.
        self.snapshots.join(timeout_s=CLOSE_WAIT_S)
        self.snapshots.release()


class _FilesFromSnapshot(HostCopy):
    """A snapshot's host copy, to be written as this worker's files of a checkpoint folder."""

    def __init__(self, taken: Taken, group: Any, done: threading.Event) -> None:
        self.taken, self.group, self.done = taken, group, done

    def write(self, folder: Storage) -> None:
        try:
            self._write(folder)
        finally:
            self.done.set()

    def _write(self, folder: Storage) -> None:
        from raysgd_operator import sharded_memory

        directory = tempfile.mkdtemp(prefix="part-", dir=_files_dir(_nbytes(self.taken.staged)))
        try:
            sharded_memory.write_files(self.taken.staged, directory, self.group)
            _upload(directory, folder)
            if get_context().world_rank == 0:
                write_state(folder, STATE_FILE, self.taken.state)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _upload(directory: str, folder: Storage) -> None:
    """Copy every file of `directory` into `folder`, streamed: a part is never held in memory
    whole on its way."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        folder.write_stream(name, lambda out, path=path: _copy_file(path, out))


def _copy_file(path: str, out: Any) -> None:
    with open(path, "rb") as source:
        shutil.copyfileobj(source, out, 16 * 2**20)


def _read(directory: str, name: str) -> bytes:
    with open(os.path.join(directory, name), "rb") as handle:
        return handle.read()
