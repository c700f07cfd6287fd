"""The worker losses the run controller has seen: counted, each one an event of the recovery log,
named together when the loop gives up.

A loss is counted per call (what the failure policy is told, what the give-up error lists) and over
the trainer's life (`TorchTrainer.failures`). A worker lost while the group is being repaired after
a user error is logged but not counted: that repair is housekeeping, not a loss of the user's run.
A loss is a preemption when Ray says the node was reclaimed after a drain, or when the node is one
the workers are being moved off (`draining`).

The run controller calls the ledger with each of its transitions (`account`), before any observer
sees it: a loss is counted when a transition carries one, the count starts afresh when one says so,
and the draining nodes are those of the MOVING phase. It gives up for the controller (`give_up`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NoReturn, Optional

from raysgd._internal.driver.events import (
    EventKind,
    FailureRecord,
    RecoveryLog,
    give_up_message,
    short_error,
    where_lost,
)
from raysgd._internal.driver.phases import Phase, Transition

if TYPE_CHECKING:
    from raysgd._internal.driver.group_view import ClusterView

__all__ = ["Losses"]

logger = logging.getLogger("raysgd.recovery")


class Losses:
    """The loss ledger of one `RunController` (see the module docstring).

    Args:
        log: Where each loss is recorded.
        cluster: Asked which nodes Ray reports reclaimed after a drain.
    """

    def __init__(self, log: RecoveryLog, cluster: ClusterView) -> None:
        self._log = log
        self._cluster = cluster
        #: Losses over the trainer's lifetime.
        self.total = 0
        #: This call's losses, oldest first.
        self.this_call: list[FailureRecord] = []
        #: The nodes being moved off (the MOVING phase's): a loss there is a preemption.
        self.draining: frozenset[str] = frozenset()
        self._last_at: Optional[float] = None
        self._last_error: Optional[BaseException] = None  # chained to the give-up RuntimeError

    def account(self, t: Transition) -> None:
        """Account for one transition of the run (see the module docstring)."""
        if t.new_count:
            self.this_call, self._last_error = [], None
        if t.after is Phase.MOVING:
            self.draining = t.nodes
        elif t.before is Phase.MOVING:
            self.draining = frozenset()
        if t.lost is not None:
            record = self._record(t.lost, t)
            if t.counted:
                self.this_call.append(record)
        if t.recovered_s is not None:
            self._recovered(t.recovered_s, t.size)

    def preempted(self, err: BaseException) -> bool:
        """Whether the loss `err` names was a preemption: Ray marked the workers' node reclaimed
        after a preemption drain, or the node is one the workers are being moved off (Ray's
        word that arrives only after the call is applied by `recovered`)."""
        _, nodes = where_lost(err)
        return bool(getattr(err, "preempted", None)) or bool(self.draining & set(nodes))

    def _recovered(self, took: float, size: int) -> None:
        """The call whose losses these are was redone, `took` seconds after the first was seen.
        Its losses whose node Ray now reports reclaimed after a preemption drain are marked so:
        Ray records why a node died a moment after its workers are seen gone, and waiting for it
        must not delay the recovery."""
        self._log.record(
            EventKind.RECOVERED,
            f"recovered: the interrupted work was redone on {size} worker(s); "
            f"{took:.2f} s from detecting the failure to the end of the redone call",
            duration_s=took,
            num_workers_after=size,
        )
        preempted = self._cluster.preempted({n for record in self.this_call for n in record.nodes})
        if preempted:
            self._log.mark_preempted(preempted)

    def seconds_since_last(self) -> Optional[float]:
        """Seconds since the last counted loss (None before the first): what the policies are
        told."""
        return None if self._last_at is None else time.monotonic() - self._last_at

    def last_error(self) -> str:
        """The text of this call's last loss ("" when it had none)."""
        return self.this_call[-1].error if self.this_call else ""

    def give_up(self, reason: str, max_retries: int) -> NoReturn:
        """Raise the `RuntimeError` that ends the call: `reason` and every loss of the call."""
        message = give_up_message(self.this_call, reason, max_retries=max_retries)
        logger.error("%s", message)
        # The last loss is the cause: its full text (a worker traceback, say) stays reachable.
        raise RuntimeError(message) from self._last_error

    def _record(self, err: BaseException, t: Transition) -> FailureRecord:
        """Log the loss `err` of transition `t` (and count it, when `t` says so)."""
        ranks, nodes = where_lost(err)
        record = FailureRecord(
            tuple(ranks), tuple(nodes), short_error(err), t.during_restart, self.preempted(err)
        )
        if t.counted:
            self.total += 1
            self._last_at = time.monotonic()
            self._last_error = err
            number = (
                f"worker failure {len(self.this_call) + 1} of this call ({self.total} in total)"
            )
        else:
            number = "worker lost while repairing (not counted)"
        survive = "" if t.alive is None else f"; {t.alive} worker(s) survive"
        self._log.record(
            EventKind.RESTART_FAILED if t.during_restart else EventKind.FAILURE,
            f"{number}: {record.describe()}{survive}",
            level=logging.WARNING,
            ranks=record.ranks,
            nodes=record.nodes,
            error=record.error,
            num_workers_before=t.size,
            num_workers_after=t.alive,
            preempted=record.preempted,
        )
        return record
