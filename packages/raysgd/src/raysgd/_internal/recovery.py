"""The recovery loop around one `TorchTrainer.train()` call: detect, decide, resize, restore, redo.

The loop is a small state machine (`LoopState`) over a narrow view of the worker group
(`ElasticGroup`: its live size, whether it needs recovery, `recover`, `estimate_fitting`), a restore
callback and a failure policy (`raysgd_fault`). It knows nothing else of the trainer.

1. RUNNING: ``attempt()`` runs one train call. A lost actor or node surfaces at once as
   `WorkerDiedError` (the group sees the dead actor; nobody waits for a collective timeout); the loss
   is counted and logged -> FAILED.
2. FAILED: the policy is asked what to do, given how many workers are wanted, alive and could start
   now, how many losses this call saw and how many restart attempts came to nothing. RETRY ->
   RESTARTING, WAIT -> WAITING, GIVE_UP -> `RuntimeError` naming every loss. The policy alone
   owns the budget (`max_retries`, how many fruitless attempts, how long to back off).
3. RESTARTING: ``group.recover(k)`` keeps healthy workers where it can, starts replacements and
   re-forms the process group; the restore callback then brings every worker to the state of the
   survivor that got furthest, and the interrupted call goes on from there, giving the result of
   a run without the failure -> RUNNING. A restore that finds no state at all
   (`StateLostError`) ends the call at once: retrying cannot bring it back.
   A restart that itself fails (a new worker dies, a survivor dies while re-forming) is one more
   loss; one that starts no worker is a fruitless attempt. Either way -> FAILED.
4. WAITING: sleep the policy's backoff, count a fruitless attempt -> FAILED.

A planned move (`move_off`: workers on a node Ray is draining for a preemption) walks the same
resize without a failure: the workers leave at a step boundary, the policy decides how many to
start elsewhere (phase "preemption"), and the move is neither counted in `failures` nor spends
`max_retries`; it is recorded as its own event kind.

Errors raised by user code (`WorkerError`) are never retried: they reach the caller unchanged, with the
worker's traceback; the group is only repaired (same size, last good state) so the trainer stays usable.

Calls other than `train()` (validate, save, state_dict, ...) are not redone by the loop, but their
failures go through it too: `repair` logs the user error or counts the loss as `run` does, and
re-forms the group at its size with the same resize, timeout and restore seam.
Growth back towards the requested size is asked of the policy at the start of every `train()`.
Deliberate differences from RaySGD 1.x's recovery: the group is sized in workers (not raw CPUs)
and survivors are re-joined instead of killed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar

from raysgd._internal.elastic import NEXT_STATE, ElasticGroup, LoopState, on_live_nodes
from raysgd._internal.recovery_log import (
    EventKind,
    FailureRecord,
    RecoveryEvent,
    RecoveryLog,
    describe_report,
    give_up_message,
    short_error,
    short_node,
    where_lost,
)
from raysgd._internal.restore_plan import RestoreOutcome, StateLostError
from raysgd_base import check_number
from raysgd_core import RecoveryReport, WorkerDiedError, WorkerError, preempted_nodes
from raysgd_fault import Action, Decision, FailurePolicy, FailureStatus

__all__ = [
    "DEFAULT_RESTART_TIMEOUT_S",
    "GROW_BACKOFF_S",
    "MAX_GROW_BACKOFF_S",
    "Recovery",
]

logger = logging.getLogger("raysgd.recovery")

T = TypeVar("T")

#: Bound on one ``group.recover`` call: how long new workers may take to start (those that do not
#: are dropped and the group goes on smaller). Dead workers are reported long before this.
DEFAULT_RESTART_TIMEOUT_S = 30.0

#: After a grow that started no new worker, skip growing for this long, doubling up to the maximum.
GROW_BACKOFF_S = 30.0
MAX_GROW_BACKOFF_S = 600.0


class Recovery:
    """Runs train attempts on a group, recovering from lost workers as the policy decides.

    Args:
        group: The worker group (see `ElasticGroup`).
        num_workers: The size asked for; the group is regrown towards it.
        restore: Called with the `RecoveryReport` after every successful resize: make every worker
            of the re-formed group ready to go on with the interrupted work; it may return a
            `RestoreOutcome` (recorded in the resize event). An exception there counts as a loss
            during the restart, except `StateLostError`, which ends the call.
        policy: The failure policy deciding retry / wait / give up and the group size.
        restart_timeout_s: Bound on one ``group.recover`` call (see `DEFAULT_RESTART_TIMEOUT_S`).
        sleep: How WAIT decisions sleep (injectable so that an embedding driver can interrupt waits).
        reclaimable: How many of the given nodes (one entry per lost worker) are still alive, so
            that their freed slots count as room at once; by default asks Ray.
    """

    def __init__(
        self,
        *,
        group: ElasticGroup,
        num_workers: int,
        restore: Callable[[RecoveryReport], Any],
        policy: FailurePolicy,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
        reclaimable: Optional[Callable[[Sequence[str]], int]] = None,
    ) -> None:
        check_number("restart_timeout_s", restart_timeout_s, above=0)
        self._group = group
        self._num_workers = int(num_workers)
        self._restore = restore
        self.policy = policy
        self._restart_timeout_s = float(restart_timeout_s)
        self._sleep = sleep
        self._reclaimable = reclaimable or on_live_nodes
        self._log = RecoveryLog()
        self._total_failures = 0
        self._call_failures: list[FailureRecord] = []
        self._last_failure_at: Optional[float] = None
        self._last_error: Optional[BaseException] = None  # chained to the give-up RuntimeError
        self._grow_backoff_s = 0.0
        self._next_grow_at = 0.0
        #: The nodes being moved off (during `move_off`): a loss there is a preemption.
        self._draining: frozenset[str] = frozenset()
        self.state = LoopState.SUCCEEDED

    @property
    def failures(self) -> int:
        """Worker losses over the trainer's lifetime (while training and while restarting)."""
        return self._total_failures

    @property
    def failures_this_call(self) -> int:
        """Worker losses in the current (or last) `run()` call."""
        return len(self._call_failures)

    @property
    def events(self) -> list[RecoveryEvent]:
        """Every failure, decision and resize so far, oldest first."""
        return self._log.events

    def run(self, attempt: Callable[[], T], *, max_retries: int) -> T:
        """Return ``attempt()``, recovering from lost workers and redoing the attempt.

        `max_retries` is handed to the policy (which alone decides when it is exhausted).

        Raises:
            WorkerError: user code raised on a worker (not retried; the group is left usable).
            RuntimeError: the policy gave up; the message names every loss of this call.
        """
        self._call_failures, self._last_error = [], None
        detected_at: Optional[float] = None
        alive, reclaimable, fruitless = self._world_size(), 0, 0
        decision: Optional[Decision] = None
        # An earlier repair failed: the group must be re-formed before anything runs on it.
        self.state = LoopState.FAILED if self._group.needs_recovery else LoopState.RUNNING
        while True:
            if self.state is LoopState.RUNNING:
                try:
                    result = attempt()
                except WorkerError as err:
                    self._after_user_error(err)
                    raise
                except WorkerDiedError as err:
                    detected_at = detected_at or time.monotonic()
                    alive = max(0, self._world_size() - len(err.ranks))
                    reclaimable, fruitless = self._reclaimable_count(err.nodes), 0
                    preempted = bool(err.preempted)
                    self._note_loss(
                        err.ranks,
                        err.nodes,
                        err,
                        during_restart=False,
                        alive=alive,
                        preempted=preempted,
                    )
                    self.state = LoopState.FAILED
                    continue
                self.state = LoopState.SUCCEEDED
                if detected_at is not None:
                    self._note_recovered(time.monotonic() - detected_at)
                    self._mark_preempted()
                return result
            if self.state is LoopState.FAILED:
                decision = self._decide(
                    max_retries,
                    alive=alive,
                    fitting=self._fitting() + reclaimable,
                    phase="failure",
                    attempt=fruitless,
                )
                self.state = NEXT_STATE[decision.action]
            elif self.state is LoopState.WAITING:
                assert decision is not None
                self._sleep(decision.wait_s)
                fruitless += 1
                self.state = LoopState.FAILED
            elif self.state is LoopState.RESTARTING:
                assert decision is not None
                losses = self.failures_this_call
                if self._resize(decision.num_workers, why="failure"):
                    self.state = LoopState.RUNNING
                    continue
                # The recover call released the lost workers' slots (the group's own estimate
                # counts them from now on), and the group may have shrunk meanwhile.
                reclaimable, alive = 0, min(alive, self._world_size())
                if self.failures_this_call == losses:
                    fruitless += 1  # nothing started and nothing died: room is still missing
                self.state = LoopState.FAILED
            else:  # GAVE_UP
                assert decision is not None
                self._give_up(decision.reason, max_retries)

    def maybe_grow(self, *, max_retries: int) -> bool:
        """At the start of `train()`: grow back towards `num_workers` if the policy says so.

        Returns True if the group grew (the new workers took the state of the others). A grow that fails is logged and the group is put back to its
        old size; one that starts no new worker (the room the cluster reported was not real) makes
        later calls skip growing for a while (doubling, `GROW_BACKOFF_S` up to `MAX_GROW_BACKOFF_S`),
        so that a lasting shortage does not slow down every `train()`. Neither fails the call.
        """
        self._call_failures = []  # a new train() call starts here
        current = self._world_size()
        if current >= self._num_workers or time.monotonic() < self._next_grow_at:
            return False
        fitting = self._fitting()
        if fitting <= 0:
            return False  # nothing to ask the policy: the cheap check keeps train() fast
        decision = self._decide(max_retries, alive=current, fitting=fitting, phase="grow")
        if decision.action is not Action.RETRY or decision.num_workers <= current:
            return False
        if not self._resize(decision.num_workers, why="grow"):
            # A new worker failed while joining; the old members may have left their process group
            # already, so re-form at the old size. Should that fail too, the next attempt sees a
            # broken group and the failure path takes over.
            self._resize(max(1, current), why="repair after a failed grow")
        if self._world_size() > current:
            self._grow_backoff_s = 0.0
            return True
        self._grow_backoff_s = min(
            MAX_GROW_BACKOFF_S, max(GROW_BACKOFF_S, 2 * self._grow_backoff_s)
        )
        self._next_grow_at = time.monotonic() + self._grow_backoff_s
        self._log.record(
            EventKind.DECISION,
            f"grow to {decision.num_workers} worker(s) started none; not trying again for "
            f"{self._grow_backoff_s:g} s",
            level=logging.WARNING,
            action=Action.WAIT.value,
            duration_s=self._grow_backoff_s,
            num_workers_before=current,
            num_workers_after=self._world_size(),
        )
        return False

    def repair(self, error: Optional[BaseException] = None) -> bool:
        """After a call other than a `run()` attempt failed with `error`, or found the group
        broken (`error` None): put the group back in shape for the next call.

        A user error (`WorkerError`) is logged and not counted, as in `run()`; a lost worker
        (`WorkerDiedError`) is a loss, counted in `failures` and logged as in `run()`. A group that
        needs it is then re-formed at its size (replacements for lost workers where there is
        room), with the loop's restart timeout and restore seam, and the resize is logged. The
        policy is not asked: a call other than `train()` has no retry budget, and the call itself
        is not redone here. Returns whether the group is usable now; when it is not, the next
        `run()` starts by recovering it. `StateLostError` from the restore propagates.
        """
        if isinstance(error, WorkerError):
            self._after_user_error(error)
            return not self._group.needs_recovery
        self._call_failures, self._last_error = [], None  # a call of its own, as in run()
        if isinstance(error, WorkerDiedError):
            self._note_loss(
                error.ranks,
                error.nodes,
                error,
                during_restart=False,
                alive=max(0, self._world_size() - len(error.ranks)),
                preempted=bool(error.preempted),
            )
        if not self._group.needs_recovery:
            return True
        self.state = LoopState.RESTARTING
        repaired = self._resize(max(1, self._world_size()), why="repair after a failed call")
        self.state = LoopState.SUCCEEDED if repaired else LoopState.FAILED
        if not repaired:
            logger.warning(
                "the worker group could not be repaired after a failed call; the next train() "
                "recovers it"
            )
        return repaired

    def move_off(
        self,
        ranks: Sequence[int],
        nodes: dict[str, Optional[float]],
        *,
        max_retries: int,
        before_retire: Callable[[], None] = lambda: None,
    ) -> bool:
        """Move the workers of `ranks` off `nodes` (draining: node -> deadline, None for none)
        before the deadline; every worker has stopped at the same step boundary.

        `before_retire` makes the state restorable at this boundary without the leaving workers
        (a sharded strategy snapshots and hands their parts to workers that stay). When no worker
        would be left, it runs first, replacements join (taking the state of this boundary) and
        it runs again. The policy then decides how many to run (phase "preemption"): RETRY n
        starts replacements elsewhere up to n; otherwise the group goes on with the workers that
        stay. Not a failure: neither counted nor charged to `max_retries`, and recorded as a
        "preemption" event with the steps redone (0 unless a worker was lost meanwhile).

        Returns False when the workers could not be moved: nothing started in their place (they
        stay, and the node's loss will be an ordinary one), or a worker was lost during the move
        (the node went before the deadline). Such a loss is counted and logged as a preemption,
        and the group is left for the next `run()` to recover, as after any loss.
        """
        started = time.monotonic()
        deadlines = [d for d in nodes.values() if d is not None]
        deadline = min(deadlines) if deadlines else None
        where = ", ".join(short_node(n) for n in nodes)
        left = f"{deadline - time.time():.1f} s before the deadline" if deadline else "no deadline"
        before = self._world_size()
        leaving = sorted(ranks)
        first_event = len(self._log.events)
        self._draining = frozenset(nodes)
        try:
            if len(leaving) >= before:
                # Everyone is on a draining node: the replacements come in first, while the
                # state is still there to give them.
                before_retire()
                grown = self._resize(
                    before + len(leaving), why="preemption", timeout_s=self._left(deadline)
                )
                if not grown or self._world_size() <= before:
                    return self._not_moved(
                        leaving,
                        nodes,
                        before,
                        f"every worker is on draining node(s) {where} "
                        f"({left}) and no replacement started: they stay",
                    )
            before_retire()
            self._group.retire(leaving)
            alive = self._world_size() - len(leaving)
            decision = self._decide(
                max_retries, alive=alive, fitting=self._fitting(), phase="preemption"
            )
            target = decision.num_workers if decision.action is Action.RETRY else alive
            resized = self._resize(max(1, target), why="preemption", timeout_s=self._left(deadline))
        except StateLostError:
            raise
        except Exception as err:  # a worker lost while handing over: the node went early
            lost_ranks, lost_nodes = where_lost(err)
            self._note_loss(lost_ranks, lost_nodes, err, during_restart=True, alive=None)
            resized = False
        finally:
            self._draining = frozenset()
        if not resized:
            return self._not_moved(
                leaving,
                nodes,
                before,
                f"moving rank(s) {leaving} off draining node(s) {where} "
                f"({left}) failed: a worker was lost, or none could start",
            )
        took = time.monotonic() - started
        redone = sum(
            e.steps_redone or 0
            for e in self._log.events[first_event:]
            if e.kind == EventKind.RESIZE
        )
        self._log.record(
            EventKind.PREEMPTION,
            f"moved rank(s) {leaving} off draining node(s) {where} ({left}) in {took:.2f} s: "
            f"{before} -> {self._world_size()} worker(s), {redone} step(s) redone",
            ranks=tuple(leaving),
            nodes=tuple(nodes),
            duration_s=took,
            num_workers_before=before,
            num_workers_after=self._world_size(),
            steps_redone=redone,
        )
        return True

    def _not_moved(
        self, leaving: Sequence[int], nodes: dict[str, Optional[float]], before: int, what: str
    ) -> bool:
        """Record a move that did not happen (a warning event of the preemption kind)."""
        recovered = (
            "the next call recovers the group"
            if self._group.needs_recovery
            else "their loss will be recovered from a checkpoint"
        )
        self._log.record(
            EventKind.PREEMPTION,
            f"{what}; {recovered}",
            level=logging.WARNING,
            nodes=tuple(nodes),
            ranks=tuple(leaving),
            num_workers_before=before,
            num_workers_after=self._world_size(),
        )
        return False

    def _left(self, deadline: Optional[float]) -> float:
        """How long a restart for a move may take: up to the deadline, less a margin."""
        if deadline is None:
            return self._restart_timeout_s
        return max(1.0, min(self._restart_timeout_s, deadline - time.time() - 2.0))

    def _resize(self, num_workers: int, *, why: str, timeout_s: Optional[float] = None) -> bool:
        """`group.recover(num_workers)` and restore the state there; False (logged) if it failed."""
        before = self._world_size()
        started = time.monotonic()
        try:
            report = self._group.recover(
                num_workers,
                timeout_s=timeout_s if timeout_s is not None else self._restart_timeout_s,
            )
            formed = time.monotonic()
            if report.world_size < 1:
                self._log.record(
                    EventKind.RESTART_FAILED,
                    f"restart ({why}) asked for {num_workers} worker(s) but none started "
                    f"({formed - started:.2f} s)",
                    level=logging.WARNING,
                    duration_s=formed - started,
                    num_workers_before=before,
                    num_workers_after=0,
                )
                return False
            outcome = self._restore(report)
        except StateLostError:
            raise
        except Exception as err:  # any error while restarting is one more loss
            logger.debug("restart (%s) failed", why, exc_info=True)
            ranks, nodes = where_lost(err)
            self._note_loss(ranks, nodes, err, during_restart=True, alive=None)
            return False
        done = time.monotonic()
        restored = ""
        if isinstance(outcome, RestoreOutcome):
            restored = f"; state from {outcome.source}, {outcome.steps_redone} step(s) redone"
            report = dataclasses.replace(report, steps_redone=outcome.steps_redone)
        self._log.record(
            EventKind.RESIZE,
            f"resized ({why}) {before} -> {report.world_size} worker(s) via {report.path} in "
            f"{done - started:.2f} s (re-form group {formed - started:.2f} s, restore state "
            f"{done - formed:.2f} s); {describe_report(report)}{restored}",
            duration_s=done - started,
            num_workers_before=before,
            num_workers_after=report.world_size,
            path=report.path,
            phases={**getattr(report, "timings", {}), "restore_s": done - formed},
            source=outcome.source if isinstance(outcome, RestoreOutcome) else None,
            steps_redone=report.steps_redone,
            report=report,
        )
        return True

    def _after_user_error(self, err: WorkerError) -> None:
        """Log a user error and repair the group (same size, last good state) without counting it."""
        ranks, nodes = where_lost(err)
        self._log.record(
            EventKind.USER_ERROR,
            f"user code raised on rank(s) {list(ranks)} (node "
            f"{short_node(nodes[0] if nodes else '')}); not retried: {short_error(err)}",
            level=logging.ERROR,
            ranks=ranks,
            nodes=nodes,
            error=short_error(err),
        )
        if not self._group.needs_recovery:
            return
        # The raising rank left its process group to release peers blocked in a collective: re-form
        # at the same size, every worker at the last step the group finished, so that the next
        # call starts from a consistent model. This is housekeeping, not a loss of the user's
        # run, so it is not counted.
        counters = (self._total_failures, list(self._call_failures), self._last_failure_at)
        last_error = self._last_error
        if not self._resize(max(1, self._world_size()), why="repair after a user error"):
            logger.warning("the worker group could not be repaired after the user error above")
        self._total_failures, self._call_failures, self._last_failure_at = counters
        self._last_error = last_error

    def _note_loss(
        self,
        ranks: Sequence[int],
        nodes: Sequence[str],
        err: BaseException,
        *,
        during_restart: bool,
        alive: Optional[int],
        preempted: bool = False,
    ) -> None:
        # A loss on a node being moved off for a preemption notice is that preemption.
        preempted = preempted or bool(self._draining & set(nodes))
        record = FailureRecord(
            tuple(ranks), tuple(nodes), short_error(err), during_restart, preempted
        )
        self._call_failures.append(record)
        self._total_failures += 1
        self._last_failure_at = time.monotonic()
        self._last_error = err
        survive = "" if alive is None else f"; {alive} worker(s) survive"
        self._log.record(
            EventKind.RESTART_FAILED if during_restart else EventKind.FAILURE,
            f"worker failure {self.failures_this_call} of this call ({self._total_failures} in "
            f"total): {record.describe()}{survive}",
            level=logging.WARNING,
            ranks=record.ranks,
            nodes=record.nodes,
            error=record.error,
            num_workers_before=self._world_size(),
            num_workers_after=alive,
            preempted=preempted,
        )

    def _mark_preempted(self) -> None:
        """Tag this call's losses whose node Ray now reports reclaimed after a preemption drain.
        Asked only once the call is done: Ray records why a node died a moment after its workers
        are seen gone, and waiting for it must not delay the recovery."""
        nodes = {n for record in self._call_failures for n in record.nodes}
        preempted = preempted_nodes(nodes)
        if preempted:
            self._log.mark_preempted(preempted)

    def _note_recovered(self, took: float) -> None:
        self._log.record(
            EventKind.RECOVERED,
            f"recovered: the interrupted work was redone on {self._world_size()} worker(s); "
            f"{took:.2f} s from detecting the failure to the end of the redone call",
            duration_s=took,
            num_workers_after=self._world_size(),
        )

    def _decide(
        self, max_retries: int, *, alive: int, fitting: int, phase: str, attempt: int = 0
    ) -> Decision:
        wanted = self._num_workers
        since = None
        if self._last_failure_at is not None:
            since = time.monotonic() - self._last_failure_at
        status = FailureStatus(
            failures=self.failures_this_call,
            max_retries=max_retries,
            workers_wanted=wanted,
            workers_alive=max(0, min(alive, wanted)),
            workers_fitting=max(0, fitting),
            attempt=attempt,
            total_failures=self._total_failures,
            seconds_since_last_failure=since,
            error=self._call_failures[-1].error if self._call_failures else "",
            phase=phase,
        )
        decision = self.policy.decide(status)
        if not isinstance(decision, Decision):
            raise TypeError(
                f"{type(self.policy).__name__}.decide must return a Decision, "
                f"got {type(decision).__name__}"
            )
        self._log.record(
            EventKind.DECISION,
            f"policy {getattr(self.policy, 'name', type(self.policy).__name__)!r} ({phase}: wanted "
            f"{wanted}, alive {status.workers_alive}, fitting {status.workers_fitting}, failures "
            f"{status.failures}, attempt {attempt}) -> {decision}",
            action=decision.action.value,
            num_workers_before=status.workers_alive,
            num_workers_after=decision.num_workers or None,
        )
        return decision

    def _give_up(self, reason: str, max_retries: int) -> None:
        message = give_up_message(self._call_failures, reason, max_retries=max_retries)
        logger.error("%s", message)
        # The last loss is the cause: its full text (a worker traceback, say) stays reachable.
        raise RuntimeError(message) from self._last_error

    def _world_size(self) -> int:
        return int(self._group.world_size)

    def _fitting(self) -> int:
        try:
            return max(0, int(self._group.estimate_fitting()))
        except Exception:  # an estimate must never break recovery: assume room, starts decide
            logger.debug("estimate_fitting failed", exc_info=True)
            return self._num_workers

    def _reclaimable_count(self, nodes: Sequence[str]) -> int:
        try:
            return max(0, int(self._reclaimable(nodes)))
        except Exception:  # no answer: count nothing, the group's estimate decides
            logger.debug("counting reclaimable slots failed", exc_info=True)
            return 0
