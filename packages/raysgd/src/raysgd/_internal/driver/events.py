"""What the run controller saw and did: structured events, their log lines, the give-up message.

Every failure, decision and resize becomes one `RecoveryEvent` (kept on the trainer for tests, the
fault demo and post-mortems) and one line on the ``raysgd.recovery`` logger. The events are the single
source for both, so the log and the structured record never disagree.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from raysgd_core import WorkerDiedError, WorkerError

if TYPE_CHECKING:
    from raysgd._internal.driver.resize import ResizeResult
    from raysgd_core import RecoveryReport

__all__ = [
    "Amender",
    "EventKind",
    "FailureRecord",
    "Observer",
    "RecoveryEvent",
    "RecoveryLog",
    "describe_report",
    "give_up_message",
    "short_error",
    "short_node",
    "where_lost",
]

logger = logging.getLogger("raysgd.recovery")


class EventKind:
    """The `RecoveryEvent.kind` values (plain strings, so events print and compare simply)."""

    #: Workers were lost while training (`WorkerDiedError` from a train call).
    FAILURE = "failure"
    #: A restart (re-forming the group, starting workers, restoring state) went wrong.
    RESTART_FAILED = "restart_failed"
    #: The failure policy answered; `action` holds RETRY / WAIT / GIVE_UP.
    DECISION = "decision"
    #: The group changed: `num_workers_before` -> `num_workers_after`, via `path`.
    RESIZE = "resize"
    #: User code raised inside a worker; never retried.
    USER_ERROR = "user_error"
    #: The interrupted work was redone successfully after a recovery.
    RECOVERED = "recovered"
    #: Workers moved off a node Ray is draining (a preemption notice), or could not be: planned,
    #: not a failure.
    PREEMPTION = "preemption"


@dataclass(frozen=True)
class FailureRecord:
    """One loss the give-up error names: which ranks on which nodes, and the error text."""

    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    error: str
    during_restart: bool = False
    #: The node was reclaimed after a preemption drain (a preemption that came too soon to move).
    preempted: bool = False

    def describe(self) -> str:
        """E.g. ``"rank(s) [1] on node(s) [ab12cd34] lost: ..."``."""
        where = "restart" if self.during_restart else "training"
        ranks = list(self.ranks) if self.ranks else "?"
        nodes = [short_node(n) for n in self.nodes] if self.nodes else "?"
        cause = " (preempted)" if self.preempted else ""
        return f"rank(s) {ranks} on node(s) {nodes} lost during {where}{cause}: {self.error}"


@dataclass(frozen=True)
class RecoveryEvent:
    """One entry of `TorchTrainer.recovery_events`.

    Attributes:
        kind: One of the `EventKind` values.
        message: The log line written for this event.
        timestamp: Wall-clock time (``time.time()``) when the event was recorded.
        duration_s: How long the step took (a resize, a wait); 0 when not meaningful.
        num_workers_before: Group size before the event, when known.
        num_workers_after: Group size after the event, when known.
        ranks: Ranks involved (lost ranks for a failure, the raising rank for a user error).
        nodes: Node ids involved.
        path: For a resize, "keep-healthy" or "full-restart" as reported by the worker group.
        action: For a decision, the policy's action ("retry", "wait", "give_up").
        error: Error text for failures and user errors.
        phases: For a resize, seconds per phase: the worker group's (`RecoveryReport.timings`:
            "ping_s", "leave_s", "start_s", "form_s") and "restore_s" (runners re-bound or built
            and the state restored).
        source: For a resize, where the state came from ("rank 1 at step 30", "the driver's
            copy at step 12", a checkpoint).
        preempted: For a failure, the lost workers' node was reclaimed after a preemption drain
            (Ray says so): a preemption that came before the workers could move.
        steps_redone: For a resize, how many training steps that had been started are done
            again: those of the accumulation window the group was in (its finished batches, and
            the one in flight when the worker was lost; without accumulation the one in flight
            alone, 0 when it was lost between steps), plus those since the snapshot or copy the
            state came from. When no worker survived to say how far it got, a lower bound (the
            steps the driver knows of).
        inexact: For a resize, why the run does not go on exactly as it would have without the
            loss (empty when it does: at the same size, bit for bit).
        report: For a resize, the worker group's `RecoveryReport`, with its `steps_redone`
            filled in.
        state_at: For a resize, when the workers it restored from last finished a step
            (`time.time()`): a failure recorded before it was detected that long after the
            group's last progress.
    """

    kind: str
    message: str
    timestamp: float
    duration_s: float = 0.0
    num_workers_before: Optional[int] = None
    num_workers_after: Optional[int] = None
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    path: Optional[str] = None
    action: Optional[str] = None
    source: Optional[str] = None
    steps_redone: Optional[int] = None
    inexact: tuple[str, ...] = ()
    preempted: bool = False
    error: Optional[str] = None
    phases: dict[str, float] = field(default_factory=dict)
    report: Optional[RecoveryReport] = None
    state_at: Optional[float] = None


#: Called with each event as it is recorded (`RecoveryLog.subscribe`).
Observer = Callable[[RecoveryEvent], None]
#: Called with an event recorded earlier and the form it was amended to (a loss found to be a
#: preemption once Ray said so).
Amender = Callable[[RecoveryEvent, RecoveryEvent], None]


class RecoveryLog:
    """The list of `RecoveryEvent`s, which also writes each one to the logger and hands it to its
    observers (the trainer's goodput meter and experiment loggers), which subscribe instead of
    being called by the loop. Events are only appended, with one exception: a loss learns
    afterwards that it was a preemption (`mark_preempted`), and the observers that asked are told."""

    def __init__(self) -> None:
        self.events: list[RecoveryEvent] = []
        self._observers: list[Observer] = []
        self._amenders: list[Amender] = []

    def subscribe(self, observer: Observer, *, amended: Optional[Amender] = None) -> None:
        """Call `observer` with every event recorded from now on, and `amended` (when given) with
        every event amended later."""
        self._observers.append(observer)
        if amended is not None:
            self._amenders.append(amended)

    def record(
        self,
        kind: str,
        message: str,
        *,
        level: int = logging.INFO,
        **fields: object,
    ) -> RecoveryEvent:
        """Store an event built from `fields` (see `RecoveryEvent`) and log `message` at `level`."""
        event = RecoveryEvent(kind=kind, message=message, timestamp=time.time(), **fields)  # type: ignore[arg-type]
        self.events.append(event)
        logger.log(level, "%s", message)
        self._tell(self._observers, event)
        return event

    def record_resize(self, result: ResizeResult) -> None:
        """The event of a resize: what it did, or that it started nobody (a loss during it is
        recorded by the loss ledger, which counts it)."""
        report = result.report
        if result.lost is not None or report is None:
            return
        if report.world_size < 1:
            self.record(
                EventKind.RESTART_FAILED,
                f"restart ({result.reason}) asked for {result.num_workers} worker(s) but none "
                f"started ({result.formed_s:.2f} s)",
                level=logging.WARNING,
                duration_s=result.formed_s,
                num_workers_before=result.before,
                num_workers_after=0,
            )
            return
        restored = result.restored
        source = ""
        if restored is not None:
            source = f"; state from {restored.source}, {restored.steps_redone} step(s) redone"
        self.record(
            EventKind.RESIZE,
            f"resized ({result.reason}) {result.before} -> {report.world_size} worker(s) via "
            f"{report.path} in {result.duration_s:.2f} s (re-form group {result.formed_s:.2f} s, "
            f"restore state {result.duration_s - result.formed_s:.2f} s); "
            f"{describe_report(report)}{source}",
            duration_s=result.duration_s,
            num_workers_before=result.before,
            num_workers_after=report.world_size,
            path=report.path,
            phases={**report.timings, "restore_s": result.duration_s - result.formed_s},
            source=restored.source if restored is not None else None,
            steps_redone=report.steps_redone,
            inexact=restored.inexact if restored is not None else (),
            report=report,
            state_at=restored.finished_at if restored is not None else None,
        )

    def record_user_error(self, err: WorkerError) -> None:
        """The event of user code raising on a worker (not retried, not counted)."""
        ranks, nodes = where_lost(err)
        self.record(
            EventKind.USER_ERROR,
            f"user code raised on rank(s) {list(ranks)} (node "
            f"{short_node(nodes[0] if nodes else '')}); not retried: {short_error(err)}",
            level=logging.ERROR,
            ranks=ranks,
            nodes=nodes,
            error=short_error(err),
        )

    def record_move(
        self,
        leaving: Sequence[int],
        nodes: Mapping[str, Optional[float]],
        left: str,
        *,
        took_s: float,
        before: int,
        after: int,
        redone: int,
    ) -> None:
        """The event of workers moved off draining `nodes` (`left`: the time the notice left,
        in words)."""
        where = ", ".join(short_node(n) for n in nodes)
        self.record(
            EventKind.PREEMPTION,
            f"moved rank(s) {list(leaving)} off draining node(s) {where} ({left}) in "
            f"{took_s:.2f} s: {before} -> {after} worker(s), {redone} step(s) redone",
            ranks=tuple(leaving),
            nodes=tuple(nodes),
            duration_s=took_s,
            num_workers_before=before,
            num_workers_after=after,
            steps_redone=redone,
        )

    def record_not_moved(
        self,
        what: str,
        leaving: Sequence[int],
        nodes: Mapping[str, Optional[float]],
        *,
        before: int,
        after: int,
        recovering: bool,
    ) -> None:
        """The warning event of a move that did not happen (`what`: why), and what comes of the
        workers it left (`recovering`: the group needs the next call's recovery)."""
        recovered = (
            "the next call recovers the group"
            if recovering
            else "their loss will be recovered from a checkpoint"
        )
        self.record(
            EventKind.PREEMPTION,
            f"{what}; {recovered}",
            level=logging.WARNING,
            nodes=tuple(nodes),
            ranks=tuple(leaving),
            num_workers_before=before,
            num_workers_after=after,
        )

    def mark_preempted(self, nodes: set[str]) -> None:
        """Mark the failures on `nodes` as preemptions (Ray reported the nodes reclaimed after a
        preemption drain), with a log line saying so."""
        for i, event in enumerate(self.events):
            if event.kind == EventKind.FAILURE and not event.preempted and set(event.nodes) & nodes:
                self.events[i] = dataclasses.replace(event, preempted=True)
                logger.warning(
                    "the loss of rank(s) %s was a preemption: node(s) %s were reclaimed before "
                    "the workers could move",
                    list(event.ranks),
                    [short_node(n) for n in event.nodes],
                )
                self._tell(self._amenders, event, self.events[i])

    @staticmethod
    def _tell(observers: Sequence[Callable[..., None]], *args: RecoveryEvent) -> None:
        for observer in observers:
            try:
                observer(*args)
            except Exception:  # an observer's bug must never stop a recovery
                logger.warning("an observer of the recovery events failed", exc_info=True)


def give_up_message(failures: Sequence[FailureRecord], reason: str, *, max_retries: int) -> str:
    """The `RuntimeError` text when recovery stops: why, and every loss seen in this call."""
    lines = [
        f"Training failed after {len(failures)} worker failure(s) (max_retries={max_retries}): "
        f"{reason}"
    ]
    lines += [f"  {i}. {f.describe()}" for i, f in enumerate(failures, start=1)]
    return "\n".join(lines)


def short_error(exc: BaseException, limit: int = 300) -> str:
    """First line-ish of an exception for log lines: type name and a bounded message."""
    text = f"{type(exc).__name__}: {exc}".strip()
    text = " ".join(text.split())  # collapse tracebacks embedded in messages to one line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_node(node_id: str) -> str:
    """The first 8 characters of a node id, "?" when unknown."""
    # Ray node ids are 56 hex chars; 8 are enough to tell nodes apart in a log line.
    return node_id[:8] if node_id else "?"


def describe_report(report: RecoveryReport) -> str:
    """Who was kept (old rank -> new rank), started and lost, for the resize log line."""
    kept = ", ".join(f"{old}->{new}" for old, new in sorted(report.kept.items())) or "none"
    return f"kept {kept}; started {list(report.started)}; lost {list(report.lost)}"


def where_lost(err: BaseException) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Ranks and nodes a core error names (empty for other errors)."""
    if isinstance(err, WorkerDiedError):
        return tuple(err.ranks), tuple(err.nodes)
    if isinstance(err, WorkerError):
        return (err.rank,), ((err.node_id,) if err.node_id else ())
    return (), ()
