"""One resize of the trainer's group, as the run controller does it: what it did (`ResizeResult`)
and how long it may take.

A resize is one transaction: workers leaving on purpose hand their state over and go, the group
keeps its healthy workers and starts the rest (`WorkerGroup.recover`), and the training state is
restored on the new group. Only the run controller resizes; its events are derived from the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raysgd._internal.state.plan import RestoreOutcome
from raysgd_core import RecoveryReport, WorkerDiedError

__all__ = [
    "DEFAULT_RESTART_TIMEOUT_S",
    "SPARE_WAIT_S",
    "ResizeResult",
    "found_lost_error",
]

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
