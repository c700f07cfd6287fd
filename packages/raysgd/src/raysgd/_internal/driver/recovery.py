"""The recovery loop: every resize of the trainer's group, and every call guarded by it.

The loop moves through named stages (`Stage`) over a narrow view of the worker group
(`ElasticGroup`: its live size, whether it needs recovery, `recover`, `estimate_fitting`,
`retire`), the training state's restore and a failure policy (`raysgd_fault`). It knows nothing
else of the trainer.

1. RUNNING: ``attempt()`` runs one train call. A lost actor or node surfaces at once as
   `WorkerDiedError` (the group sees the dead actor, or a peer's bounded collective names a
   silent one); the loss is counted and logged -> FAILED.
2. FAILED: the policy is asked what to do, given how many workers are wanted, alive and could start
   now, how many losses this call saw and how many restart attempts came to nothing. RETRY ->
   RESTARTING, WAIT -> WAITING, GIVE_UP -> `RuntimeError` naming every loss. The policy alone
   owns the budget (`max_retries`, how many fruitless attempts, how long to back off).
3. RESTARTING: one `resize` to the policy's size: the interrupted call then goes on from the
   state the restore brought every worker to -> RUNNING. A restore that finds no state at all
   (`StateLostError`) ends the call at once: retrying cannot bring it back. A resize that loses a
   worker is one more loss; one that starts no worker is a fruitless attempt. Either way ->
   FAILED.
4. WAITING: sleep the policy's backoff, count a fruitless attempt -> FAILED.

Every change of the group is one transaction, `resize(num_workers, reason)`: workers leaving on
purpose hand their state over and go, the group keeps its healthy workers and starts the rest
(`WorkerGroup.recover`), the training state is restored on the new group, and a `ResizeResult`
says what happened; the events of the log are derived from it. Its callers: a loss in `run`, a
grow at the start of `train()` (`maybe_grow`, sized by the policy's scaling policy) or at a step
boundary inside it (`join_spares`), `repair` after any other call failed, and a move off a
draining node (`preemption`).

A RETRY decision with `background` replacements re-forms the group with the survivors (and any
spare that is up) at once and starts the replacements as spares beside it: the call goes on at
the smaller size, its workers watch the spares' readiness between steps (`joining`), stop at the
same step boundary once one is up, and the trainer lets it join (`join_spares`) before it goes on
with the call. The survivors thus train while their replacements' processes start.

Calls other than `train()` run inside `guarded()`: a group found broken is repaired first, and a
failure inside is handed to `repair` (a user error logged and not counted, a lost worker counted,
the group re-formed at its size) before it is raised, a user error in its one form (see
ARCHITECTURE.md, "User errors have one form"). Errors raised by user code are never retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from raysgd._internal.driver.events import (
    EventKind,
    RecoveryEvent,
    RecoveryLog,
    describe_report,
    short_error,
    short_node,
    where_lost,
)
from raysgd._internal.driver.group_view import (
    NEXT_STAGE,
    ElasticGroup,
    RestorableState,
    Stage,
    on_live_nodes,
)
from raysgd._internal.driver.losses import Losses
from raysgd._internal.driver.restore_plan import RestoreOutcome, StateLostError
from raysgd_base import check_number
from raysgd_core import RecoveryReport, WorkerDiedError, WorkerError
from raysgd_fault import (
    Action,
    Decision,
    FailurePolicy,
    FailureStatus,
    ScalingDecision,
    ScalingPolicy,
    ScalingStatus,
)

__all__ = [
    "DEFAULT_RESTART_TIMEOUT_S",
    "GROW_BACKOFF_S",
    "MAX_GROW_BACKOFF_S",
    "Recovery",
    "ResizeResult",
    "in_one_form",
]

logger = logging.getLogger("raysgd.recovery")

T = TypeVar("T")

#: Bound on one ``group.recover`` call: how long new workers may take to start (those that do not
#: are dropped and the group goes on smaller). Dead workers are reported long before this.
DEFAULT_RESTART_TIMEOUT_S = 30.0

#: After a grow that started no new worker, skip growing for this long, doubling up to the maximum.
GROW_BACKOFF_S = 30.0
MAX_GROW_BACKOFF_S = 600.0


def in_one_form(error: WorkerError) -> WorkerError:
    """The form every user exception takes when it leaves the trainer: `error` as an instance of
    both `WorkerError` and its cause's class (`WorkerError.as_instance_of_cause`), keeping the
    traceback of where the group raised it."""
    return error.as_instance_of_cause().with_traceback(error.__traceback__)


@dataclass(frozen=True)
class ResizeResult:
    """What one `Recovery.resize` did.

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


class Recovery:
    """Runs train attempts on a group, recovering from lost workers as the policy decides.

    Args:
        group: The worker group (see `ElasticGroup`).
        num_workers: The size asked for; the group is regrown towards it.
        state: The training state (see `RestorableState`): restored after every successful
            resize, to go on with the interrupted work (a `RestoreOutcome` it returns is recorded
            in the resize event; an exception counts as a loss during the restart, except
            `StateLostError`, which ends the call), and handed over before workers leave.
        policy: The failure policy deciding retry / wait / give up and the size after a loss.
        scaling: Sizes the group when no worker was lost (a grow, a move off a draining node);
            by default the failure policy's `scaling`.
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
        state: RestorableState,
        policy: FailurePolicy,
        scaling: Optional[ScalingPolicy] = None,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
        reclaimable: Optional[Callable[[Sequence[str]], int]] = None,
    ) -> None:
        check_number("restart_timeout_s", restart_timeout_s, above=0)
        self._group = group
        self._num_workers = int(num_workers)
        self._state = state
        self.policy = policy
        self.scaling = scaling if scaling is not None else policy.scaling
        self._restart_timeout_s = float(restart_timeout_s)
        self._sleep = sleep
        self._reclaimable = reclaimable or on_live_nodes
        #: Every event so far (`events`); the moves off draining nodes record theirs here too.
        self.log = RecoveryLog()
        #: Every loss so far (`failures`); a move off a draining node counts its own and sets its
        #: `draining` nodes.
        self.losses = Losses(self.log, self._world_size)
        self._grow_backoff_s = 0.0
        self._next_grow_at = 0.0
        self._join_declined = False  # the scaling policy kept the size at a join: until next call
        self.stage = Stage.SUCCEEDED
        self._guarding = False

    @property
    def restart_timeout_s(self) -> float:
        """Bound on one ``group.recover`` call."""
        return self._restart_timeout_s

    @property
    def failures(self) -> int:
        """Worker losses over the trainer's lifetime (while training and while restarting)."""
        return self.losses.total

    @property
    def failures_this_call(self) -> int:
        """Worker losses in the current (or last) `run()` call."""
        return len(self.losses.this_call)

    @property
    def events(self) -> list[RecoveryEvent]:
        """Every failure, decision and resize so far, oldest first."""
        return self.log.events

    # --------------------------------------------------------------------------- guarded calls
    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Worker calls inside are made on a usable group and fail in one form: a group left
        broken is repaired first; a user error or a lost worker inside goes to `repair` and is
        then raised, a user error in its one form (`in_one_form`). Nested blocks are part of the
        outermost one."""
        if self._guarding:
            yield
            return
        self._guarding = True
        try:
            if self._group.needs_recovery:
                self.repair()
            try:
                yield
            except (WorkerError, WorkerDiedError) as exc:
                self.repair(exc)
                if isinstance(exc, WorkerError):
                    raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception)
                raise
        finally:
            self._guarding = False

    def call(self, fn: Callable[..., Any], *args: Any, rank: Optional[int] = None) -> Any:
        """`fn(*args)` on every worker (or on `rank`), guarded."""
        with self.guarded():
            if rank is None:
                return self._group.execute(fn, *args)
            return self._group.execute_single(rank, fn, *args)

    def read(self, fn: Callable[..., T], *args: Any, rank: int = 0) -> T:
        """`fn(*args)` on `rank` for something the user asked to read (the state, the model): a
        worker lost meanwhile is replaced and the read done again once."""
        return self.again_once(lambda: self.call(fn, *args, rank=rank))

    def again_once(self, action: Callable[[], T]) -> T:
        """`action()` (driver code that calls the workers: a checkpoint written, a state read),
        guarded; when a worker is lost in it, done once more on the repaired group."""
        try:
            with self.guarded():
                return action()
        except WorkerDiedError:
            with self.guarded():
                return action()

    # ------------------------------------------------------------------------------- training
    def run(self, attempt: Callable[[], T], *, max_retries: int) -> T:
        """Return ``attempt()``, recovering from lost workers and redoing the attempt.

        `max_retries` is handed to the policy (which alone decides when it is exhausted).

        Raises:
            WorkerError: user code raised on a worker (not retried; the group is left usable).
            RuntimeError: the policy gave up; the message names every loss of this call.
        """
        self.losses.new_call()
        detected_at: Optional[float] = None
        alive, reclaimable, fruitless = self._world_size(), 0, 0
        decision: Optional[Decision] = None
        # An earlier repair failed: the group must be re-formed before anything runs on it.
        self.stage = Stage.FAILED if self._group.needs_recovery else Stage.RUNNING
        while True:
            if self.stage is Stage.RUNNING:
                try:
                    result = attempt()
                except WorkerError as err:
                    self._after_user_error(err)
                    raise in_one_form(err)  # noqa: B904 (its cause is the user's exception)
                except WorkerDiedError as err:
                    detected_at = detected_at or time.monotonic()
                    alive = max(0, self._world_size() - len(err.ranks))
                    # A silent rank's node may be frozen: its room is not counted on.
                    answered = [n for r, n in zip(err.ranks, err.nodes) if r not in err.silent]
                    reclaimable, fruitless = self._reclaimable_count(answered), 0
                    self.losses.count(err, during_restart=False, alive=alive)
                    self.stage = Stage.FAILED
                    continue
                self.stage = Stage.SUCCEEDED
                if detected_at is not None:
                    self.losses.recovered(time.monotonic() - detected_at)
                return result
            if self.stage is Stage.FAILED:
                decision = self._decide(
                    max_retries,
                    alive=alive,
                    fitting=self._fitting() + reclaimable,
                    attempt=fruitless,
                )
                self.stage = NEXT_STAGE[decision.action]
            elif self.stage is Stage.WAITING:
                assert decision is not None
                self._sleep(decision.wait_s)
                fruitless += 1
                self.stage = Stage.FAILED
            elif self.stage is Stage.RESTARTING:
                assert decision is not None
                losses = self.failures_this_call
                now, later = self._split_background(decision)
                if self.resize(now, "failure").ok:
                    if later:
                        self._group.start_spares(later)
                    self.stage = Stage.RUNNING
                    continue
                # The recover call released the lost workers' slots (the group's own estimate
                # counts them from now on), and the group may have shrunk meanwhile.
                reclaimable, alive = 0, min(alive, self._world_size())
                if self.failures_this_call == losses:
                    fruitless += 1  # nothing started and nothing died: room is still missing
                self.stage = Stage.FAILED
            else:  # GAVE_UP
                assert decision is not None
                self.losses.give_up(decision.reason, max_retries)

    def _split_background(self, decision: Decision) -> tuple[int, int]:
        """How many workers to re-form the group with now, and how many replacements to start
        beside it for `decision`. Spares that are up join now (they cost no start); spares still
        starting count as replacements already on their way."""
        if not decision.background:
            return decision.num_workers, 0
        up = min(decision.background, len(self._group.spares))
        later = decision.background - up - self._group.spares_starting
        return decision.num_workers + up, max(0, later)

    def joining(self) -> list[tuple[Any, ...]]:
        """While the group is below its size: for each spare, the refs that are all done once it
        is up (the workers stop at a step boundary for it to join: `join_spares`)."""
        if self._world_size() >= self._num_workers or self._join_declined:
            return []
        return self._group.spare_readiness()

    def join_spares(self) -> bool:
        """At a step boundary inside a call, the group below its size: let the spares that are
        up join, as the scaling policy sizes the grow; the state of this boundary is first made
        restorable (`RestorableState.hand_over`: a sharded state is snapshotted, the joining
        workers take it, and nothing is redone). Returns whether the group grew. A spare lost
        while joining is one more loss; the group is then re-formed at its old size. A worker
        lost in the hand-over is counted and left to the next `run()`, which recovers the group
        first."""
        current = self._world_size()
        up = len(self._group.spares)
        if current >= self._num_workers or not up:
            return False
        decision = self._size("grow", running=current, fitting=up)
        if decision.num_workers <= current:
            # Not asked again in this call: the workers would otherwise stop at every look.
            self._join_declined = True
            return False
        try:
            self._state.hand_over(())
        except WorkerDiedError as err:
            self.losses.count(err, during_restart=False, alive=current - len(err.ranks))
            return False
        if not self.resize(decision.num_workers, "grow").ok:
            self.resize(max(1, current), "repair after a failed grow")
        return self._world_size() > current

    def maybe_grow(self) -> bool:
        """At the start of `train()`: grow back towards `num_workers` if the scaling policy says so.

        Returns True if the group grew (the new workers took the state of the others). A grow that fails is logged and the group is put back to its
        old size; one that starts no new worker (the room the cluster reported was not real) makes
        later calls skip growing for a while (doubling, `GROW_BACKOFF_S` up to `MAX_GROW_BACKOFF_S`),
        so that a lasting shortage does not slow down every `train()`. Neither fails the call.
        """
        self.losses.new_call()  # a new train() call starts here
        self._join_declined = False
        current = self._world_size()
        if current >= self._num_workers or time.monotonic() < self._next_grow_at:
            return False
        if self._group.spares_starting:
            return False  # replacements on their way join at a step boundary (`join_spares`)
        fitting = self._fitting()
        if fitting <= 0:
            return False  # nothing to ask the policy: the cheap check keeps train() fast
        decision = self._size("grow", running=current, fitting=fitting)
        if decision.num_workers <= current:
            return False
        if not self.resize(decision.num_workers, "grow").ok:
            # A new worker failed while joining; the old members may have left their process group
            # already, so re-form at the old size. Should that fail too, the next attempt sees a
            # broken group and the failure path takes over.
            self.resize(max(1, current), "repair after a failed grow")
        if self._world_size() > current:
            self._grow_backoff_s = 0.0
            return True
        self._grow_backoff_s = min(
            MAX_GROW_BACKOFF_S, max(GROW_BACKOFF_S, 2 * self._grow_backoff_s)
        )
        self._next_grow_at = time.monotonic() + self._grow_backoff_s
        self.log.record(
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
        self.losses.new_call()  # a call of its own, as in run()
        if isinstance(error, WorkerDiedError):
            alive = max(0, self._world_size() - len(error.ranks))
            self.losses.count(error, during_restart=False, alive=alive)
        if not self._group.needs_recovery:
            return True
        self.stage = Stage.RESTARTING
        repaired = self.resize(max(1, self._world_size()), "repair after a failed call").ok
        self.stage = Stage.SUCCEEDED if repaired else Stage.FAILED
        if not repaired:
            logger.warning(
                "the worker group could not be repaired after a failed call; the next train() "
                "recovers it"
            )
        return repaired

    def resize(
        self,
        num_workers: Optional[int],
        reason: str,
        *,
        timeout_s: Optional[float] = None,
        leaving: Sequence[int] = (),
        counted: bool = True,
    ) -> ResizeResult:
        """Resize the group to `num_workers`, as one transaction: the state handed over (made
        restorable without the workers of `leaving`) and those workers retired, then
        `group.recover` (healthy workers kept, the rest started, within `timeout_s`), then the
        state restored on the new group. `num_workers` None: as the scaling policy sizes a move
        (`size_for_move`), asked once the leaving workers are gone (their room then counts).
        Every event is derived from the returned result.

        A worker lost meanwhile is a loss during the restart, counted here (`counted` False:
        logged only, for a repair after a user error): one the group found gone while it
        re-formed (`RecoveryReport.found_lost`: the resize replaced it and went on), or one whose
        loss made the resize fail (`ResizeResult.lost`).

        Raises:
            StateLostError: no worker, copy or checkpoint holds the state (retrying cannot help).
        """
        before = self._world_size()
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
                target = max(1, self.size_for_move(alive=before - len(leaving)))
            report = self._group.recover(
                target,
                timeout_s=timeout_s if timeout_s is not None else self._restart_timeout_s,
            )
            formed = time.monotonic()
            if report.found_lost:
                self._lose(_found_lost_error(report), counted, alive=len(report.kept))
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
        self._record(result)
        if lost is not None:
            self._lose(lost, counted)
        return result

    def _lose(self, err: BaseException, counted: bool, alive: Optional[int] = None) -> None:
        """A worker lost during a resize: counted as a loss during the restart, or only logged."""
        if counted:
            self.losses.count(err, during_restart=True, alive=alive)
        else:
            self.losses.note(err)

    def _record(self, result: ResizeResult) -> None:
        """The event of a resize: what it did, or that it started nobody (a loss during it is
        recorded by whoever counts it)."""
        report = result.report
        if result.lost is not None or report is None:
            return
        if report.world_size < 1:
            self.log.record(
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
        self.log.record(
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

    def _after_user_error(self, err: WorkerError) -> None:
        """Log a user error and repair the group (same size, last good state) without counting it."""
        ranks, nodes = where_lost(err)
        self.log.record(
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
        # run: a worker lost meanwhile is logged, not counted.
        result = self.resize(max(1, self._world_size()), "repair after a user error", counted=False)
        if not result.ok:
            logger.warning("the worker group could not be repaired after the user error above")

    def size_for_move(self, *, alive: int) -> int:
        """How many workers to run after moving off a draining node, `alive` of them staying:
        the scaling policy's size (never fewer than those that stay)."""
        return self._size("preemption", running=alive, fitting=self._fitting()).num_workers

    def _size(self, moment: str, *, running: int, fitting: int) -> ScalingDecision:
        """Ask the scaling policy for the group's size at `moment`, logged as a decision."""
        wanted = self._num_workers
        running = max(0, min(running, wanted))
        status = ScalingStatus(
            moment=moment,
            workers_wanted=wanted,
            workers_running=running,
            workers_fitting=max(0, fitting),
            seconds_since_last_failure=self.losses.seconds_since_last(),
        )
        decision = self.scaling.decide(status)
        if not isinstance(decision, ScalingDecision):
            raise TypeError(
                f"{type(self.scaling).__name__}.decide must return a ScalingDecision, "
                f"got {type(decision).__name__}"
            )
        size = max(running, min(wanted, decision.num_workers))
        self.log.record(
            EventKind.DECISION,
            f"scaling {self.scaling.name!r} ({moment}: wanted {wanted}, running {running}, "
            f"fitting {status.workers_fitting}) -> {decision}",
            action=Action.RETRY.value,
            num_workers_before=running,
            num_workers_after=size,
        )
        return dataclasses.replace(decision, num_workers=size)

    def _decide(self, max_retries: int, *, alive: int, fitting: int, attempt: int = 0) -> Decision:
        wanted = self._num_workers
        status = FailureStatus(
            failures=self.failures_this_call,
            max_retries=max_retries,
            workers_wanted=wanted,
            workers_alive=max(0, min(alive, wanted)),
            workers_fitting=max(0, fitting),
            attempt=attempt,
            total_failures=self.losses.total,
            seconds_since_last_failure=self.losses.seconds_since_last(),
            error=self.losses.last_error(),
        )
        decision = self.policy.decide(status)
        if not isinstance(decision, Decision):
            raise TypeError(
                f"{type(self.policy).__name__}.decide must return a Decision, "
                f"got {type(decision).__name__}"
            )
        self.log.record(
            EventKind.DECISION,
            f"policy {getattr(self.policy, 'name', type(self.policy).__name__)!r} (wanted "
            f"{wanted}, alive {status.workers_alive}, fitting {status.workers_fitting}, failures "
            f"{status.failures}, attempt {attempt}) -> {decision}",
            action=decision.action.value,
            num_workers_before=status.workers_alive,
            num_workers_after=decision.num_workers or None,
            duration_s=decision.wait_s,
        )
        return decision

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


def _found_lost_error(report: RecoveryReport) -> WorkerDiedError:
    """The loss of the workers a recovery found gone that no call had reported (the second of a
    burst, say), as the error a call would have raised for it."""
    ranks = sorted(report.found_lost)
    return WorkerDiedError(
        f"Workers lost: rank(s) {ranks} were found gone while the group re-formed (lost after "
        "the error that called for the resize); replaced",
        ranks,
        [report.found_lost[r] for r in ranks],
    )
