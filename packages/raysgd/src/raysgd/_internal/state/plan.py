"""Who restores whom after a resize: the one rule every kind of state plans by.

Every worker answers `holding` with a `Holding` (`protocol`): how far it got (`Progress`, None
for a new worker) and what it holds of the state. One rule picks the state to go on from,
whatever the kind (`newest_held_step`): **the newest step every part of which some live worker
holds**, the lowest rank holding a part being its holder. What a worker offers to the rule is the
kind's (`replicated.plan_from_peers`: a clean worker holds the one part of its step;
`sharded.plan_from_snapshots`: the parts of each snapshot it keeps). When no plan finds a state
(`RestorePlan.found` is False), the driver falls back on a copy or a checkpoint
(`RestorePlan.fallback`). `reached` is the one rule for how far the group had got, from which the
steps redone are counted.

Every worker goes back to the start of the accumulation window it was in before it answers
(`RunPosition.progress`), so the step a plan goes on from is a window start, and the steps
redone are the window's batches finished before the failure plus the one in flight. A plan is
*exact* when the group goes on as it would have without the failure: at the same size, every rank
taking a lost rank's place gets that rank's slot as of the step gone on from. `RestorePlan.inexact`
names the ranks for which that was not possible, and why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from raysgd_operator import Progress

__all__ = [
    "Offer",
    "RestoreOutcome",
    "StateLostError",
    "interleaved_validation",
    "last_finished",
    "newest_held_step",
    "reached",
    "slot_lost",
    "validation_skipped",
]


class StateLostError(RuntimeError):
    """Every worker that held (part of) the training state was lost, and there is nothing to
    restore it from: no copy on the driver and no checkpoint. Not retried."""


@dataclass(frozen=True)
class RestoreOutcome:
    """What a restore after a resize did (recorded in the resize's event).

    Attributes:
        source: Where the state came from, in words.
        step: The finished step training goes on from.
        steps_redone: Steps started before the failure that are done again (with gradient
            accumulation: micro-batches, the interrupted window's).
        finished_at: When the surviving workers last finished a step (see `RestorePlan`).
        inexact: Why the run does not go on exactly as without the failure (empty: it does).
    """

    source: str
    step: int
    steps_redone: int
    finished_at: Optional[float] = None
    inexact: tuple[str, ...] = ()


def last_finished(progress: Iterable[Optional[Progress]]) -> Optional[float]:
    """When any of the workers last finished a step (None when none did)."""
    times = [p.finished_at for p in progress if p is not None and p.finished_at is not None]
    return max(times, default=None)


def reached(progress: Iterable[Optional[Progress]]) -> int:
    """The furthest step any worker had started: its finished steps, plus the one it was in."""
    return max((_reached(p) for p in progress if p is not None), default=0)


def slot_lost(rank: int, step: int) -> str:
    """Why a plan is inexact when no live worker holds rank `rank`'s slot of `step`."""
    return (
        f"the generators and per-rank state (rank_state_dict) of rank {rank} at step {step} "
        "were lost with it (no peer held them)"
    )


def interleaved_validation(progress: Iterable[Optional[Progress]]) -> tuple[str, ...]:
    """Why a plan is inexact when a validation ran inside the interrupted window (empty when
    none did): redone, the window's batches draw after the validation's draws."""
    if any(p is not None and p.interleaved for p in progress):
        return (
            "a validation ran inside the interrupted accumulation window: redoing the window "
            "after it draws its random numbers in another order",
        )
    return ()


def validation_skipped(progress: Iterable[Optional[Progress]], step: int) -> tuple[str, ...]:
    """Why a plan that goes back to `step` is inexact when a validation ran at a later window
    start (`Progress.validated_at`; empty when none did): the steps redone draw their random
    numbers without what it drew."""
    at = max((p.validated_at for p in progress if p is not None and p.validated_at), default=0)
    if at <= step:
        return ()
    return (
        f"a validation at step {at} drew random numbers after step {step}, which the group "
        "goes back to: the steps redone from there draw without them",
    )


def _reached(p: Progress) -> int:
    if p.reached is not None:
        return p.reached
    return p.step + (1 if p.in_batch or not p.clean else 0)


#: One worker's offer to the planner: (its rank, a step it holds state of, how many parts that
#: state has in all, the parts of it this worker holds).
Offer = tuple[int, int, int, Iterable[int]]


def newest_held_step(offers: Iterable[Offer]) -> Optional[tuple[int, dict[int, int]]]:
    """The planners' one rule: the newest step every part of which some worker holds, with the
    lowest rank holding each part (part -> rank); None when no step is complete."""
    holders: dict[int, dict[int, int]] = {}
    sizes: dict[int, int] = {}
    for rank, step, size, parts in sorted(offers, key=lambda offer: offer[0]):
        sizes.setdefault(step, size)
        held = holders.setdefault(step, {})
        for part in parts:
            held.setdefault(part, rank)
    complete = [step for step, held in holders.items() if set(held) >= set(range(sizes[step]))]
    if not complete:
        return None
    step = max(complete)
    return step, holders[step]
