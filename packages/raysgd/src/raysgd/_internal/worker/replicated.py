"""A replicated training state (``ddp``, ``none``): every worker holds all of it.

After a resize the survivor furthest along (`restore_plan.plan_from_peers`) sends its live tensors
to the workers that need them over the new process group (`worker.transfer`), and every worker
takes its place in the epoch and the call it was in. A survivor keeps its runner, re-bound to its
new rank and size (built again, keeping its state, when the user's loaders cannot follow), and
its own rank slot (generators, per-rank state) as of the window start it went back to; a worker
that takes a lost rank's place gets that rank's slot from the ring peer that kept a replica of it
(`rank_replicas`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from raysgd._internal.protocol import Holding, RestorePlan, RunnerArgs, SlotMove
from raysgd._internal.storage.format import WHOLE, WHOLE_FILE, write_state
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.part_exchange import exchange
from raysgd._internal.worker.rank_replicas import (
    PeerSlot,
    decode_slot,
    encode_slot,
)
from raysgd._internal.worker.runner import (
    build_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.slot import keep, replicas_for, this_worker
from raysgd._internal.worker.state import (
    RANK_SLOTS,
    HostCopy,
    WorkerState,
    gather_rank_slots,
    load_into,
    state_within,
)
from raysgd._internal.worker.transfer import broadcast_state
from raysgd_core import get_context
from raysgd_operator import OperatorRunner

__all__ = ["ReplicatedState"]


class ReplicatedState(WorkerState):
    """Every worker holds the whole state (see the module docstring)."""

    kind = WHOLE
    #: Rank 0's last host copy for a periodic checkpoint, which the next one is copied into.
    _host_copy: Optional[dict[str, Any]] = None

    def __init__(self, runner: OperatorRunner) -> None:
        super().__init__(runner)
        replicas_for(runner)

    def holding(self) -> Holding:
        progress = self.runner.progress()
        slot = this_worker()
        replicas = slot.replicas
        return Holding(
            progress,
            # The rank whose slot it holds (its rank until a restore that failed midway).
            rank=slot.slot_of,
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
        copies = replicas.copies if replicas is not None and replicas.runner is runner else {}
        own = runner.rank_slot() if runner is not None else None
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
            runner.take_over(old)
            old.shutdown()
        if runner is None:
            runner = build_runner(args, restoring=True)
        state = keep(cls(runner))
        if not plan.found:
            load_into(runner, plan.fallback, plan.rank_source(rank))
            # The copy or checkpoint predates the interrupted call: every worker, kept or new,
            # starts that call again from the loaded step (a survivor's own record of it would
            # have it run fewer steps than the new workers, and the group would wait in a
            # collective).
            runner.adopt(runner.position_state(), None)
            this_worker().slot_of = (rank, ctx.generation)
            return state
        assert plan.source is not None
        live = runner.state_dict(live=True) if rank == plan.source else None
        received = broadcast_state(
            live, source=plan.source, receivers=plan.receivers, device=torch.device(ctx.device)
        )
        if rank in plan.receivers:
            runner.load_state_dict(received)
        _adopt_from(runner, plan.source)
        slot = _move_slots(plan.slot_moves, own, copies, replicas_for(runner).group())
        # The slot of the rank whose place this worker takes, when another worker held it; else
        # its own (a survivor's, also when it received the source's state, which carries the
        # source's generators); a new worker with none starts its per-rank state afresh.
        runner.load_rank_slot(slot if slot is not None else own)
        this_worker().slot_of = (rank, ctx.generation)
        return state

    def save(self, folder: Storage) -> Optional[dict[str, Any]]:
        """The whole state as one part (called on one worker)."""
        write_state(folder, WHOLE_FILE, self.runner.state_dict())
        return None

    def copy_for_driver(self, limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        return state_within(self.runner, limit_bytes)

    def copy_to_host(self) -> Optional[HostCopy]:
        """Rank 0 copies the whole state to host memory, into the previous checkpoint's copy
        (kept for that), with every rank's per-rank state; the others write nothing."""
        rank_slots = gather_rank_slots(self.runner, 0)
        if get_context().world_rank != 0:
            return None
        self._host_copy = self.runner.state_dict(into=self._host_copy)
        if rank_slots is not None:
            self._host_copy[RANK_SLOTS] = rank_slots
        return _WholeHostCopy(self._host_copy)

    def prepare_host_copy(self) -> Optional[Callable[[], None]]:
        """Rank 0 maps its host copy's memory ahead of the first checkpoint: a copy into new
        memory, which the system maps and zeroes page by page, takes several times as long as
        one into memory in use, and every worker waits for rank 0's copy."""
        if get_context().world_rank != 0 or self._host_copy is not None:
            return None
        live = self.runner.state_dict(live=True)  # references: shapes and dtypes, no copy

        def allocate() -> None:
            if self._host_copy is None:
                self._host_copy = OperatorRunner.host_buffers(live)

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
    moves: Sequence[SlotMove], own: Optional[dict], copies: Mapping[int, PeerSlot], group: Any
) -> Optional[dict]:
    """Send and receive the rank slots of `moves` over `group`: a holder sends its `own` slot or
    its copy of another rank's (`copies`, by that rank). Returns the slot this worker receives,
    or None (every worker calls this)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    sends, kept = [], None
    for move in moves:
        if move.holder != rank:
            continue
        if move.replica:
            data = copies[move.rank].data
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
    holder = [(runner.position_state(), runner.call) if ctx.world_rank == source else None]
    # NCCL moves objects through device tensors; gloo through CPU ones.
    device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(holder, src=source, device=device)
    position, call = holder[0]  # type: ignore[misc]
    runner.adopt(position, call)
