"""Resizing the trainer's group (`Resizer`), what one resize did (`ResizeResult`) and how long it
may take.

A resize is one transaction: workers leaving on purpose hand their state over and go, the group
keeps its healthy workers and starts the rest (`WorkerGroup.recover`), and the training state is
restored on the new group. The controller's `Resizer` is the only code that resizes (after a
loss, a grow, a move, a repair); its events are derived from the result.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from raysgd._internal.driver.events import RecoveryLog
from raysgd._internal.driver.group_view import ElasticGroup, RestorableState
from raysgd._internal.driver.phases import PhaseWriter
from raysgd._internal.driver.policies import Policies
from raysgd._internal.state.plan import RestoreOutcome, StateLostError
from raysgd_core import RecoveryReport, WorkerDiedError

__all__ = [
    "DEFAULT_RESTART_TIMEOUT_S",
    "SPARE_WAIT_S",
    "ResizeResult",
    "Resizer",
    "found_lost_error",
]

logger = logging.getLogger("raysgd.recovery")

#: Bound on one ``group.recover`` call: how long new workers may take to start (those that do not
#: are dropped and the group goes on smaller). Dead workers are reported long before this.
DEFAULT_RESTART_TIMEOUT_S = 30.0

#: The longest a move off draining nodes waits for spare workers still starting before it sizes
#: the group.
SPARE_WAIT_S = 10.0


@dataclass(frozen=True)
class ResizeResult:
    """What one resize did.

    Attributes:
        reason: Why the group was resized ("failure", "grow", "preemption", a repair).
        num_workers: The size asked for.
        before: The live size before.
        report: The group's `RecoveryReport` (its `steps_redone` filled in), or None when the
            resize failed before the group was re-formed.
        restored: Where the state came from and how many steps are redone.
        lost: The error of a worker lost during the resize, which made it fail (one more
            loss, counted by the resize), or None.
        duration_s: The whole resize.
        formed_s: Until the group was re-formed (the rest is the restore).
    """

    reason: str
    num_workers: int
    before: int
    report: Optional[RecoveryReport]
    restored: Optional[RestoreOutcome]
    lost: Optional[BaseException]
    duration_s: float
    formed_s: float

    @property
    def ok(self) -> bool:
        """The group was re-formed with at least one worker and its state restored."""
        return self.lost is None and self.report is not None and self.report.world_size >= 1

    @property
    def steps_redone(self) -> int:
        """Steps done again because of this resize (0 when it did not restore)."""
        return self.restored.steps_redone if self.restored is not None else 0


def found_lost_error(report: RecoveryReport) -> WorkerDiedError:
    """The loss of the workers a recovery found gone that no call had reported (the second of a
    burst, say), as the error a call would have raised for it."""
    ranks = sorted(report.found_lost)
    return WorkerDiedError(
        f"Workers lost: rank(s) {ranks} were found gone while the group re-formed (lost after "
        "the error that called for the resize); replaced",
        ranks,
        [report.found_lost[r] for r in ranks],
    )


class Resizer:
    """Resizes `group` with its `state`, each resize one transaction recorded in `log`; a worker
    lost on the way is noted in the run's phase (`run.note`). `restart_timeout_s` bounds one
    ``group.recover``; `policies` size a move once its leaving workers are gone."""

    def __init__(
        self,
        *,
        group: ElasticGroup,
        state: RestorableState,
        policies: Policies,
        log: RecoveryLog,
        run: PhaseWriter,
        restart_timeout_s: float,
    ) -> None:
        self._group = group
        self._state = state
        self._policies = policies
        self._log = log
        self._run = run
        self.restart_timeout_s = float(restart_timeout_s)

    def resize(
        self,
        num_workers: Optional[int],
        reason: str,
        *,
        timeout_s: Optional[float] = None,
        leaving: Sequence[int] = (),
        counted: bool = True,
    ) -> ResizeResult:
        """Resize the group to `num_workers`: the state handed over (made restorable without the
        workers of `leaving`) and those workers retired, then `group.recover` (healthy workers
        kept, the rest started, within `timeout_s`), then the state restored on the new group.
        `num_workers` None: as the scaling policy sizes a move, asked once the leaving workers
        are gone (their room then counts).

        A worker lost meanwhile is a loss during the restart, counted here (`counted` False:
        logged only, for a repair after a user error): one the group found gone while it
        re-formed (`RecoveryReport.found_lost`: the resize replaced it and went on), or one whose
        loss made the resize fail (`ResizeResult.lost`).

        Raises:
            StateLostError: no worker, copy or checkpoint holds the state (retrying cannot help).
        """
        before = int(self._group.world_size)
        started = time.monotonic()
        report: Optional[RecoveryReport] = None
        restored: Optional[RestoreOutcome] = None
        lost: Optional[BaseException] = None
        formed = started
        target = num_workers or 0
        try:
            if leaving:
                self._state.hand_over(leaving)
                self._group.retire(leaving)
            if num_workers is None:
                alive = before - len(leaving)
                fitting = self._policies.room(self._group)
                sized = self._policies.size("preemption", running=alive, fitting=fitting)
                target = max(1, sized.num_workers)
            report = self._group.recover(
                target,
                timeout_s=timeout_s if timeout_s is not None else self.restart_timeout_s,
            )
            formed = time.monotonic()
            if report.found_lost:
                self._run.note(
                    lost=found_lost_error(report),
                    during_restart=True,
                    counted=counted,
                    alive=len(report.kept) if counted else None,
                )
            if report.world_size >= 1:
                outcome = self._state.restore(report)
                if isinstance(outcome, RestoreOutcome):
                    restored = outcome
                    report = dataclasses.replace(report, steps_redone=outcome.steps_redone)
        except StateLostError:
            raise
        except Exception as err:  # any error while resizing is one more loss
            logger.debug("resize (%s) failed", reason, exc_info=True)
            lost = err
        done = time.monotonic()
        result = ResizeResult(
            reason, target, before, report, restored, lost, done - started, formed - started
        )
        self._log.record_resize(result)
        if lost is not None:
            self._run.note(lost=lost, during_restart=True, counted=counted)
        return result
