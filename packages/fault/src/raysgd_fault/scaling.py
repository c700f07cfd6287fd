"""Scaling policies: how many workers to run when the group may change size without a failure.

Two moments ask: the start of `train()` while fewer workers run than were asked for ("grow": take
the room that came back?) and a move off a node about to be reclaimed ("preemption": how many
replacements to start beside the workers that stay). A failure policy decides what follows a loss
(retry, wait, give up, within a budget); a scaling policy only sizes, and nothing it answers counts
against a retry budget. Both are pure: the trainer performs the answer and logs its reason.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

from raysgd_base import check_int, check_number

__all__ = [
    "MOMENTS",
    "FixedSize",
    "GrowWhenRoom",
    "ScalingDecision",
    "ScalingPolicy",
    "ScalingStatus",
]

#: "grow": the start of `train()` below the wanted size; "preemption": workers are leaving a
#: draining node and `workers_running` counts those that stay.
MOMENTS = ("grow", "preemption")


@dataclass(frozen=True)
class ScalingStatus:
    """What a scaling policy may look at.

    Attributes:
        moment: One of `MOMENTS`.
        workers_wanted: The `num_workers` the trainer was asked for (>= 1).
        workers_running: Workers that run on after this moment whatever is decided.
        workers_fitting: Estimate of how many more workers could start right now.
        seconds_since_last_failure: Time since the last loss, or None if there was none.
    """

    moment: str
    workers_wanted: int
    workers_running: int
    workers_fitting: int = 0
    seconds_since_last_failure: Optional[float] = None

    def __post_init__(self) -> None:
        if self.moment not in MOMENTS:
            raise ValueError(f"moment must be one of {MOMENTS}, got {self.moment!r}")
        check_int("workers_wanted", self.workers_wanted, minimum=1)
        check_int("workers_running", self.workers_running, minimum=0)
        check_int("workers_fitting", self.workers_fitting, minimum=0)
        if self.workers_running > self.workers_wanted:
            raise ValueError(
                f"workers_running ({self.workers_running}) cannot exceed "
                f"workers_wanted ({self.workers_wanted})"
            )
        if self.seconds_since_last_failure is not None:
            check_number("seconds_since_last_failure", self.seconds_since_last_failure)


@dataclass(frozen=True)
class ScalingDecision:
    """The size to run, with the reason the trainer logs.

    Attributes:
        num_workers: Workers to run; `workers_running` means "leave the group as it is".
        reason: Human-readable why; never empty.
    """

    num_workers: int
    reason: str

    def __post_init__(self) -> None:
        check_int("num_workers", self.num_workers, minimum=0)
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("reason must be a non-empty str: every decision is logged")

    def __str__(self) -> str:
        return f"run {self.num_workers} worker(s): {self.reason}"


class ScalingPolicy(abc.ABC):
    """Sizes the group at the moments of `MOMENTS`; must not block, sleep or touch Ray."""

    #: Shown in logs.
    name: str = "custom"

    @abc.abstractmethod
    def decide(self, status: ScalingStatus) -> ScalingDecision:
        """Return the size for `status`; the answer is clamped to what is wanted and running."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _keep(status: ScalingStatus, why: str) -> ScalingDecision:
    return ScalingDecision(
        status.workers_running,
        f"keep {status.workers_running} of {status.workers_wanted} worker(s): {why}",
    )


class GrowWhenRoom(ScalingPolicy):
    """Run as many workers as fit, up to the wanted number, once that reaches `min_workers`.

    At a "grow" within `cooldown_s` of the last failure the group is kept as it is, so that a
    cluster that keeps losing nodes is not asked for new ones at every call.

    Args:
        min_workers: The smallest group worth growing to (clamped to the wanted number).
        cooldown_s: Seconds after a failure during which a "grow" keeps the group.
    """

    name = "grow"

    def __init__(self, min_workers: int = 1, cooldown_s: float = 0.0) -> None:
        check_int("min_workers", min_workers)
        check_number("cooldown_s", cooldown_s)
        self.min_workers = min_workers
        self.cooldown_s = float(cooldown_s)

    def decide(self, status: ScalingStatus) -> ScalingDecision:
        """See the class docstring."""
        since = status.seconds_since_last_failure
        if status.moment == "grow" and since is not None and since < self.cooldown_s:
            return _keep(
                status, f"last failure {since:.1f} s ago, within the {self.cooldown_s:g} s cooldown"
            )
        target = min(status.workers_wanted, status.workers_running + status.workers_fitting)
        minimum = min(self.min_workers, status.workers_wanted)
        if target > status.workers_running and target >= minimum:
            return ScalingDecision(
                target,
                f"{status.moment}: from {status.workers_running} to {target} of "
                f"{status.workers_wanted} worker(s) ({status.workers_fitting} more fit)",
            )
        return _keep(status, f"{status.workers_fitting} more fit, {minimum} needed")

    def __repr__(self) -> str:
        return f"GrowWhenRoom(min_workers={self.min_workers}, cooldown_s={self.cooldown_s:g})"


class FixedSize(ScalingPolicy):
    """Never resizes on its own: the group runs on with the workers it has."""

    name = "fixed"

    def decide(self, status: ScalingStatus) -> ScalingDecision:
        """Keep the running workers."""
        return _keep(status, "the group is not resized without a failure")
