"""A replicated training state (``ddp``, ``none``): every worker holds all of it.

After a resize the survivor furthest along (`restore_plan.plan_from_peers`) sends its live tensors
to the workers that need them over the new process group (`worker.transfer`), and every worker
takes its place in the epoch and the call it was in. A survivor keeps its runner, re-bound to its
new rank and size (built again, keeping its state, when the user's loaders cannot follow).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from raysgd._internal.driver.restore_plan import Holding, RestorePlan
from raysgd._internal.storage.format import WHOLE, WHOLE_FILE, write_state
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.runner import (
    RunnerArgs,
    build_runner,
    my_dataset_splits,
)
from raysgd._internal.worker.slot import this_worker
from raysgd._internal.worker.state import (
    RANK_STATES,
    HostCopy,
    WorkerState,
    apply_rank_state,
    gather_rank_states,
    keep,
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

    def holding(self) -> Holding:
        return Holding(self.runner.progress())

    @classmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> ReplicatedState:
        ctx = get_context()
        rank = ctx.world_rank
        runner: Optional[OperatorRunner] = this_worker().runner
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
            # A new worker: no per-rank state of the rank it takes exists any more (its worker
            # held it), unless the fallback below brings the saved ones.
            apply_rank_state(runner, None, None)
        state = keep(cls(runner))
        if not plan.found:
            load_into(runner, plan.fallback, plan.rank_source(rank))
            # The copy or checkpoint predates the interrupted call: every worker, kept or new,
            # starts that call again from the loaded step (a survivor's own record of it would
            # have it run fewer steps than the new workers, and the group would wait in a
            # collective).
            runner.adopt(runner.position_state(), None)
            return state
        assert plan.source is not None
        live = runner.state_dict(live=True) if rank == plan.source else None
        received = broadcast_state(
            live, source=plan.source, receivers=plan.receivers, device=torch.device(ctx.device)
        )
        if rank in plan.receivers:
            runner.load_state_dict(received)
        _adopt_from(runner, plan.source)
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
        rank_states = gather_rank_states(self.runner, 0)
        if get_context().world_rank != 0:
            return None
        self._host_copy = self.runner.state_dict(into=self._host_copy)
        if rank_states is not None:
            self._host_copy[RANK_STATES] = rank_states
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
