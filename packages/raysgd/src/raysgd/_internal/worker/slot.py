"""What raysgd keeps in one worker process between the driver's calls: one `WorkerSlot`.

It lives in the worker's `store` (`raysgd_core.WorkerContext.store`, which outlives a re-formed
process group), under one key; `this_worker()` gives it. A new worker's slot is empty until the
driver builds its runner; a kept worker keeps its slot through every resize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from raysgd_core import get_context

if TYPE_CHECKING:
    from raysgd._internal.worker.boundary_watch import BoundaryWatch
    from raysgd._internal.worker.collective_bound import CollectiveBound
    from raysgd._internal.worker.periodic_checkpoints import PeriodicCheckpoints
    from raysgd._internal.worker.rank_replicas import RankReplicas
    from raysgd._internal.worker.state import WorkerState
    from raysgd_operator import OperatorRunner

__all__ = ["SLOT_KEY", "WorkerSlot", "this_worker"]

#: The slot's key in the worker's store (shared with other libraries: namespaced).
SLOT_KEY = "raysgd"


@dataclass(eq=False)
class WorkerSlot:
    """This worker's raysgd objects.

    Attributes:
        runner: The operator and its loop, counters and data position.
        state: What this worker holds of the training state (`state.WorkerState`).
        uploads: The checkpoints this worker writes in the background (`checkpoint_every`).
        watch: The step hook that stops every worker at one boundary (a move, a spare joining).
        bound: The step hook that bounds how long a collective waits for a silent peer.
        replicas: The step hook that keeps the ring predecessor's rank slot (a replicated
            state).
        slot_of: The rank, and the group's number, whose rank slot the runner holds: set when
            the runner is built with its group and when a restore ends. A restore that fails
            midway has re-bound the runner to its new rank already, but not moved the slots:
            the runner still holds its old rank's, and says so.
    """

    runner: Optional[OperatorRunner] = None
    state: Optional[WorkerState] = None
    uploads: Optional[PeriodicCheckpoints] = None
    watch: Optional[BoundaryWatch] = None
    bound: Optional[CollectiveBound] = None
    replicas: Optional[RankReplicas] = None
    slot_of: Optional[tuple[int, int]] = None


def this_worker() -> WorkerSlot:
    """This worker's slot (made empty on first use)."""
    store = get_context().store
    slot = store.get(SLOT_KEY)
    if slot is None:
        slot = store[SLOT_KEY] = WorkerSlot()
    return slot
