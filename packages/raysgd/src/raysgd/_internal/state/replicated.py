"""A replicated training state (``ddp``, ``none``): every worker holds all of it. Both halves.

The driver's (`Replicated`): a restore is planned from what the survivors hold
(`plan_from_peers`); a checkpoint is one file, written by a worker that can reach it; the whole
state comes to the driver from rank 0; a whole state loads (`WholeSource`) into any strategy and
size, a sharded one keeping each worker's part.

The workers' (`ReplicatedState`): after a resize the survivor furthest along sends its live
tensors to the workers that need them over the new process group (`worker.transfer`), and every
worker takes its place in the epoch and the call it was in. A survivor keeps its runner, re-bound
to its new rank and size (built again, keeping its state, when the user's loaders cannot follow),
and its own rank slot (generators, per-rank state) as of the window start it went back to; a
worker that takes a lost rank's place gets that rank's slot from the ring peer that kept a replica
of it (`worker.rank_replicas`). The survivors may stand a window apart (a collective that ends on
some ranks before a peer's loss fails it on the others: those ranks stepped, the others went
back): when only the older window start has every rank's slot, the group goes back to it, redoing
a window rather than going on inexactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Optional

import ray
import torch

from raysgd._internal.protocol import (
    Holding,
    LoadSource,
    RestorePlan,
    RunnerArgs,
    SlotMove,
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
from raysgd._internal.storage.atomic_files import write_file
from raysgd._internal.storage.format import (
    AUTO_NAMES,
    WHOLE,
    WHOLE_FILE,
    state_from_bytes,
    state_to_bytes,
    write_state,
)
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.build import (
    build_runner,
    current_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.objects import keep, replicas_for, this_worker
from raysgd._internal.worker.part_exchange import exchange
from raysgd._internal.worker.rank_replicas import (
    PeerSlot,
    decode_slot,
    encode_slot,
)
from raysgd._internal.worker.state import (
    RANK_SLOTS,
    HostCopy,
    WorkerState,
    apply_rank_slot,
    gather_rank_slots,
    state_within,
)
from raysgd._internal.worker.transfer import broadcast_state
from raysgd_core import get_context
from raysgd_operator import OperatorRunner, Progress, StateIO

__all__ = [
    "Replicated",
    "ReplicatedState",
    "WholeSource",
    "hand_over_slots",
    "plan_from_peers",
    "replicate_slots",
    "save_file",
    "state_bytes",
]

logger = logging.getLogger("raysgd")


# ------------------------------------------------------------------------------ the workers' half
class ReplicatedState(WorkerState):
    """Every worker holds the whole state (see the module docstring)."""

    kind = WHOLE
    #: Rank 0's last host copy for a periodic checkpoint, which the next one is copied into.
    _host_copy: Optional[dict[str, Any]] = None

    def __init__(self, runner: OperatorRunner) -> None:
        super().__init__(runner)
        replicas_for(runner)

    def holding(self) -> Holding:
        progress = self.runner.position.progress()
        objects = this_worker()
        replicas = objects.replicas
        return Holding(
            progress,
            # The rank whose slot it holds (its rank until a restore that failed midway).
            rank=objects.slot_of,
            peer_slots=replicas.held() if replicas is not None else (),
        )

    @classmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> ReplicatedState:
        ctx = get_context()
        rank = ctx.world_rank
        runner: Optional[OperatorRunner] = this_worker().runner
        # The copies of other ranks' slots this worker keeps (taken before the runner is
        # re-bound), and its own slot as of the window start it went back to.
        replicas = this_worker().replicas
        if replicas is not None and replicas.runner is not runner:
            replicas = None
        own = runner.state.rank_slot() if runner is not None else None
        if replicas is not None and own is not None and this_worker().slot_of is not None:
            # Kept among the copies too: if this restore fails midway (a loss in it), the runner's
            # slot may be another's by then (a received state's, a moved slot's), and the next
            # restore finds this rank's own there.
            replicas.keep_own(runner.position.window_step, own)
        # The runner's slot is this rank's again once the restore gave it one (the end).
        this_worker().slot_of = None
        copies = replicas.copies if replicas is not None else {}
        if runner is not None and not runner.rebind(
            world_rank=rank,
            local_rank=ctx.local_rank,
            world_size=ctx.world_size,
            config=dict(args.config),
            datasets=my_dataset_splits(args.dataset_splits),
            group=ctx.generation,
        ):
            # The loaders cannot follow (the user's own sampler): set up again, keeping the state.
            old = runner
            runner = build_runner(args, restoring=True)
            runner.state.take_over(old.state)
            old.shutdown()
        if runner is None:
            runner = build_runner(args, restoring=True)
        state = keep(cls(runner))
        if not plan.found:
            plan.fallback.load_into(runner, plan.rank_source(rank))
            if plan.call is not None:
                # A checkpoint the driver went back to instead of going on inexactly: the call
                # goes on from its step (its metrics from there; its count as the plan says).
                runner.position.adopt_snapshot(plan.call, None)
            else:
                # The copy or checkpoint predates the interrupted call: every worker, kept or
                # new, starts that call again from the loaded step (a survivor's own record of
                # it would have it run fewer steps than the new workers, and the group would
                # wait in a collective).
                runner.position.adopt(runner.position.position_state(), None)
            this_worker().slot_of = (rank, ctx.generation)
            return state
        assert plan.source is not None
        live = runner.state.state_dict(live=True) if rank == plan.source else None
        received = broadcast_state(
            live, source=plan.source, receivers=plan.receivers, device=torch.device(ctx.device)
        )
        if rank in plan.receivers:
            runner.state.load_state_dict(received)
        _adopt_from(runner, plan.source)
        slot = _move_slots(plan.slot_moves, plan.step, own, copies, replicas_for(runner).group())
        # The slot of the rank whose place this worker takes, when another worker held it; else
        # its own (a survivor's, also when it received the source's state, which carries the
        # source's generators); a new worker with none starts its per-rank state afresh.
        runner.state.load_rank_slot(slot if slot is not None else own)
        this_worker().slot_of = (rank, ctx.generation)
        return state

    def copy_for_driver(self, limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        return state_within(self.runner, limit_bytes)

    def copy_to_host(self) -> Optional[HostCopy]:
        """Rank 0 copies the whole state to host memory, into the previous checkpoint's copy
        (kept for that), with every rank's per-rank state; the others write nothing."""
        rank_slots = gather_rank_slots(self.runner, 0)
        if get_context().world_rank != 0:
            return None
        self._host_copy = self.runner.state.state_dict(into=self._host_copy)
        if rank_slots is not None:
            self._host_copy[RANK_SLOTS] = rank_slots
        return _WholeHostCopy(self._host_copy)

    def prepare_host_copy(self) -> Optional[Callable[[], None]]:
        """Rank 0 maps its host copy's memory ahead of the first checkpoint: a copy into new
        memory, which the system maps and zeroes page by page, takes several times as long as
        one into memory in use, and every worker waits for rank 0's copy."""
        if get_context().world_rank != 0 or self._host_copy is not None:
            return None
        live = self.runner.state.state_dict(live=True)  # references: shapes and dtypes, no copy

        def allocate() -> None:
            if self._host_copy is None:
                self._host_copy = StateIO.host_buffers(live)

        return allocate

    @classmethod
    def parts(cls, world_size: int) -> list[str]:
        return [WHOLE_FILE]


class _WholeHostCopy(HostCopy):
    """The whole state in host memory, written as the folder's one part."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def write(self, folder: Storage) -> None:
        write_state(folder, WHOLE_FILE, self.state)


def _move_slots(
    moves: Sequence[SlotMove],
    step: int,
    own: Optional[dict],
    copies: Mapping[tuple[int, int], PeerSlot],
    group: Any,
) -> Optional[dict]:
    """Send and receive the rank slots of `moves` as of `step` over `group`: a holder sends its
    `own` slot or a copy it keeps (`copies`, by rank and step: another rank's, or its own of an
    earlier window start). Returns the slot this worker receives, or None (every worker calls
    this)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    sends, kept = [], None
    for move in moves:
        if move.holder != rank:
            continue
        if move.replica:
            data = copies[(move.rank, step)].encoded()
        else:
            data = encode_slot(own)
        if move.receiver == rank:
            kept = decode_slot(data)  # this worker holds the slot it takes
        else:
            sends.append(
                (
                    move.receiver,
                    {"slot": torch.frombuffer(bytearray(data), dtype=torch.uint8)},
                    None,
                )
            )
    receives = [move.holder for move in moves if move.receiver == rank and move.holder != rank]
    if not sends and not receives:
        return kept
    received = exchange(group, sends, receives)
    return decode_slot(received[0][0]["slot"].numpy().tobytes()) if receives else kept


def _adopt_from(runner: OperatorRunner, source: int) -> None:
    """Every rank takes the source's place in the epoch and its call (small: one object)."""
    import torch.distributed as dist

    ctx = get_context()
    holder = [
        (runner.position.position_state(), runner.position.call)
        if ctx.world_rank == source
        else None
    ]
    # NCCL moves objects through device tensors; gloo through CPU ones.
    device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(holder, src=source, device=device)
    position, call = holder[0]  # type: ignore[misc]
    runner.position.adopt(position, call)


# ------------------------------------------------------------------------------ the driver's half
class Replicated(StateKind):
    """Every worker holds the whole state: a survivor has all of it, a checkpoint is one file."""

    checkpoint_name = AUTO_NAMES[WHOLE]
    worker_class = ReplicatedState
    keeps_driver_copy = True

    def plan(
        self, holdings: Sequence[Holding], world_size: int, rank_sources: Sequence[Optional[int]]
    ) -> RestorePlan:
        return plan_from_peers(holdings, rank_sources)

    def settle(self, workers: Workers) -> None:
        # Every worker holds the models and optimizers whole; what differs from rank to rank is
        # given to the ring peer now, so that a loss before the next window start finds it.
        workers.group.execute(replicate_slots)

    def save(self, workers: Workers, location: Storage, step: int) -> str:
        """One file, written by a worker that can reach it (an object store; the local disk of
        a worker on this node or of one that shares it), else through the driver."""
        group = workers.group
        if not location.is_local:
            group.execute(save_file, location, 0)
            return location.url
        path = location.path
        rank = workers.writer_rank(os.path.dirname(path))
        if rank is not None:
            group.execute(save_file, location, rank)
            logger.debug("checkpoint %s written by rank %d", path, rank)
        else:
            write_file(path, group.execute(state_bytes)[0])
            logger.debug(
                "checkpoint %s written through the driver (no worker shares its disk)", path
            )
        return path

    def gather(self, workers: Workers, step: int) -> dict[str, Any]:
        return state_from_bytes(workers.group.execute(state_bytes)[0])

    def hand_over(self, workers: Workers, leaving: Sequence[int]) -> None:
        # The workers that stay hold the models and optimizers of this boundary already; each
        # leaving worker gives its slot (generators, per-rank state) to one that stays.
        if leaving:
            workers.group.execute(hand_over_slots, list(leaving))

    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        return (
            f"no worker holds the training state any more: restoring {what}; the interrupted "
            f"call starts again from there (at least {redone} step(s) are done again)"
        )

    @classmethod
    def source_at(cls, location: Storage, reachable: bool) -> LoadSource:
        return WholeSource.at(location, reachable)

    @classmethod
    @contextmanager
    def state_source(
        cls, state: Mapping[str, Any], reachable: bool
    ) -> Iterator[tuple[LoadSource, Optional[bytes]]]:
        data = state_to_bytes(dict(state))
        yield WholeSource(ray.put(data)), data

    def copy_source(self, data: bytes) -> LoadSource:
        return WholeSource(ray.put(data))


# ------------------------------------------------------------------------------ the plan
def plan_from_peers(
    holdings: Sequence[Holding], rank_sources: Sequence[Optional[int]] = ()
) -> RestorePlan:
    """The restore of a group whose rank r reported `holdings[r]`, when every worker holds the
    whole state: a clean worker holds the one part of its step. `rank_sources`: whose slot each
    rank takes (see `RestorePlan`; empty: its own)."""
    progress = [holding.progress for holding in holdings]
    held = {p.step for p in progress if p is not None and p.clean}
    chosen: Optional[RestorePlan] = None
    # The newest step whose every slot is held; else the newest step, said to be inexact.
    for step in sorted(held, reverse=True):
        moves, inexact = _slot_moves(holdings, rank_sources, step)
        plan = replace(
            _whole_from_peers(progress, step),
            rank_sources=tuple(rank_sources),
            slot_moves=moves,
            inexact=inexact + interleaved_validation(progress) + validation_skipped(progress, step),
        )
        if chosen is None or not inexact:
            chosen = plan
        if not inexact:
            break
    if chosen is None:  # no clean worker: nothing to go on from
        return replace(_whole_from_peers(progress, None), rank_sources=tuple(rank_sources))
    return chosen


def _slot_moves(
    holdings: Sequence[Holding], rank_sources: Sequence[Optional[int]], step: int
) -> tuple[tuple[SlotMove, ...], tuple[str, ...]]:
    """How each rank of the re-formed group gets the slot of the rank of the group before whose
    place it takes (`rank_sources`), as of `step`: from the survivor that was that rank (its
    own), else from the ring peer that keeps a replica; and the ranks for which neither is held."""
    groups = {h.rank[1] for h in holdings if h.rank is not None and h.progress is not None}
    # A worker whose restore failed midway claims no slot of its own (`Holding.rank` None) and
    # offers its own among its copies: their groups count too.
    groups |= {copy.group for h in holdings if h.progress is not None for copy in h.peer_slots}
    if not groups:
        return (), ()
    trained_in = max(groups)  # the group the survivors trained in last
    own = {
        held.rank[0]: rank
        for rank, held in enumerate(holdings)
        if held.rank is not None
        and held.rank[1] == trained_in
        and held.progress is not None
        and held.progress.step == step
    }
    replica = {
        copy.rank: rank
        for rank, held in enumerate(holdings)
        for copy in held.peer_slots
        if (copy.group, copy.step) == (trained_in, step)
    }
    moves: list[SlotMove] = []
    missing: list[str] = []
    for new_rank, old_rank in enumerate(rank_sources):
        if old_rank is None:
            continue  # a worker added to the group: no rank's place to take
        if own.get(old_rank) == new_rank:
            continue  # a survivor in its own place: its slot is where it belongs
        if old_rank in own:
            moves.append(SlotMove(old_rank, own[old_rank], new_rank, replica=False))
        elif old_rank in replica:
            moves.append(SlotMove(old_rank, replica[old_rank], new_rank, replica=True))
        else:
            missing.append(slot_lost(old_rank, step))
    return tuple(moves), tuple(missing)


def _whole_from_peers(progress: Sequence[Optional[Progress]], step: Optional[int]) -> RestorePlan:
    """The source and receivers of a whole state as of `step` (see `plan_from_peers`; None: no
    clean worker holds a step)."""
    found = newest_held_step(
        (rank, p.step, 1, (0,))
        for rank, p in enumerate(progress)
        if p is not None and p.clean and p.step == step
    )
    if found is None:
        return RestorePlan(
            0,
            0,
            None,
            receivers=tuple(range(len(progress))),
            finished_at=last_finished(progress),
        )
    step, holders = found
    source = holders[0]
    receivers = tuple(
        rank
        for rank, p in enumerate(progress)
        if rank != source and (p is None or not p.clean or p.step != step)
    )
    source_call = progress[source].call  # type: ignore[union-attr]
    return RestorePlan(
        step,
        max(0, reached(progress) - step),
        source_call,
        source=source,
        receivers=receivers,
        description=f"rank {source} at step {step}",
        finished_at=last_finished(progress),
    )


# ------------------------------------------------------------------------------ loading
@dataclass(frozen=True)
class WholeSource(LoadSource):
    """A whole state to load: its bytes (or an ObjectRef of them), or the checkpoint file to read
    (a `Storage` every worker can reach). It is read and checked whole before anything changes."""

    whole: Any
    checked_first: ClassVar[bool] = True

    @classmethod
    def at(cls, location: Storage, reachable: bool) -> WholeSource:
        """The checkpoint file at `location`: read by each worker when `reachable` (an object
        store; the local disk of workers on this node), else its bytes through the object store."""
        if reachable:
            return cls(location)
        return cls(ray.put(location.parent().read_bytes(location.name)))

    def load_into(self, runner: OperatorRunner, rank_source: Optional[int]) -> None:
        whole = self.whole
        if isinstance(whole, Storage):
            data = whole.parent().read_bytes(whole.name)
            where = f"file {whole.url!r}"
        else:
            data = ray.get(whole) if isinstance(whole, ray.ObjectRef) else whole
            where = "state"
        state = state_from_bytes(data, source=where)
        runner.state.load_state_dict(state)
        apply_rank_slot(runner, state, rank_source)


# ------------------------------------------------------------------------------ run on the workers
def replicate_slots() -> None:
    """Give this worker's rank slot to its ring peer and keep its predecessor's, now (every
    worker calls it at once): see `worker.rank_replicas`."""
    replicas_for(current_runner()).exchange()


def hand_over_slots(leaving: Sequence[int]) -> None:
    """Before the workers of `leaving` leave on purpose: each gives its rank slot to a worker
    that stays (every worker calls it at once): see `worker.rank_replicas`."""
    replicas_for(current_runner()).adopt(leaving)


def save_file(location: Storage, writer: int) -> None:
    """Rank `writer` writes the whole state as one checkpoint file at `location`, atomically,
    with every rank's per-rank state (every worker calls this: the latter is a collective)."""
    runner = current_runner()
    rank_slots = gather_rank_slots(runner, writer)
    if get_context().world_rank == writer:
        write_state(location.parent(), location.name, _with_rank_slots(runner, rank_slots))


def state_bytes() -> Optional[bytes]:
    """The whole state, serialised, with every rank's per-rank state, on rank 0 (None on the
    others; every worker calls this: `TorchTrainer.state_dict`, a checkpoint written through the
    driver)."""
    runner = current_runner()
    rank_slots = gather_rank_slots(runner, 0)
    if get_context().world_rank != 0:
        return None
    return state_to_bytes(_with_rank_slots(runner, rank_slots))


def _with_rank_slots(runner: OperatorRunner, rank_slots: Optional[list]) -> dict[str, Any]:
    state = runner.state.state_dict()
    if rank_slots is not None:
        state[RANK_SLOTS] = rank_slots
    return state
