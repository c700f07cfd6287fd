"""The named phases of a run and the transitions between them, as the run controller reports them.

`RunController` is the one writer of its `Phase`; every change is one `Transition`, handed in order
to the observers it was given (the loss ledger first, then goodput). A transition also carries what
happened on the way, when something did: a worker lost (`lost`), the seconds a checkpoint blocked
the call, the step time a call ended with. Observers read; they never change the run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from raysgd_fault import Action

__all__ = [
    "AT_REST",
    "LEGAL_NEXT",
    "NEXT_PHASE",
    "Phase",
    "PhaseWriter",
    "Transition",
    "TransitionObserver",
    "legal",
]


class Phase(str, enum.Enum):
    """Where the run is (the controller's module docstring says what leads from one to the next)."""

    #: Between calls.
    IDLE = "idle"
    #: A `train()` call starts: the scaling policy may grow the group back.
    GROWING = "growing"
    #: Workers move off draining nodes (a preemption notice), at a step boundary.
    MOVING = "moving"
    #: `train(checkpoint=...)` writes the state from before the call.
    CHECKPOINTING = "checkpointing"
    #: An attempt of the call runs on the workers.
    RUNNING = "running"
    #: Spares that are up join the group at a step boundary.
    JOINING = "joining"
    #: A worker was lost: the failure policy decides.
    FAILED = "failed"
    #: The failure policy's backoff.
    WAITING = "waiting"
    #: The resize the failure policy asked for.
    RESTARTING = "restarting"
    #: A call failed (user code raised, or a worker was lost outside `train()`): the group is
    #: re-formed at its size.
    REPAIRING = "repairing"
    #: The call's work is done.
    SUCCEEDED = "succeeded"
    #: The failure policy gave up: the call raises.
    GAVE_UP = "gave_up"


#: The phases between calls: a `train()` call, or a repair before or after another call, starts
#: from any of them (a call that ended in a repair that failed leaves the run FAILED, and the
#: next call starts by recovering).
AT_REST = frozenset({Phase.IDLE, Phase.SUCCEEDED, Phase.GAVE_UP, Phase.FAILED})

#: Where each phase may lead (besides itself: something that happened inside a phase).
LEGAL_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.GROWING: frozenset({Phase.MOVING, Phase.CHECKPOINTING, Phase.RUNNING, Phase.FAILED}),
    Phase.MOVING: frozenset({Phase.CHECKPOINTING, Phase.RUNNING, Phase.FAILED}),
    Phase.CHECKPOINTING: frozenset({Phase.RUNNING, Phase.FAILED, Phase.REPAIRING}),
    Phase.RUNNING: frozenset(
        {Phase.SUCCEEDED, Phase.FAILED, Phase.JOINING, Phase.MOVING, Phase.REPAIRING}
    ),
    Phase.JOINING: frozenset({Phase.RUNNING, Phase.FAILED}),
    Phase.FAILED: frozenset({Phase.RESTARTING, Phase.WAITING, Phase.GAVE_UP}),
    Phase.WAITING: frozenset({Phase.FAILED}),
    Phase.RESTARTING: frozenset({Phase.RUNNING, Phase.FAILED}),
    Phase.REPAIRING: frozenset({Phase.SUCCEEDED, Phase.FAILED}),
    Phase.SUCCEEDED: frozenset({Phase.IDLE}),
}

#: Where a call (or a repair) starts from a phase at rest.
_STARTS = frozenset(
    {
        Phase.IDLE,
        Phase.GROWING,
        Phase.MOVING,
        Phase.CHECKPOINTING,
        Phase.RUNNING,
        Phase.FAILED,
        Phase.REPAIRING,
    }
)


def legal(before: Phase, after: Phase) -> bool:
    """Whether the run may go from `before` to `after` (see `LEGAL_NEXT` and `AT_REST`)."""
    if before is after or after in LEGAL_NEXT.get(before, frozenset()):
        return True
    return before in AT_REST and after in _STARTS


#: The phase each failure-policy action leads to.
NEXT_PHASE = {
    Action.RETRY: Phase.RESTARTING,
    Action.WAIT: Phase.WAITING,
    Action.GIVE_UP: Phase.GAVE_UP,
}


@dataclass(frozen=True)
class Transition:
    """One change of phase (`before` -> `after`; equal for something that happened inside a
    phase, such as a worker lost during a resize).

    Attributes:
        before, after: The phases.
        size: The group's live size at the transition.
        new_count: The losses are counted afresh from here (a call, or a part of one after its
            workers stopped at a step boundary, starts).
        lost: The error of a worker lost here (counted unless `counted` is False: a loss while
            repairing after a user error is logged only).
        during_restart: `lost` came while the group was being resized.
        alive: Workers left alive after `lost`, when known.
        counted: See `lost`.
        recovered_s: A part of a call that saw losses finished: seconds since the first was seen.
        nodes: The draining nodes, while `after` is MOVING.
        checkpoint_s: Seconds a checkpoint blocked the call (`train(checkpoint=...)`, or the
            workers' periodic checkpoints in the call).
        step_s: The call's recent step time, when it ends.
        waited_s: Seconds the failure policy's backoff took (leaving WAITING).
    """

    before: Phase
    after: Phase
    size: int
    new_count: bool = False
    lost: Optional[BaseException] = None
    during_restart: bool = False
    alive: Optional[int] = None
    counted: bool = True
    recovered_s: Optional[float] = None
    nodes: frozenset[str] = frozenset()
    checkpoint_s: float = 0.0
    step_s: Optional[float] = None
    waited_s: float = 0.0


#: Called with every transition, in order.
TransitionObserver = Callable[[Transition], None]


class PhaseWriter(Protocol):
    """The run's phase as the controller's parts (its growth, its moves, its resizes) see it:
    they enter phases through it, never set one."""

    @property
    def phase(self) -> Phase:
        """The phase the run is in."""

    def enter(self, phase: Phase, **what: Any) -> None:
        """Go to `phase`; `what`: the `Transition`'s other fields."""

    def note(self, **what: Any) -> None:
        """Something happened inside the current phase (a worker lost during a resize, say)."""
