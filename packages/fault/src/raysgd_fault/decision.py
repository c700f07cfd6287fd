"""What a failure policy is told (`FailureStatus`) and what it answers (`Decision`).

Both are frozen value objects so that a decision can be logged, compared in tests and replayed: a
policy is a pure function from one to the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from raysgd_base import check_int, check_number

__all__ = ["Action", "Decision", "FailureStatus", "check_max_retries", "describe"]


def check_max_retries(max_retries: object) -> int:
    """Validate a `max_retries` (an int >= 0) and return it; the one rule the trainer checks its
    `train(max_retries=...)` argument with before any work, and `FailureStatus` with later."""
    return check_int("max_retries", max_retries, minimum=0)


@dataclass(frozen=True)
class FailureStatus:
    """Everything a policy may look at when deciding what to do after a loss.

    Attributes:
        failures: Worker losses so far in the current `train()` call.
        max_retries: The `max_retries` the user passed to `train()`.
        workers_wanted: The `num_workers` the trainer was asked for (>= 1).
        workers_alive: Workers that survived and are still usable (<= `workers_wanted`).
        workers_fitting: Estimate of how many more workers could start right now.
        attempt: Consecutive restart attempts that produced no worker (0 on the first try).
        total_failures: Worker losses over the trainer's lifetime; defaults to `failures`.
        seconds_since_last_failure: Time since the last loss, or None if there was none.
        error: Short text of the last failure (shown in reasons and give-up errors).
    """

    failures: int
    max_retries: int
    workers_wanted: int
    workers_alive: int = 0
    workers_fitting: int = 0
    attempt: int = 0
    total_failures: Optional[int] = None
    seconds_since_last_failure: Optional[float] = None
    error: str = ""

    def __post_init__(self) -> None:
        check_max_retries(self.max_retries)
        for name in ("failures", "workers_alive", "workers_fitting", "attempt"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("workers_wanted", self.workers_wanted, minimum=1)
        if self.workers_alive > self.workers_wanted:
            raise ValueError(
                f"workers_alive ({self.workers_alive}) cannot exceed "
                f"workers_wanted ({self.workers_wanted})"
            )
        if self.total_failures is None:
            # Frozen dataclass: the only way to fill a derived default is object.__setattr__.
            object.__setattr__(self, "total_failures", self.failures)
        else:
            check_int("total_failures", self.total_failures, minimum=0)
            if self.total_failures < self.failures:
                raise ValueError(
                    f"total_failures ({self.total_failures}) cannot be less than "
                    f"failures ({self.failures})"
                )
        if self.seconds_since_last_failure is not None:
            check_number("seconds_since_last_failure", self.seconds_since_last_failure)
        if not isinstance(self.error, str):
            raise TypeError(f"error must be a str, got {type(self.error).__name__}")


class Action(str, enum.Enum):
    """What the trainer should do next."""

    #: (Re)start or resize the worker group to `Decision.num_workers` workers.
    RETRY = "retry"
    #: Sleep `Decision.wait_s` seconds, then ask the policy again with `attempt + 1`.
    WAIT = "wait"
    #: Stop and raise `RuntimeError(decision.reason)`.
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Decision:
    """A policy's answer, with the reason the trainer logs (and raises on GIVE_UP).

    Attributes:
        action: RETRY, WAIT or GIVE_UP.
        num_workers: For RETRY, the group size to ask for (>= 1); 0 for WAIT and GIVE_UP.
        wait_s: For WAIT, seconds to sleep before asking again; 0 otherwise.
        reason: Human-readable why; never empty.
        background: For RETRY, more workers to start beside the group while it trains on at
            `num_workers`; each joins at a step boundary once it is up. 0 otherwise.
    """

    action: Action
    num_workers: int = 0
    wait_s: float = 0.0
    reason: str = ""
    background: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise TypeError(f"action must be an Action, got {self.action!r}")
        # A RETRY (re)starts the group, which needs a worker; WAIT and GIVE_UP carry 0.
        check_int("num_workers", self.num_workers, minimum=1 if self.action is Action.RETRY else 0)
        check_number("wait_s", self.wait_s)
        check_int("background", self.background, minimum=0)
        if self.background and self.action is not Action.RETRY:
            raise ValueError("background workers go with a RETRY decision only")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("reason must be a non-empty str: every decision is logged")

    def __str__(self) -> str:
        return describe(self)


def describe(decision: Decision) -> str:
    """One log line for `decision`, e.g. ``"RETRY with 2 worker(s): ..."``."""
    if decision.action is Action.RETRY:
        head = f"RETRY with {decision.num_workers} worker(s)"
        if decision.background:
            head += f", {decision.background} more starting in the background"
    elif decision.action is Action.WAIT:
        head = f"WAIT {decision.wait_s:g} s"
    else:
        head = "GIVE_UP"
    return f"{head}: {decision.reason}"
