"""The run controller's decisions, pure: what the policies are told, what their answers mean, and
what the workers watch. Nothing here touches the group, Ray or a clock; the controller executes.

The failure policy (`raysgd_fault.FailurePolicy`) answers a loss: retry at a size (some of it
replacements started beside the group: `background`), wait, or give up. The scaling policy
(`raysgd_fault.ScalingPolicy`) sizes the group when nothing was lost: at the start of a call, when
spares are up inside one, and when workers move off a draining node. Both are the user's to
replace, so their answers are checked here and clamped to what the run can do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from raysgd._internal.protocol import JOIN_WATCH_INTERVAL_S, WATCH_INTERVAL_S, WatchSpec
from raysgd_fault import (
    Decision,
    FailurePolicy,
    FailureStatus,
    ScalingDecision,
    ScalingPolicy,
    ScalingStatus,
)

__all__ = [
    "GROW_BACKOFF_S",
    "MAX_GROW_BACKOFF_S",
    "count_fruitless",
    "decide_failure",
    "decide_size",
    "fitting",
    "grow_backoff",
    "move_timeout",
    "split_background",
    "watch_spec",
]


def decide_failure(policy: FailurePolicy, status: FailureStatus) -> Decision:
    """The failure policy's answer to `status` (a TypeError when it answers something else)."""
    decision = policy.decide(status)
    if not isinstance(decision, Decision):
        raise TypeError(
            f"{type(policy).__name__}.decide must return a Decision, got {type(decision).__name__}"
        )
    return decision


def decide_size(
    scaling: ScalingPolicy, status: ScalingStatus
) -> tuple[ScalingDecision, ScalingDecision]:
    """The scaling policy's answer to `status` as it gave it, and as it is done: its size clamped
    between the workers running (a sizing never stops healthy workers) and the workers wanted."""
    decision = scaling.decide(status)
    if not isinstance(decision, ScalingDecision):
        raise TypeError(
            f"{type(scaling).__name__}.decide must return a ScalingDecision, "
            f"got {type(decision).__name__}"
        )
    size = max(status.workers_running, min(status.workers_wanted, decision.num_workers))
    return decision, dataclasses.replace(decision, num_workers=size)


def split_background(
    decision: Decision, *, spares_up: int, spares_starting: int
) -> tuple[int, int]:
    """How many workers to re-form the group with now, and how many replacements to start
    beside it, for a RETRY `decision`. Spares that are up join now (they cost no start); spares
    still starting count as replacements already on their way."""
    if not decision.background:
        return decision.num_workers, 0
    up = min(decision.background, spares_up)
    later = decision.background - up - spares_starting
    return decision.num_workers + up, max(0, later)


def watch_spec(nodes: frozenset[str], joining: Sequence[tuple[Any, ...]]) -> Optional[WatchSpec]:
    """What the workers watch during an attempt: `nodes` for drains, and the readiness of the
    spares that may join a group below its size (looked at more often: the group trains slower
    meanwhile). None when there is nothing to watch."""
    if not nodes and not joining:
        return None
    interval_s = JOIN_WATCH_INTERVAL_S if joining else WATCH_INTERVAL_S
    return WatchSpec(nodes, interval_s, tuple(joining))


def move_timeout(deadline: Optional[float], default_s: float, now: float) -> float:
    """How long a resize of a move off draining nodes may take: up to the earliest `deadline`
    (a `time.time()` timestamp, None for none) less a margin, at most `default_s`."""
    if deadline is None:
        return default_s
    return max(1.0, min(default_s, deadline - now - 2.0))


#: After a grow that started no new worker, skip growing for this long, doubling up to the maximum.
GROW_BACKOFF_S = 30.0
MAX_GROW_BACKOFF_S = 600.0


def grow_backoff(previous_s: float) -> float:
    """How long to skip growing after a grow that started no new worker (the room the cluster
    reported was not real), `previous_s` the backoff before it (0 after a grow that worked):
    doubling from `GROW_BACKOFF_S` up to `MAX_GROW_BACKOFF_S`, so that a lasting shortage does
    not slow down every `train()`."""
    return min(MAX_GROW_BACKOFF_S, max(GROW_BACKOFF_S, 2 * previous_s))


def fitting(estimate: Optional[int], wanted: int) -> int:
    """The room the policies are told of: the group's estimate, or, when it could not make one
    (None), the workers `wanted`: an estimate must never stop a recovery, and the starts decide."""
    return wanted if estimate is None else max(0, estimate)


def count_fruitless(fruitless: int, *, started: bool, lost: bool) -> int:
    """Restarts that came to nothing since the last loss, after one more try: a wait for room
    (`started` False, `lost` False) or a restart that started nobody and lost nobody (room is
    still missing) counts; a restart that started workers or lost one does not (the loss is
    counted as one)."""
    return fruitless if started or lost else fruitless + 1
