"""A sharded training state (``fsdp``): each worker holds its part of the models and optimizers,
and in-memory snapshots of its part and of a peer's (`worker.snapshots`). Both halves.

The driver's (`Sharded`): a restore takes the newest snapshot whose every part some survivor
holds (`plan_from_snapshots`); a checkpoint is a folder of every worker's part with a manifest
written last; the whole state comes to the driver as that folder's files; a folder loads
(`PartsSource`) into any strategy and size (DCP reshards it); a move snapshots the state and
hands each leaving worker's part to one that stays.

The workers' (`ShardedState`): after a resize every worker is rebuilt from the planned snapshot:
the holders send each part to the workers whose new shard overlaps it and that lack it
(`gather_parts`), and DCP loads it resharded to the new size, slice by slice from memory. A
checkpoint at a snapshot's step is written as a DCP folder from that snapshot's host copy, in the
checkpoint's writer thread (`copy_to_host`); `save_parts` writes one from the live parts, straight into
its folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import ray
import torch

from raysgd._internal.protocol import (
    HeldSnapshot,
    Holding,
    LoadSource,
    PartMove,
    RestorePlan,
    RunnerArgs,
    SnapshotPlan,
)
from raysgd._internal.state.kind import StateKind, Workers
from raysgd._internal.state.plan import (
    interleaved_validation,
    last_finished,
    newest_held_step,
    reached,
    slot_lost,
    validation_skipped,
)
from raysgd._internal.storage.format import (
    AUTO_NAMES,
    MANIFEST_NAME,
    METADATA_FILE,
    SHARDED,
    STATE_FILE,
    gathered,
    gathered_files,
    read_sharded,
    write_manifest,
    write_state,
)
from raysgd._internal.storage.location import Storage, as_storage
from raysgd._internal.worker import calls as worker
from raysgd._internal.worker.build import (
    build_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.objects import keep, this_worker, worker_state
from raysgd._internal.worker.part_exchange import exchange
from raysgd._internal.worker.snapshots import Snapshots, Taken, nbytes
from raysgd._internal.worker.state import (
    RANK_SLOTS,
    HostCopy,
    WorkerState,
    apply_rank_slot,
    gather_rank_slots,
)
from raysgd_core import get_context, scratch_dir
from raysgd_operator import SHARDED_STATE_IMPORTS, AverageMeterCollection, OperatorRunner

if TYPE_CHECKING:  # the module imports DCP: imported at run time on first use only
    from raysgd_operator.sharded_memory import Chunks

__all__ = [
    "PartsSource",
    "Sharded",
    "ShardedState",
    "adopt_parts",
    "capture",
    "gather_parts",
    "missing_parts",
    "plan_from_snapshots",
    "save_parts",
]

logger = logging.getLogger("raysgd")

#: How long dropping a sharded state waits for the snapshot in flight to finish.
CLOSE_WAIT_S = 5.0

#: Memory as a folder, where a checkpoint's files go on their way to storage when they fit.
_SHM = "/dev/shm"


# ------------------------------------------------------------------------------ the workers' half
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
        options = runner.options
        self.snapshots = Snapshots(runner, options.snapshot_every, options.snapshot_memory_mb)

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
        return Holding(self.runner.position.progress(), held)

    @classmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> ShardedState:
        """Shard this worker's models over the new group (a survivor keeps its runner and
        operator, with models sharded anew; a new worker builds them), load the snapshot into
        them, resharded, and go on with the plan's call from the snapshot's step (with this
        rank's share of the call's metrics up to there); or load the fallback."""
        ctx = get_context()
        objects = this_worker()
        runner, kept = objects.runner, objects.state
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
            objects.runner = None
            runner = build_runner(args, restoring=True)
            state = keep(cls(runner))
        rank = ctx.world_rank
        if plan.snapshot is None:
            plan.fallback.load_into(runner, plan.rank_source(rank))
            # A checkpoint the driver went back to within the call (`plan.call`) goes on with
            # it; the copy or a checkpoint from before it starts the call again.
            runner.position.adopt_snapshot(plan.call, None)
            return state
        from raysgd_operator import sharded_memory

        snapshot = plan.snapshot
        needed = runner.state.needed_parts(snapshot.metadata) or set(snapshot.holders)
        chunks = gather_parts(snapshot, held, needed, state.snapshots.group())
        del held
        runner.state.load_sharded(sharded_memory.reader(snapshot.metadata, chunks), snapshot.state)
        del chunks
        # Every worker goes back to the snapshot, its per-rank state too: a survivor its own as
        # it was then, a replacement the lost worker's.
        apply_rank_slot(runner, snapshot.state, plan.rank_source(rank))
        runner.position.adopt_snapshot(
            plan.call, snapshot.meters[rank] if rank < len(snapshot.meters) else None
        )
        return state

    def capture(self, even_over_budget: bool = False) -> tuple[Optional[int], Optional[str]]:
        """Snapshot every worker's part now, with its peer's copy (a collective), and wait for
        it: the snapshot's step (None: the budget keeps none, see `Snapshots.take`), and what
        the snapshot budget chose if it chose anew."""
        snapshots = self.snapshots
        generation = snapshots.take(wait=True, even_over_budget=even_over_budget)
        choice, snapshots.choice = snapshots.choice, None
        return (None if generation is None else generation.step), choice

    def save_parts(self, folder: Storage) -> Optional[dict[str, Any]]:
        """This worker's part, written with DCP straight into `folder` when this worker sees it
        (the local disk it shares with the driver), else into scratch and uploaded (an object
        store) or handed back for the driver to write; rank 0 adds the rest of the state."""
        rank = get_context().world_rank
        direct = folder.is_local and os.path.isdir(folder.path)
        directory = folder.path if direct else tempfile.mkdtemp(prefix="part-", dir=scratch_dir())
        try:
            rest = self.runner.state.save_sharded(directory)
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
        now; a copy of its own when the budget keeps none), written as files later in the
        checkpoint's writer thread."""
        snapshots, step = self.snapshots, self.runner.position.step
        taking = snapshots.taking
        if snapshots.keeping and (taking is None or taking.step != step):
            snapshots.take(wait=False)
            taking = snapshots.taking
        if taking is None or taking.step != step:
            # No snapshot is kept (the budget, see `Snapshots.keeping`): a copy for the files.
            taking = snapshots.copy_only()
        return _FilesFromSnapshot(taking, snapshots.files_group())

    @classmethod
    def parts(cls, world_size: int) -> list[str]:
        return [METADATA_FILE, STATE_FILE, *(f"__{rank}_0.distcp" for rank in range(world_size))]

    def adopt_parts(self, step: int, moves: Sequence[PartMove]) -> None:
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


class _FilesFromSnapshot(HostCopy):
    """A snapshot's host copy, to be written as this worker's files of a checkpoint folder."""

    def __init__(self, taken: Taken, group: Any) -> None:
        self.taken, self.group = taken, group

    def write(self, folder: Storage) -> None:
        from raysgd_operator import sharded_memory

        directory = tempfile.mkdtemp(prefix="part-", dir=_files_dir(nbytes(self.taken.staged)))
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


# ------------------------------------------------------------------------------ the driver's half
class Sharded(StateKind):
    """Each worker holds its part, with snapshots of its own and a peer's: a restore takes the
    newest snapshot whose every part survived, a checkpoint is a folder of every worker's part
    with a manifest."""

    checkpoint_name = AUTO_NAMES[SHARDED]
    # Never in one place: a copy would have to gather every part.
    keeps_driver_copy = False
    spare_imports = SHARDED_STATE_IMPORTS
    worker_class = ShardedState
    gathers_models = True

    def plan(
        self, holdings: Sequence[Holding], world_size: int, rank_sources: Sequence[Optional[int]]
    ) -> RestorePlan:
        plan = plan_from_snapshots(holdings, world_size)
        inexact: tuple[str, ...] = ()
        if plan.snapshot is not None:
            inexact = _slots_not_held(plan.snapshot.state, rank_sources, plan.step)
            progress = [h.progress for h in holdings]
            inexact += interleaved_validation(progress) + validation_skipped(progress, plan.step)
        return replace(plan, rank_sources=tuple(rank_sources), inexact=inexact)

    def settle(self, workers: Workers) -> None:
        # A new snapshot in the new layout: every part has a copy on a peer again.
        (step, choice), *_ = workers.group.execute(capture)
        if choice is not None:
            # What a loss costs is the user's to know at start-up and after every resize.
            logger.log(logging.INFO if step is not None else logging.WARNING, "%s", choice)

    def save(self, workers: Workers, location: Storage, step: int) -> str:
        """A folder: on the local disk written beside it and renamed into place (an older
        checkpoint there is replaced only then); on an object store its old manifest goes first,
        so that a write cut short leaves no torn checkpoint."""
        epoch = _epoch(workers)
        if not location.is_local:
            location.remove(MANIFEST_NAME)
            _write_parts(workers, location)
            write_manifest(location, SHARDED, epoch, step)
            return location.url
        with location.replaced_folder() as folder:
            _write_parts(workers, folder)
            write_manifest(folder, SHARDED, epoch, step)
        return location.path

    def gather(self, workers: Workers, step: int) -> dict[str, Any]:
        """The checkpoint folder's files as bytes (`storage.format.gathered`)."""
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            folder = as_storage(os.path.join(tmp, "state"))
            os.makedirs(folder.path)
            _write_parts(workers, folder)
            write_manifest(folder, SHARDED, _epoch(workers), step)
            files = {name: folder.read_bytes(name) for name in folder.listdir()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return gathered(files)

    def hand_over(self, workers: Workers, leaving: Sequence[int]) -> None:
        """A snapshot now, and each leaving worker's part given to a worker that stays. When
        every worker leaves, the snapshot is all: the replacements that join first restore
        from it."""
        group = workers.group
        # A move needs the leaving workers' parts, whatever the snapshot budget, until it is
        # done (the restore after it drops every snapshot of the old group).
        step = group.execute(capture, True)[0][0]
        assert step is not None
        staying = [r for r in range(group.world_size) if r not in set(leaving)]
        if not staying or not leaving:
            return
        holdings = group.execute(worker.holding)
        moves: list[PartMove] = []
        for i, part in enumerate(sorted(set(leaving))):
            holder = next(
                (
                    rank
                    for rank, holding in enumerate(holdings)
                    if any(h.step == step and part in h.parts for h in holding.snapshots)
                ),
                None,
            )
            if holder is not None:
                moves.append(PartMove(part, holder, staying[i % len(staying)]))
        # Every worker takes part: the holders send, the staying workers receive.
        group.execute(adopt_parts, step, moves)

    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        missing = missing_parts(holdings)
        lost = (
            f"the in-memory parts of worker(s) {missing} were lost together with their replicas"
            if missing
            else "every worker that held an in-memory snapshot was lost"
        )
        return f"{lost}: restoring the last {what} (work since then is redone)"

    @classmethod
    def source_at(cls, location: Storage, reachable: bool) -> LoadSource:
        return PartsSource.at(location, reachable)

    @classmethod
    @contextmanager
    def state_source(
        cls, state: Mapping[str, Any], reachable: bool
    ) -> Iterator[tuple[LoadSource, Optional[bytes]]]:
        """The gathered folder's files written to a folder of this process's, read from there."""
        files = gathered_files(state)
        assert files is not None
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            for name, data in files.items():
                with open(os.path.join(tmp, name), "wb") as handle:
                    handle.write(data)
            yield PartsSource.at(as_storage(tmp), reachable), None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _epoch(workers: Workers) -> int:
    return int(workers.group.execute_single(0, worker.epoch))


def _write_parts(workers: Workers, folder: Storage) -> None:
    """Every worker writes its part into `folder` (a collective); the parts of workers that
    cannot reach a local folder come through the object store and are written here."""
    for shipped in workers.group.execute(save_parts, folder):
        if shipped:
            bundles: dict[int, dict[str, bytes]] = {}
            for name, ref in shipped.items():
                data = bundles.setdefault(id(ref), ray.get(ref))[name]
                folder.write_bytes(name, data)


# ------------------------------------------------------------------------------ the plan
def plan_from_snapshots(holdings: Sequence[Holding], world_size: int) -> RestorePlan:
    """The restore of a sharded state over a new group of `world_size`: the newest snapshot whose
    every part some survivor holds (the survivors' own parts and their peers' copies)."""
    progress = [h.progress for h in holdings]
    call = next((p.call for p in progress if p is not None and p.call is not None), None)
    found = newest_held_step(
        (rank, held.step, held.world_size, held.parts)
        for rank, holding in enumerate(holdings)
        for held in holding.snapshots
    )
    if found is None:
        return RestorePlan(0, 0, call, finished_at=last_finished(progress))
    step, holders = found
    # Each part from the snapshot of its holder (any copy of a part is the same bytes).
    snapshots = {
        rank: next(held for held in holdings[rank].snapshots if held.step == step)
        for rank in set(holders.values())
    }
    parts = {part: snapshots[rank].parts[part] for part, rank in holders.items()}
    newest = snapshots[holders[0]]
    meters: list[Optional[AverageMeterCollection]] = [None] * world_size
    # The metrics a snapshot holds are those of the call it was taken in: only when that is the
    # call going on do they count (a snapshot at a call's first step may be the last of the one
    # before, its metrics that call's).
    taken_in = newest.call
    same_call = call is not None and taken_in is not None and taken_in.call_id == call.call_id
    if call is not None:
        # The call goes on from the snapshot's step: its rows up to there, and its loop's time
        # for them, are those the snapshot's own record counted (none when the snapshot is
        # older than the call).
        call = replace(
            call,
            rows=taken_in.rows if same_call else 0,
            loop_s=taken_in.loop_s if same_call else 0.0,
        )
    for old_rank in sorted(parts) if same_call else ():
        share = parts[old_rank]
        if share is None:
            continue
        index = old_rank % world_size
        if meters[index] is None:
            meters[index] = share
        else:
            meters[index].merge(share)  # type: ignore[union-attr]
    return RestorePlan(
        step,
        max(reached(progress), step) - step,
        call,
        snapshot=SnapshotPlan(newest.metadata, newest.state, dict(holders), meters),
        description=f"the in-memory snapshot at step {step}",
        finished_at=last_finished(progress),
    )


def _slots_not_held(
    state: Mapping[str, Any], rank_sources: Sequence[Optional[int]], step: int
) -> tuple[str, ...]:
    """Why going on from a snapshot with the rest `state` is inexact: the ranks of the group
    before whose place a rank takes (`rank_sources`) and whose slot the snapshot lacks (every
    worker gathers every rank's slot into the snapshots it takes, unless that failed)."""
    slots = state.get(RANK_SLOTS) or ()
    return tuple(
        slot_lost(old, step)
        for old in rank_sources
        if old is not None and (old >= len(slots) or slots[old] is None)
    )


def missing_parts(holdings: Sequence[Holding]) -> list[int]:
    """The old ranks whose part of the newest snapshot no worker holds (for the log line that
    says why a sharded state fell back on a checkpoint)."""
    newest: dict[str, Any] = {}
    for holding in holdings:
        for held in holding.snapshots:
            if not newest or held.step > newest["step"]:
                newest = {"step": held.step, "size": held.world_size, "ranks": set()}
            if held.step == newest["step"]:
                newest["ranks"] |= set(held.parts)
    if not newest:
        return []
    return sorted(set(range(newest["size"])) - newest["ranks"])


# ------------------------------------------------------------------------------ loading
@dataclass(frozen=True)
class PartsSource(LoadSource):
    """A sharded checkpoint folder to load, whatever the strategy and the number of workers.

    Attributes:
        metadata: The folder's DCP metadata.
        state: The folder's small rest of the state (counters, rank slots).
        files: The parts: the folder (a `Storage` every worker can reach), or
            ``{file name: ObjectRef of {file name: data}}`` shipped through the object store.
    """

    metadata: bytes
    state: dict[str, Any]
    files: Any

    @classmethod
    def at(cls, location: Storage, reachable: bool) -> PartsSource:
        """The folder at `location`, checked here: read by each worker when `reachable`, else
        its parts through the object store."""
        metadata, rest = read_sharded(location)
        if reachable:
            return cls(metadata, rest, location)
        files = {
            name: ray.put({name: location.read_bytes(name)})
            for name in location.listdir()
            if name.endswith(".distcp")
        }
        return cls(metadata, rest, files)

    def load_into(self, runner: OperatorRunner, rank_source: Optional[int]) -> None:
        """DCP loads the parts resharded into `runner` (a collective); a worker that sees the
        folder reads it in place, the others fetch only the parts their new shard overlaps."""
        files = self.files
        if isinstance(files, Storage) and files.is_local and os.path.isdir(files.path):
            runner.state.load_sharded(files.path, self.state)
            apply_rank_slot(runner, self.state, rank_source)
            return
        names = set(files) if isinstance(files, dict) else set(files.listdir())
        needed = runner.state.needed_parts(self.metadata) or {
            n for n in names if n.endswith(".distcp")
        }
        directory = tempfile.mkdtemp(prefix="load-", dir=scratch_dir())
        try:
            _write(directory, METADATA_FILE, self.metadata)
            bundles: dict[int, dict[str, Any]] = {}
            for name in sorted(needed):
                if name not in names:
                    raise RuntimeError(f"checkpoint part {name!r} is missing")
                if isinstance(files, dict):
                    ref = files[name]
                    data = bundles.setdefault(id(ref), ray.get(ref))[name]
                else:
                    data = files.read_bytes(name)
                _write(directory, name, data)
            runner.state.load_sharded(directory, self.state)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        apply_rank_slot(runner, self.state, rank_source)


def _write(directory: str, name: str, data: Any) -> None:
    with open(os.path.join(directory, name), "wb") as handle:
        handle.write(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)


# ------------------------------------------------------------------------------ run on the workers
def capture(even_over_budget: bool = False) -> tuple[Optional[int], Optional[str]]:
    """Snapshot every worker's part now (a collective); see `ShardedState.capture`."""
    state = worker_state()
    assert isinstance(state, ShardedState)
    return state.capture(even_over_budget)


def adopt_parts(step: int, moves: Sequence[PartMove]) -> None:
    """Move copies of leaving workers' parts of the snapshot at `step` to workers that stay
    (a collective: every worker calls it)."""
    state = worker_state()
    assert isinstance(state, ShardedState)
    state.adopt_parts(step, moves)


def save_parts(folder: Storage) -> Optional[dict[str, Any]]:
    """Write this worker's part of the state into the checkpoint `folder` (see
    `ShardedState.save_parts`)."""
    state = worker_state()
    assert isinstance(state, ShardedState)
    return state.save_parts(folder)
