"""What raysgd keeps in one worker process between the driver's calls: one `WorkerObjects`.

It lives in the worker's `store` (`raysgd_core.WorkerContext.store`, which outlives a re-formed
process group), under one key; `this_worker()` gives it. A new worker's objects are empty until
the driver builds its runner; a kept worker keeps them through every resize. The functions
below make, arm and give its parts (a part made for one runner is made anew for the next): the
parts themselves know nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from raysgd._internal.worker.boundary_watch import BoundaryWatch
from raysgd._internal.worker.collective_bound import CollectiveBound
from raysgd._internal.worker.periodic_checkpoints import PeriodicCheckpoints
from raysgd._internal.worker.rank_replicas import RankReplicas
from raysgd_core import get_context

if TYPE_CHECKING:
    from raysgd._internal.protocol import CheckpointPlan, WatchSpec
    from raysgd._internal.worker.state import WorkerState
    from raysgd_operator import OperatorRunner

__all__ = [
    "STORE_KEY",
    "WorkerObjects",
    "bound_for",
    "keep",
    "periodic_for",
    "replicas_for",
    "this_worker",
    "uploads",
    "watch_for",
    "worker_state",
]

#: The objects' key in the worker's store (shared with other libraries: namespaced).
STORE_KEY = "raysgd"


@dataclass(eq=False)
class WorkerObjects:
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
            the runner is built with its group and when a restore ends; None from a restore's
            start (which keeps the runner's own slot among its copies: `RankReplicas.keep_own`)
            to its end, so that a restore that fails midway, its runner holding a received
            state's or a moved slot by then, claims no slot of its own.
    """

    runner: Optional[OperatorRunner] = None
    state: Optional[WorkerState] = None
    uploads: Optional[PeriodicCheckpoints] = None
    watch: Optional[BoundaryWatch] = None
    bound: Optional[CollectiveBound] = None
    replicas: Optional[RankReplicas] = None
    slot_of: Optional[tuple[int, int]] = None

    def close(self) -> None:
        """End what these parts keep running (the checkpoint writer's thread, the state's
        snapshots, the runner's data iterators): the process is kept for another group."""
        if self.uploads is not None:
            self.uploads.close()
        if self.state is not None:
            self.state.close()
        if self.runner is not None:
            self.runner.shutdown()


def this_worker() -> WorkerObjects:
    """This worker's objects (made empty on first use)."""
    store = get_context().store
    objects = store.get(STORE_KEY)
    if objects is None:
        objects = store[STORE_KEY] = WorkerObjects()
    return objects


def worker_state() -> WorkerState:
    """This worker's `WorkerState`."""
    state = this_worker().state
    if state is None:
        raise RuntimeError("this worker holds no raysgd training state")
    return state


def keep(state: WorkerState) -> WorkerState:
    """Make `state` this worker's (closing the one it replaces)."""
    objects = this_worker()
    if objects.state is not None and objects.state is not state:
        objects.state.close()
    objects.state = state
    return state


def watch_for(runner: OperatorRunner, spec: Optional[WatchSpec]) -> None:
    """Arm this worker's watch for the call about to run (made on first use, per runner)."""
    objects = this_worker()
    watch = objects.watch
    if watch is None or watch.runner is not runner:
        if spec is None:
            return
        watch = objects.watch = BoundaryWatch(runner)
    watch.arm(spec)


def bound_for(runner: OperatorRunner) -> CollectiveBound:
    """This worker's bound for `runner` (made on first use, per runner)."""
    objects = this_worker()
    if objects.bound is None or objects.bound.runner is not runner:
        objects.bound = CollectiveBound(runner, runner.options)
    return objects.bound


def periodic_for(state: WorkerState, plan: Optional[CheckpointPlan]) -> None:
    """Arm this worker's periodic checkpoints for the call about to run (made on first use, one
    per runner: its step hook stays with the runner, and a kept runner keeps it)."""
    objects = this_worker()
    periodic = objects.uploads
    if periodic is None or periodic.state.runner is not state.runner:
        if plan is None:
            return
        if periodic is not None:
            periodic.close()  # its runner is gone; its last upload, if any, is left to finish
        periodic = objects.uploads = PeriodicCheckpoints(state)
    periodic.state = state
    periodic.arm(plan)


def uploads() -> Optional[PeriodicCheckpoints]:
    """This worker's periodic checkpoints, if any were armed."""
    return this_worker().uploads


def replicas_for(runner: OperatorRunner) -> RankReplicas:
    """This worker's replicas of its peer's slot (made on first use, per runner: its step hook
    stays with the runner)."""
    objects = this_worker()
    replicas = objects.replicas
    if replicas is None or replicas.runner is not runner:
        replicas = objects.replicas = RankReplicas(runner)
    return replicas
