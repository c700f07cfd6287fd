"""Failure policies: pure functions from a `FailureStatus` to a `Decision`.

The trainer owns every side effect (killing, starting, sleeping, logging at INFO); a policy only
decides. That keeps the policies testable without Ray and lets users swap them by name or instance.
Each failure policy names the scaling policy (`scaling.py`) that sizes the group beside it when no
worker was lost, so that one choice (`failure_policy="elastic"`, say) configures both.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Literal, Union

from raysgd_base import check_int, check_number
from raysgd_fault.decision import Action, Decision, FailureStatus
from raysgd_fault.scaling import FixedSize, GrowWhenRoom, ScalingPolicy

__all__ = [
    "AUTO_BACKGROUND_SHARE",
    "DefaultPolicy",
    "ElasticPolicy",
    "FailurePolicy",
    "NeverRetryPolicy",
]

logger = logging.getLogger(__name__)

#: With ``replace_in_background="auto"`` the survivors go on at once when they are at least this
#: share of the workers wanted: each one's part of the global batch (and of a sharded state)
#: then grows by a third at most until its replacement joins.
AUTO_BACKGROUND_SHARE = 0.75


class FailurePolicy(abc.ABC):
    """Decides what the trainer does after losing workers.

    Subclasses implement `decide`; it must not block, sleep or touch Ray: the trainer performs the
    decision (RETRY: resize to `num_workers`; WAIT: sleep `wait_s` then ask again with
    `attempt + 1`; GIVE_UP: raise `RuntimeError(reason)`). The policy alone owns the retry budget:
    the trainer enforces no limit of its own, so a policy must eventually answer GIVE_UP (after
    `max_retries` losses, after some fruitless `attempt`s) or training retries for ever.
    """

    #: Registry name, shown in logs.
    name: str = "custom"

    @abc.abstractmethod
    def decide(self, status: FailureStatus) -> Decision:
        """Return the decision for `status`; `Decision.reason` says why."""

    @property
    def scaling(self) -> ScalingPolicy:
        """The scaling policy beside this one: growing back at the start of `train()` and
        replacing workers that leave a draining node. `GrowWhenRoom()` unless overridden."""
        return GrowWhenRoom()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _last_error(status: FailureStatus) -> str:
    return f"; last error: {status.error}" if status.error else ""


def _check_status(status: object) -> FailureStatus:
    if not isinstance(status, FailureStatus):
        raise TypeError(f"status must be a FailureStatus, got {type(status).__name__}")
    return status


class DefaultPolicy(FailurePolicy):
    """RaySGD's behaviour: retry with as many workers as fit, back off while none does.

    After a loss: give up once `failures > max_retries`; otherwise ask for
    ``min(workers_wanted, workers_alive + workers_fitting)`` workers (at least one). When not even
    one fits, wait ``base_wait_s * 2**attempt`` seconds (capped at `max_wait_s`) and give up after
    `max_attempts` fruitless attempts. Its scaling policy grows back to as many as fit
    (`GrowWhenRoom`), not within `grow_cooldown_s` of a failure.

    With `replace_in_background`, the survivors (when there are at least the minimum) go on at
    once at their smaller size while the replacements start beside them; each replacement joins
    at a step boundary once it is up. A replacement's process start (seconds: Ray's worker, the
    torch import) then costs the loop nothing. The global batch stays the same, so each survivor
    computes a larger share of it until the group is whole again: more time per step and more
    memory per worker. ``"auto"`` (the default) does so when the survivors are at least
    `AUTO_BACKGROUND_SHARE` of the workers wanted (one lost of four or more), where a survivor's
    share grows by a third at most; with fewer, the survivors wait for their replacements.

    Args:
        max_attempts: Consecutive restart attempts that start no worker before giving up.
        base_wait_s: First backoff wait (attempt 0).
        max_wait_s: Upper bound of a single wait.
        grow_cooldown_s: Do not grow within this many seconds of the last failure (0: always try).
        replace_in_background: Train on with the survivors while their replacements start:
            True, False or "auto".
    """

    name = "default"

    def __init__(
        self,
        *,
        max_attempts: int = 10,
        base_wait_s: float = 1.0,
        max_wait_s: float = 60.0,
        grow_cooldown_s: float = 0.0,
        replace_in_background: Union[bool, Literal["auto"]] = "auto",
    ) -> None:
        check_int("max_attempts", max_attempts)
        if not isinstance(replace_in_background, bool) and replace_in_background != "auto":
            raise TypeError(
                'replace_in_background must be True, False or "auto", got '
                f"{replace_in_background!r}"
            )
        for arg, value in (
            ("base_wait_s", base_wait_s),
            ("max_wait_s", max_wait_s),
            ("grow_cooldown_s", grow_cooldown_s),
        ):
            check_number(arg, value)
        self.max_attempts = max_attempts
        self.base_wait_s = float(base_wait_s)
        self.max_wait_s = float(max_wait_s)
        self.grow_cooldown_s = float(grow_cooldown_s)
        self.replace_in_background = replace_in_background

    def min_workers(self, status: FailureStatus) -> int:
        """The smallest group worth running; the default runs on a single survivor."""
        return 1

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt + 1`: ``base * 2**attempt``, capped."""
        if attempt >= 64:  # 2**64 s is far past any cap; avoid float overflow for silly inputs
            return self.max_wait_s
        return min(self.max_wait_s, self.base_wait_s * 2.0**attempt)

    def decide(self, status: FailureStatus) -> Decision:
        """See the class docstring."""
        status = _check_status(status)
        decision = self._recover(status)
        logger.debug("%s policy: %s -> %s", self.name, status, decision)
        return decision

    @property
    def scaling(self) -> ScalingPolicy:
        """`GrowWhenRoom` from one worker, with this policy's `grow_cooldown_s`."""
        return GrowWhenRoom(min_workers=1, cooldown_s=self.grow_cooldown_s)

    def _recover(self, status: FailureStatus) -> Decision:
        seen = f"{status.failures} failure(s) in this train() call"
        if status.failures > status.max_retries:
            return Decision(
                Action.GIVE_UP,
                reason=f"{seen} exceed max_retries={status.max_retries}{_last_error(status)}",
            )
        return self._start_or_wait(status, seen)

    def _start_or_wait(self, status: FailureStatus, seen: str) -> Decision:
        minimum = min(self.min_workers(status), status.workers_wanted)
        if status.attempt >= self.max_attempts:
            return Decision(
                Action.GIVE_UP,
                reason=(
                    f"could not start at least {minimum} worker(s) in {status.attempt} "
                    f"attempt(s) after {seen}{_last_error(status)}"
                ),
            )
        target = min(status.workers_wanted, status.workers_alive + status.workers_fitting)
        alive = status.workers_alive
        if self._in_background(alive, status.workers_wanted) and minimum <= alive < target:
            return Decision(
                Action.RETRY,
                num_workers=alive,
                background=target - alive,
                reason=(
                    f"{seen} (max_retries={status.max_retries}); {alive} alive go on while "
                    f"{target - alive} replacement(s) of the {status.workers_fitting} fitting start"
                ),
            )
        if target >= minimum:
            return Decision(
                Action.RETRY,
                num_workers=target,
                reason=(
                    f"{seen} (max_retries={status.max_retries}); {status.workers_alive} alive + "
                    f"{status.workers_fitting} fitting: ask for {target} of "
                    f"{status.workers_wanted} worker(s)"
                ),
            )
        wait_s = self.backoff_s(status.attempt)
        return Decision(
            Action.WAIT,
            wait_s=wait_s,
            reason=(
                f"{seen}; only {target} worker(s) available, {minimum} needed: back off "
                f"{wait_s:g} s (attempt {status.attempt + 1} of {self.max_attempts})"
            ),
        )

    def _in_background(self, alive: int, wanted: int) -> bool:
        if self.replace_in_background == "auto":
            return alive >= AUTO_BACKGROUND_SHARE * wanted
        return bool(self.replace_in_background)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_attempts={self.max_attempts}, "
            f"base_wait_s={self.base_wait_s:g}, max_wait_s={self.max_wait_s:g}, "
            f"grow_cooldown_s={self.grow_cooldown_s:g}, "
            f"replace_in_background={self.replace_in_background!r})"
        )


class ElasticPolicy(DefaultPolicy):
    """Like the default, but only (re)starts or grows when at least `min_workers` can be had.

    Below the minimum it backs off (and eventually gives up) instead of limping on with too few
    workers. A `min_workers` above `workers_wanted` is clamped to `workers_wanted`. At or above
    it, the survivors train on while their replacements start (`replace_in_background`, on by
    default here).

    Args:
        min_workers: The smallest group worth training on (>= 1).
        replace_in_background: As for `DefaultPolicy`; True here.
        **kwargs: `max_attempts`, `base_wait_s`, `max_wait_s`, `grow_cooldown_s` as for
            `DefaultPolicy`.
    """

    name = "elastic"

    def __init__(
        self,
        min_workers: int = 1,
        *,
        replace_in_background: Union[bool, Literal["auto"]] = True,
        **kwargs: Any,
    ) -> None:
        check_int("min_workers", min_workers)
        super().__init__(replace_in_background=replace_in_background, **kwargs)
        self._min_workers = min_workers

    def min_workers(self, status: FailureStatus) -> int:
        """The configured minimum."""
        return self._min_workers

    @property
    def scaling(self) -> ScalingPolicy:
        """`GrowWhenRoom` from `min_workers`, with this policy's `grow_cooldown_s`."""
        return GrowWhenRoom(min_workers=self._min_workers, cooldown_s=self.grow_cooldown_s)

    def __repr__(self) -> str:
        return super().__repr__().replace("(", f"(min_workers={self._min_workers}, ", 1)


class NeverRetryPolicy(FailurePolicy):
    """Never recovers: the first loss ends `train()`; the group is never resized (`FixedSize`)."""

    name = "never"

    def decide(self, status: FailureStatus) -> Decision:
        """GIVE_UP."""
        status = _check_status(status)
        decision = Decision(
            Action.GIVE_UP,
            reason=(
                f"retries are disabled by the 'never' policy; {status.failures} failure(s) "
                f"in this train() call{_last_error(status)}"
            ),
        )
        logger.debug("%s policy: %s -> %s", self.name, status, decision)
        return decision

    @property
    def scaling(self) -> ScalingPolicy:
        """`FixedSize`: the 'never' policy does not resize."""
        return FixedSize()
