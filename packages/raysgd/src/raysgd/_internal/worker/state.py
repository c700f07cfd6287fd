"""What one worker holds of the training state: the interface the worker's machinery (its calls,
its periodic checkpoints) asks of it, whatever the kind.

The kinds themselves, each with its driver's half, are the `state` folder's (`ReplicatedState`
for ``ddp`` and ``none``, `ShardedState` for ``fsdp``): the driver hands each worker the class
of its kind (`RunnerArgs.state_class`), so that nothing here asks which it is. What differs from
rank to rank (a rank's *slot*: the operator's per-rank state, the random generators, the loader's
seed of the epoch) is saved and applied alike for both (`gather_rank_slots`, `apply_rank_slot`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Optional

from raysgd._internal.protocol import Holding, LoadSource, RestorePlan, RunnerArgs
from raysgd._internal.storage.format import state_to_bytes
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.transfer import flatten
from raysgd_core import get_context
from raysgd_operator import OperatorRunner

__all__ = [
    "RANK_SLOTS",
    "HostCopy",
    "WorkerState",
    "apply_rank_slot",
    "gather_rank_slots",
    "state_within",
]

#: Where a saved state keeps what differs from rank to rank (`StateIO.rank_slot`: the
#: operator's per-rank state, the random generators, the loader's seed of the epoch), in rank
#: order.
RANK_SLOTS = "rank_slots"
#: Where states written before the generators were kept per rank held the operator's per-rank
#: states alone.
_RANK_STATES = "rank_states"


class HostCopy(abc.ABC):
    """A worker's part of the state, copied to host memory (`WorkerState.copy_to_host`)."""

    @abc.abstractmethod
    def write(self, folder: Storage) -> None:
        """Write the part into the checkpoint `folder` (in a background thread)."""


class WorkerState(abc.ABC):
    """What this worker holds of the training state (see the module docstring).

    Args:
        runner: The worker's runner, whose models, optimizers and position are the state.
    """

    #: The kind a checkpoint folder of this state names in its manifest (`storage.format.WHOLE`
    #: or `SHARDED`).
    kind: ClassVar[str]

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner

    @abc.abstractmethod
    def holding(self) -> Holding:
        """What this worker holds, for the restore planner (asked after a resize)."""

    @classmethod
    @abc.abstractmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> WorkerState:
        """After a resize: make this worker's runner (kept, re-bound or built from `args`) hold
        the state `plan` says, at its position and in the call it belongs to (a collective)."""

    @abc.abstractmethod
    def copy_to_host(self) -> Optional[HostCopy]:
        """Copy this worker's part of the state now to host memory, for a checkpoint written in
        the background (the training loop waits only for this); None when this worker writes no
        part. The copy may reuse the memory of this worker's previous one: copy again only once
        that one was written."""

    def prepare_host_copy(self) -> Optional[Callable[[], None]]:
        """Work that makes the first `copy_to_host` as quick as later ones (allocating the host memory it
        copies into), to run in a background thread before that checkpoint falls due; None when
        there is none. Called on the training thread between steps."""
        return None

    @classmethod
    @abc.abstractmethod
    def parts(cls, world_size: int) -> list[str]:
        """The files of a checkpoint folder of this kind written by `world_size` workers."""

    def load(self, source: LoadSource) -> None:
        """Load a checkpoint (of either kind) into this worker's runner, with this rank's slot."""
        source.load_into(self.runner, get_context().world_rank)

    def copy_for_driver(self, limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        """``(bytes, size)`` of the state for the driver's bounded copy (the bytes only when the
        size is at most `limit_bytes`), or None where the driver keeps no copy of this kind."""
        return None

    def close(self) -> None:
        """Release what the state keeps besides the runner (threads, snapshots)."""
        return None


def gather_rank_slots(runner: OperatorRunner, dst: Optional[int]) -> Optional[list[Any]]:
    """Every rank's slot (`StateIO.rank_slot`), in rank order: on rank `dst`, or on every
    rank with None; None elsewhere. A collective: every worker calls it at once."""
    import torch.distributed as dist

    mine = runner.state.rank_slot()
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    if dst is None:
        dist.all_gather_object(everyone, mine)
        return everyone
    dist.gather_object(mine, everyone if dist.get_rank() == dst else None, dst=dst)
    return everyone if dist.get_rank() == dst else None


def apply_rank_slot(
    runner: OperatorRunner, saved: Mapping[str, Any], source: Optional[int]
) -> None:
    """Give `runner` the slot that the state `saved` holds for rank `source` of the run it was
    saved in; none when it holds none for it (the operator starts its per-rank state afresh, the
    generators stay as they are)."""
    slots = saved.get(RANK_SLOTS)
    if slots is None and saved.get(_RANK_STATES) is not None:
        slots = [{"state": state} for state in saved[_RANK_STATES]]
    have = slots is not None and source is not None and 0 <= source < len(slots)
    runner.state.load_rank_slot(slots[source] if have else None)  # type: ignore[index]


def state_within(runner: OperatorRunner, limit_bytes: int) -> tuple[Optional[bytes], int]:
    """``(bytes or None, size)`` of `runner`'s whole state: the bytes only when the size is at
    most `limit_bytes` (measured on the live tensors first, so that a large state is never
    serialised for nothing)."""
    size = sum(t.numel() * t.element_size() for t in flatten(runner.state.state_dict(live=True))[1])
    return (state_to_bytes(runner.state.state_dict()) if size <= limit_bytes else None), size
