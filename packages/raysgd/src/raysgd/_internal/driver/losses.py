"""The worker losses the recovery loop has seen: counted, each one an event of the recovery log,
named together when the loop gives up.

A loss is counted per call (what the failure policy is told, what the give-up error lists) and over
the trainer's life (`TorchTrainer.failures`). A worker lost while the group is being repaired after
a user error is logged but not counted: that repair is housekeeping, not a loss of the user's run.
A loss is a preemption when Ray says the node was reclaimed after a drain, or when the node is one
the workers are being moved off (`draining`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NoReturn, Optional

from raysgd._internal.driver.events import (
    EventKind,
    FailureRecord,
    RecoveryLog,
    give_up_message,
    short_error,
    where_lost,
)
from raysgd_core import preempted_nodes

__all__ = ["Losses"]

logger = logging.getLogger("raysgd.recovery")


class Losses:
    """The loss ledger of one `Recovery` (see the module docstring).

    Args:
        log: Where each loss is recorded.
        world_size: The group's size now (each loss's event says it).
    """

    def __init__(self, log: RecoveryLog, world_size: Callable[[], int]) -> None:
        self._log = log
        self._world_size = world_size
        #: Losses over the trainer's lifetime.
        self.total = 0
        #: This call's losses, oldest first.
        self.this_call: list[FailureRecord] = []
        #: The nodes being moved off (set by a preemption move): a loss there is a preemption.
        self.draining: frozenset[str] = frozenset()
        self._last_at: Optional[float] = None
        self._last_error: Optional[BaseException] = None  # chained to the give-up RuntimeError

    def new_call(self) -> None:
        """A call starts: its losses are counted afresh."""
        self.this_call, self._last_error = [], None

    def count(
        self, err: BaseException, *, during_restart: bool, alive: Optional[int] = None
    ) -> None:
        """Count and log the loss `err` names (a `WorkerDiedError`, or any error of a resize),
        with `alive` workers left when known."""
        record = self._record(err, during_restart=during_restart, alive=alive, counted=True)
        self.this_call.append(record)

    def note(self, err: BaseException) -> None:
        """Log, without counting, a worker lost while repairing after a user error."""
        self._record(err, during_restart=True, alive=None, counted=False)

    def preempted(self, err: BaseException) -> bool:
        """Whether the loss `err` names was a preemption: Ray marked the workers' node reclaimed
        after a preemption drain, or the node is one the workers are being moved off (Ray's
        word that arrives only after the call is applied by `recovered`)."""
        _, nodes = where_lost(err)
        return bool(getattr(err, "preempted", None)) or bool(self.draining & set(nodes))

    def recovered(self, took: float) -> None:
        """The call whose losses these are was redone, `took` seconds after the first was seen.
        Its losses whose node Ray now reports reclaimed after a preemption drain are marked so:
        Ray records why a node died a moment after its workers are seen gone, and waiting for it
        must not delay the recovery."""
        self._log.record(
            EventKind.RECOVERED,
            f"recovered: the interrupted work was redone on {self._world_size()} worker(s); "
            f"{took:.2f} s from detecting the failure to the end of the redone call",
            duration_s=took,
            num_workers_after=self._world_size(),
        )
        preempted = preempted_nodes({n for record in self.this_call for n in record.nodes})
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

    def _record(
        self, err: BaseException, *, during_restart: bool, alive: Optional[int], counted: bool
    ) -> FailureRecord:
        ranks, nodes = where_lost(err)
        record = FailureRecord(
            tuple(ranks), tuple(nodes), short_error(err), during_restart, self.preempted(err)
        )
        if counted:
            self.total += 1
            self._last_at = time.monotonic()
            self._last_error = err
            number = (
                f"worker failure {len(self.this_call) + 1} of this call ({self.total} in total)"
            )
        else:
            number = "worker lost while repairing (not counted)"
        survive = "" if alive is None else f"; {alive} worker(s) survive"
        self._log.record(
            EventKind.RESTART_FAILED if during_restart else EventKind.FAILURE,
            f"{number}: {record.describe()}{survive}",
            level=logging.WARNING,
            ranks=record.ranks,
            nodes=record.nodes,
            error=record.error,
            num_workers_before=self._world_size(),
            num_workers_after=alive,
            preempted=record.preempted,
        )
        return record
