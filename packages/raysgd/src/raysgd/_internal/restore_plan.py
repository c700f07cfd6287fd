"""Who restores whom after a resize (a pure decision from every worker's `Progress`), and what the
restore did.

The source is the worker furthest along among those whose state is clean (a worker torn between
two optimizer steps never is); ties go to the lowest rank. Every worker without a runner (a
replacement), behind the source or torn receives the source's state; the others already hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from raysgd_operator import CallRecord, Progress

__all__ = ["RestoreOutcome", "RestorePlan", "StateLostError", "plan_restore"]


@dataclass(frozen=True)
class RestorePlan:
    """What `plan_restore` decided.

    Attributes:
        source: Rank (in the re-formed group) whose state everyone goes on from; None when no
            worker holds a usable state (then the trainer falls back to a copy or a checkpoint).
        receivers: Ranks that receive the source's state.
        step: The source's finished steps (what training goes on from).
        steps_redone: Steps that were started (by a worker that survived) but are lost: the one
            in flight, plus any a survivor finished beyond the source. 0 when nothing was lost.
        call: The `train()` call the source was in or last finished.
    """

    source: Optional[int]
    receivers: tuple[int, ...]
    step: int
    steps_redone: int
    call: Optional[CallRecord]


def plan_restore(progress: Sequence[Optional[Progress]]) -> RestorePlan:
    """Decide the restore for a group whose rank `r` reported `progress[r]` (None: a new worker)."""
    clean = [(p.step, -rank) for rank, p in enumerate(progress) if p is not None and p.clean]
    if not clean:
        return RestorePlan(None, tuple(range(len(progress))), 0, 0, None)
    step, negative_rank = max(clean)
    source = -negative_rank
    reached = max(
        p.step + (1 if p.in_batch or not p.clean else 0) for p in progress if p is not None
    )
    receivers = tuple(
        rank
        for rank, p in enumerate(progress)
        if rank != source and (p is None or not p.clean or p.step != step)
    )
    return RestorePlan(source, receivers, step, max(0, reached - step), progress[source].call)


class StateLostError(RuntimeError):
    """Every worker that held (part of) the training state was lost, and there is nothing to
    restore it from: no copy on the driver and no checkpoint. Not retried."""


@dataclass(frozen=True)
class RestoreOutcome:
    """What a restore after a resize did (the recovery loop adds it to its resize event).

    Attributes:
        source: Where the state came from, in words ("rank 1 at step 30", "the driver's copy
            at step 12", "checkpoint /path at step 12").
        step: The finished step training goes on from.
        steps_redone: Steps started before the failure that are done again (the one in flight,
            plus those since the restored snapshot or copy).
    """

    source: str
    step: int
    steps_redone: int
