"""Who restores whom after a resize: pure decisions from what every worker holds.

The messages (`Holding`, `RestorePlan`, ...) are in `protocol`. Every worker answers
`worker.holding` with a `Holding`: how far it got (`Progress`, None for a new
worker) and, with a sharded strategy, the in-memory snapshots it holds parts of. One rule picks
the state to go on from, whatever the strategy (`newest_held_step`): **the newest step every part
of which some live worker holds**, the lowest rank holding a part being its holder. Only what a
worker offers differs:

- `plan_from_peers` (every worker holds the whole state: ``ddp``, ``none``): a worker whose state
  is clean (a worker torn between two optimizer steps never is) holds the one part of its step.
  The rule's holder is the source; every worker without a runner, behind or ahead of the source
  or torn receives the source's state. What differs from rank to rank (the generators, the
  per-rank state: a rank's *slot*) is each survivor's own, and a replacement gets the lost rank's
  from the ring peer that holds a replica of it (`worker.rank_replicas`). The survivors may stand
  a window apart (a collective that ends on some ranks before a peer's loss fails it on the
  others: those ranks stepped, the others went back): when only the older window start has every
  rank's slot, the group goes back to it, redoing a window rather than going on inexactly.
- `plan_from_snapshots` (each worker holds its part and a peer's copy: ``fsdp``): a worker holds
  the parts of each snapshot it keeps; every worker is rebuilt from the snapshot the rule picks.

When neither finds a state (`RestorePlan.found` is False), the trainer falls back on a copy or a
checkpoint (`RestorePlan.fallback`). `reached` is the one rule for how far the group had got, from
which the steps redone are counted.

Every worker goes back to the start of the accumulation window it was in before it answers
(`OperatorRunner.progress`), so the step a plan goes on from is a window start, and the steps
redone are the window's batches finished before the failure plus the one in flight. A plan is
*exact* when the group goes on as it would have without the failure: at the same size, every rank
taking a lost rank's place gets that rank's slot as of the step gone on from. `RestorePlan.inexact`
names the ranks for which that was not possible, and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from raysgd._internal.protocol import (
    Holding,
    RestorePlan,
    SlotMove,
    SnapshotPlan,
)
from raysgd_operator import AverageMeterCollection, Progress

__all__ = [
    "RestoreOutcome",
    "StateLostError",
    "last_finished",
    "missing_parts",
    "newest_held_step",
    "plan_from_peers",
    "plan_from_snapshots",
    "reached",
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
            inexact=inexact + _interleaved(progress),
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
        copy[0]: rank
        for rank, held in enumerate(holdings)
        for copy in held.peer_slots
        if copy[1:] == (trained_in, step)
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
            missing.append(
                f"the generators and per-rank state of rank {old_rank} at step {step} were lost "
                "with it (no peer held them)"
            )
    return tuple(moves), tuple(missing)


def _interleaved(progress: Sequence[Optional[Progress]]) -> tuple[str, ...]:
    if any(p is not None and p.interleaved for p in progress):
        return (
            "a validation ran inside the interrupted accumulation window: redoing the window "
            "after it draws its random numbers in another order",
        )
    return ()


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
