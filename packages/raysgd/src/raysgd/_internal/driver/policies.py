"""The failure and scaling policies as the run asks them: each question built from what the run
knows (the size wanted, the workers alive and fitting, the losses so far), each answer recorded as
a decision event with the question beside it. What an answer means is `decide`'s (pure); when to
ask is the controller's, its growth's and its moves'."""

from __future__ import annotations

from raysgd._internal.driver.decide import decide_failure, decide_size, fitting
from raysgd._internal.driver.events import EventKind, RecoveryLog
from raysgd._internal.driver.group_view import ElasticGroup, fitting_now
from raysgd._internal.driver.losses import Losses
from raysgd_fault import (
    Action,
    Decision,
    FailurePolicy,
    FailureStatus,
    ScalingDecision,
    ScalingPolicy,
    ScalingStatus,
)

__all__ = ["Policies"]


class Policies:
    """The run's two policies (`failure`, `scaling`: either may be replaced between calls), for a
    group wanted at `num_workers`; `losses` counts what they are told of, `log` records their
    answers."""

    def __init__(
        self,
        failure: FailurePolicy,
        scaling: ScalingPolicy,
        *,
        num_workers: int,
        losses: Losses,
        log: RecoveryLog,
    ) -> None:
        self.failure = failure
        self.scaling = scaling
        self.num_workers = int(num_workers)
        self._losses = losses
        self._log = log

    def room(self, group: ElasticGroup) -> int:
        """The workers the cluster has room for beside `group`, as the policies are told it."""
        return fitting(fitting_now(group), self.num_workers)

    def size(self, moment: str, *, running: int, fitting: int) -> ScalingDecision:
        """The scaling policy's size for the group at `moment` ("grow", "preemption")."""
        wanted = self.num_workers
        status = ScalingStatus(
            moment=moment,
            workers_wanted=wanted,
            workers_running=max(0, min(running, wanted)),
            workers_fitting=max(0, fitting),
            seconds_since_last_failure=self._losses.seconds_since_last(),
        )
        answer, decision = decide_size(self.scaling, status)
        self._log.record(
            EventKind.DECISION,
            f"scaling {self.scaling.name!r} ({moment}: wanted {wanted}, running "
            f"{status.workers_running}, fitting {status.workers_fitting}) -> {answer}",
            action=Action.RETRY.value,
            num_workers_before=status.workers_running,
            num_workers_after=decision.num_workers,
        )
        return decision

    def after_losses(
        self, max_retries: int, *, alive: int, fitting: int, attempt: int = 0
    ) -> Decision:
        """The failure policy's answer to this call's losses so far (`attempt`: restarts that
        came to nothing since the last loss)."""
        wanted = self.num_workers
        status = FailureStatus(
            failures=len(self._losses.this_call),
            max_retries=max_retries,
            workers_wanted=wanted,
            workers_alive=max(0, min(alive, wanted)),
            workers_fitting=max(0, fitting),
            attempt=attempt,
            total_failures=self._losses.total,
            seconds_since_last_failure=self._losses.seconds_since_last(),
            error=self._losses.last_error(),
        )
        decision = decide_failure(self.failure, status)
        name = getattr(self.failure, "name", type(self.failure).__name__)
        self._log.record(
            EventKind.DECISION,
            f"policy {name!r} (wanted {wanted}, alive {status.workers_alive}, fitting "
            f"{status.workers_fitting}, failures {status.failures}, attempt {attempt}) -> "
            f"{decision}",
            action=decision.action.value,
            num_workers_before=status.workers_alive,
            num_workers_after=decision.num_workers or None,
            duration_s=decision.wait_s,
        )
        return decision
