"""The run controller: the one loop that owns every transition of the trainer's run.

It works on narrow views (`group_view`: the worker group, the training state, the cluster), asks
the policies what to do (`decide`: pure), and is the only code that changes the group: every
resize (`_resize`), every spare started or replaced. Its phases (`phases.Phase`):

    IDLE -> GROWING          a train() call starts: the scaling policy may grow the group back
    GROWING -> MOVING        a node of the group is draining: its workers move off first
    -> CHECKPOINTING         train(checkpoint=...) writes the state from before the call
    -> RUNNING               an attempt of the call runs on the workers (FAILED first when an
                             earlier repair left the group broken)
    RUNNING -> SUCCEEDED     the call's work is done (-> IDLE once the call is accounted)
    RUNNING -> FAILED        a worker was lost: the failure policy decides
    RUNNING -> JOINING       the workers stopped together at a step boundary: spares are up
    RUNNING -> MOVING        ... or a node of theirs drains
    RUNNING -> REPAIRING     user code raised: not retried; the group is re-formed at its size
    FAILED -> RESTARTING, WAITING or GAVE_UP, as the policy answers
    WAITING -> FAILED        after the policy's backoff (a fruitless attempt)
    RESTARTING -> RUNNING    the group re-formed and its state restored; else -> FAILED
    JOINING, MOVING -> RUNNING (or FAILED)   the rest of the call, at the new size
    GAVE_UP                  the call raises a RuntimeError naming every loss

The graph is `phases.LEGAL_NEXT` (with `phases.AT_REST`, where calls start): a transition
outside it is logged as an error.

A lost actor or node surfaces at once as `WorkerDiedError` (the group sees the dead actor, or a
peer's bounded collective names a silent one). The failure policy is told how many workers are
wanted, alive and could start now, how many losses the call saw and how many restart attempts came
to nothing; it alone owns the budget. A restore that finds no state at all (`StateLostError`) ends
the call at once: retrying cannot bring it back. A resize that loses a worker is one more loss; one
that starts no worker is a fruitless attempt.

A RETRY with `background` replacements re-forms the group with the survivors (and any spare that
is up) at once and starts the replacements as spares beside it: the call goes on at the smaller
size while they start, its workers watch their readiness between steps, stop at the same step
boundary once one is up, and it joins (JOINING) before the call goes on.

Calls other than `train()` run inside its `guard` (`guard.CallGuard`): a group found broken is
repaired first, and a failure inside is repaired (REPAIRING: a user error logged and not counted, a
lost worker counted, the group re-formed at its size) before it is raised, a user error in its one
form. Errors raised by user code are never retried.

Every transition goes to the loss ledger (`Losses`, which counts and logs the losses it carries),
then to whoever subscribed (goodput), who only read. The decisions, resizes, moves and user errors
are recorded in the event log (`log`) by the controller, which the loggers and goodput read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from raysgd._internal.driver.checkpoints import Checkpoints
from raysgd._internal.driver.decide import (
    decide_failure,
    decide_size,
    grow_backoff,
    move_timeout,
    split_background,
    watch_spec,
)
from raysgd._internal.driver.drains import DrainNotice, Drains
from raysgd._internal.driver.events import (
    EventKind,
    RecoveryEvent,
    RecoveryLog,
    short_node,
)
from raysgd._internal.driver.group_view import (
    ClusterView,
    ElasticGroup,
    RayCluster,
    RestorableState,
)
from raysgd._internal.driver.guard import CallGuard, in_one_form
from raysgd._internal.driver.losses import Losses
from raysgd._internal.driver.phases import (
    NEXT_PHASE,
    Phase,
    Transition,
    TransitionObserver,
    legal,
)
from raysgd._internal.driver.resize import (
    DEFAULT_RESTART_TIMEOUT_S,
    SPARE_WAIT_S,
    ResizeResult,
    found_lost_error,
)
from raysgd._internal.protocol import DRAIN, SPARE, TrainAnswer
from raysgd._internal.state.plan import RestoreOutcome, StateLostError
from raysgd._internal.worker import calls as worker
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

__all__ = ["CallSpec", "RunController"]

logger = logging.getLogger("raysgd.recovery")

T = TypeVar("T")


@dataclass(frozen=True)
class CallSpec:
    """One `train()` call, as asked: what every attempt of it runs."""

    num_steps: Optional[int]
    profile: bool
    info: Optional[dict[str, Any]]
    max_retries: int
    checkpoint: Optional[Union[str, os.PathLike]] = None


class RunController:
    """Runs the trainer's calls on its group, through every loss, drain and grow (see the module
    docstring).

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
        checkpoints: The trainer's checkpoints (`checkpoint_dir`): planned into every attempt,
            written for `train(checkpoint=...)` and when rank 0 cannot leave a draining node.
        cluster: What the cluster says (drains, live nodes); by default Ray.
        restart_timeout_s: Bound on one ``group.recover`` call (see `DEFAULT_RESTART_TIMEOUT_S`).
        sleep: How WAIT decisions sleep (injectable so that an embedding driver can interrupt waits).
    """

    def __init__(
        self,
        *,
        group: ElasticGroup,
        num_workers: int,
        state: RestorableState,
        policy: FailurePolicy,
        scaling: Optional[ScalingPolicy] = None,
        checkpoints: Optional[Checkpoints] = None,
        cluster: Optional[ClusterView] = None,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_number("restart_timeout_s", restart_timeout_s, above=0)
        self._group = group
        self._num_workers = int(num_workers)
        self._state = state
        self.policy = policy
        self.scaling = scaling if scaling is not None else policy.scaling
        self._checkpoints = checkpoints
        self._cluster = cluster if cluster is not None else RayCluster()
        self._restart_timeout_s = float(restart_timeout_s)
        self._sleep = sleep
        self._drains = Drains(group=group, cluster=self._cluster, checkpoints=checkpoints)
        #: Every event so far (`events`).
        self.log = RecoveryLog()
        #: Every loss so far (`failures`): called with every transition, before the observers.
        self.losses = Losses(self.log, self._cluster)
        self._observers: list[TransitionObserver] = []
        self.phase = Phase.IDLE
        self._moving_off: frozenset[str] = frozenset()  # the MOVING phase's draining nodes
        # Names each train() call, so that a call a failure interrupted is continued, not
        # started again.
        self._call_id = 0
        #: The workers' recent step time: bounds a joining worker's first collectives.
        self._step_s = 0.0
        self._grow_backoff_s = 0.0
        self._next_grow_at = 0.0
        self._join_declined = False  # the scaling policy kept the size at a join: until next call
        #: Guards the calls other than `train()` (a group found broken or left broken by a
        #: failure inside one is repaired: `repair`).
        self.guard = CallGuard(group, self.repair)
        self._in_call = False  # inside a train() call: its losses count against one budget

    # ---------------------------------------------------------------------------- observation
    def subscribe(self, observer: TransitionObserver) -> None:
        """Call `observer` with every transition from now on, after the loss ledger."""
        self._observers.append(observer)

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
        """Worker losses in the current (or last) call."""
        return len(self.losses.this_call)

    @property
    def events(self) -> list[RecoveryEvent]:
        """Every failure, decision and resize so far, oldest first."""
        return self.log.events

    def _enter(self, phase: Phase, **what: Any) -> None:
        """Go to `phase` (the one writer of `self.phase`), telling every observer; `what`: the
        `Transition`'s other fields."""
        if not legal(self.phase, phase):
            # A bug of the controller's, never the user's: said, not raised (the run goes on).
            logger.error(
                "the run went from phase %s to %s, which no path allows", self.phase, phase
            )
        transition = Transition(
            self.phase, phase, self._world_size(), nodes=self._moving_off, **what
        )
        self.phase = phase
        self.losses.account(transition)  # counted before anyone reads the count
        for observer in self._observers:
            observer(transition)

    def _note(self, **what: Any) -> None:
        """Something happened inside the current phase (a worker lost during a resize, say)."""
        self._enter(self.phase, **what)

    # ------------------------------------------------------------------------- a train() call
    def run(self, call: CallSpec) -> list[TrainAnswer]:
        """One `train()` call: grow, move off draining nodes, write the checkpoint asked for, then
        the call's attempts until its work is done; every worker's answer.

        Raises:
            WorkerError: user code raised on a worker (not retried; the group is left usable).
            RuntimeError: the policy gave up; the message names every loss of this call.
        """
        # Every loss from here to the end of the call counts against its `max_retries`: those
        # of a grow, a move or the checkpoint before the attempts, and those after the workers
        # stopped for a spare or a drain.
        self.maybe_grow()
        self._in_call = True
        try:
            return self._run(call)
        finally:
            self._in_call = False

    def _run(self, call: CallSpec) -> list[TrainAnswer]:
        self._drain_check()
        if call.checkpoint:
            self._enter(Phase.CHECKPOINTING)
            started = time.perf_counter()
            assert self._checkpoints is not None
            self.guard.again_once(self._checkpoints.before_call, call.checkpoint)
            self._note(checkpoint_s=time.perf_counter() - started)
        self._call_id += 1
        answers = self._attempts(
            functools.partial(self._attempt, call, self._call_id), call.max_retries
        )
        self._state.after_train(
            max(answer.step for answer in answers), max(answer.epochs for answer in answers)
        )
        self._step_s = max(answer.step_s for answer in answers)
        self._enter(
            Phase.IDLE,
            checkpoint_s=max(answer.blocked_s for answer in answers),
            step_s=self._step_s,
        )
        return answers

    def _attempt(self, call: CallSpec, call_id: int) -> list[TrainAnswer]:
        """One attempt of the call on the group as it is now. After a failure the same call id
        makes the workers go on with the call, not start it again."""
        return self._group.execute(
            worker.train_epoch,
            call.num_steps,
            call.profile,
            call.info,
            call_id,
            watch_spec(self._drains.watched_nodes(), self.joining()),
            self._checkpoints.plan() if self._checkpoints is not None else None,
            self._step_s,
        )

    def run_attempts(self, attempt: Callable[[], T], *, max_retries: int) -> T:
        """Return ``attempt()`` as a call of its own (its losses counted from none): recovering
        from lost workers and redoing the attempt (RUNNING, FAILED, WAITING, RESTARTING,
        GAVE_UP); when the workers stopped together at a step boundary (an answer's
        `stopped_for`), letting the spares join or moving off the draining nodes, and going on
        with another attempt. `max_retries` is handed to the policy, which alone decides when it
        is exhausted.

        Raises:
            WorkerError: user code raised on a worker (not retried; the group is left usable).
            RuntimeError: the policy gave up; the message names every loss of this call.
        """
        return self._attempts(attempt, max_retries, new_count=True)

    def _attempts(
        self, attempt: Callable[[], T], max_retries: int, *, new_count: bool = False
    ) -> T:
        detected_at: Optional[float] = None
        alive, reclaimable, fruitless = self._world_size(), 0, 0
        decision: Optional[Decision] = None
        # An earlier repair failed: the group must be re-formed before anything runs on it.
        self._enter(
            Phase.FAILED if self._group.needs_recovery else Phase.RUNNING, new_count=new_count
        )
        while True:
            if self.phase is Phase.RUNNING:
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
                    reclaimable, fruitless = self._reclaimable(answered), 0
                    self._enter(Phase.FAILED, lost=err, alive=alive)
                    continue
                recovered_s = None if detected_at is None else time.monotonic() - detected_at
                stops = _stopped_for(result)
                if not stops:
                    self._enter(Phase.SUCCEEDED, recovered_s=recovered_s)
                    return result
                if SPARE in stops:
                    self._enter(Phase.JOINING, recovered_s=recovered_s)
                    recovered_s = None
                    self.join_spares()
                if DRAIN in stops:
                    self._drain_check(recovered_s=recovered_s)
                # The rest of the call, at the new size (a loss on the way left it to recover).
                detected_at, alive, reclaimable, fruitless = None, self._world_size(), 0, 0
                self._enter(Phase.FAILED if self._group.needs_recovery else Phase.RUNNING)
            elif self.phase is Phase.FAILED:
                decision = self._decide(
                    max_retries,
                    alive=alive,
                    fitting=self._fitting() + reclaimable,
                    attempt=fruitless,
                )
                self._enter(NEXT_PHASE[decision.action])
            elif self.phase is Phase.WAITING:
                assert decision is not None
                started = time.monotonic()
                self._sleep(decision.wait_s)
                fruitless += 1
                self._enter(Phase.FAILED, waited_s=time.monotonic() - started)
            elif self.phase is Phase.RESTARTING:
                assert decision is not None
                losses = self.failures_this_call
                now, later = split_background(
                    decision,
                    spares_up=len(self._group.spares),
                    spares_starting=self._group.spares_starting,
                )
                if self._resize(now, "failure").ok:
                    if later:
                        self._group.start_spares(later)
                    self._enter(Phase.RUNNING)
                    continue
                # The recover call released the lost workers' slots (the group's own estimate
                # counts them from now on), and the group may have shrunk meanwhile.
                reclaimable, alive = 0, min(alive, self._world_size())
                if self.failures_this_call == losses:
                    fruitless += 1  # nothing started and nothing died: room is still missing
                self._enter(Phase.FAILED)
            else:  # GAVE_UP
                assert decision is not None
                self.losses.give_up(decision.reason, max_retries)

    # ------------------------------------------------------------------------------ growing
    def joining(self) -> list[tuple[Any, ...]]:
        """While the group is below its size: for each spare, the refs that are all done once it
        is up (the workers stop at a step boundary for it to join: `join_spares`)."""
        if self._world_size() >= self._num_workers or self._join_declined:
            return []
        return self._group.spare_readiness()

    def join_spares(self) -> bool:
        """JOINING, at a step boundary inside a call, the group below its size: let the spares
        that are up join, as the scaling policy sizes the grow; the state of this boundary is
        first made restorable (`RestorableState.hand_over`: a sharded state is snapshotted, the
        joining workers take it, and nothing is redone). Returns whether the group grew. A spare
        lost while joining is one more loss; the group is then re-formed at its old size. A
        worker lost in the hand-over is counted and left to the next attempt, which recovers the
        group first."""
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
            self._note(lost=err, alive=current - len(err.ranks))
            return False
        if not self._resize(decision.num_workers, "grow").ok:
            self._resize(max(1, current), "repair after a failed grow")
        return self._world_size() > current

    def maybe_grow(self) -> bool:
        """GROWING, at the start of a `train()` call: grow back towards `num_workers` if the
        scaling policy says so.

        Returns True if the group grew (the new workers took the state of the others). A grow that
        fails is logged and the group is put back to its old size; one that starts no new worker
        (the room the cluster reported was not real) makes later calls skip growing for a while
        (`decide.grow_backoff`), so that a lasting shortage does not slow down every `train()`.
        Neither fails the call.
        """
        self._enter(Phase.GROWING, new_count=True)  # a new train() call starts here
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
        if not self._resize(decision.num_workers, "grow").ok:
            # A new worker failed while joining; the old members may have left their process group
            # already, so re-form at the old size. Should that fail too, the next attempt sees a
            # broken group and the failure path takes over.
            self._resize(max(1, current), "repair after a failed grow")
        if self._world_size() > current:
            self._grow_backoff_s = 0.0
            return True
        self._grow_backoff_s = grow_backoff(self._grow_backoff_s)
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

    # ------------------------------------------------------------------------------- moving
    def _drain_check(self, **what: Any) -> None:
        """Look for drains of the group's nodes and move off them (MOVING). `what`: the
        transition into MOVING's other fields; with them MOVING is entered even when no node
        drains any more (the workers stopped for one)."""
        notice = self._drains.notice()
        if notice is None and not what:
            return
        self._moving_off = frozenset(notice.nodes) if notice is not None else frozenset()
        try:
            self._enter(Phase.MOVING, **what)
            if notice is not None:
                self._move(notice)
        finally:
            self._moving_off = frozenset()

    def _move(self, notice: DrainNotice) -> None:
        """Move every worker and spare off the draining nodes of `notice`."""
        if notice.local_node is not None:
            self.guard.again_once(self._drains.rank0_cannot_move, notice.local_node)
        if not notice.leaving:
            self._group.replace_spares_on(notice.nodes)
            logger.info("replaced the spare worker(s) on draining node(s) %s", list(notice.nodes))
            return
        if not self.move_off(notice.leaving, notice.nodes):
            self._drains.not_moved(notice.nodes)

    def move_off(self, ranks: Sequence[int], nodes: dict[str, Optional[float]]) -> bool:
        """MOVING: move the workers of `ranks` off `nodes` (draining: node -> deadline, None for
        none) before the deadline; every worker has stopped at the same step boundary. Not a
        failure: neither counted nor charged to any retry budget, and recorded as a "preemption"
        event with the steps its resizes redid (0 unless a worker was lost meanwhile).

        Returns False when the workers could not be moved: nothing started in their place (they
        stay, and the node's loss will be an ordinary one), or a worker was lost during the move
        (the node went before the deadline). Such a loss is counted (as a preemption), and the
        group is left for the next attempt to recover, as after any loss.
        """
        previous, self._moving_off = self._moving_off, frozenset(nodes)
        try:
            if self.phase is not Phase.MOVING:
                self._enter(Phase.MOVING)
            return self._move_off(sorted(ranks), nodes)
        finally:
            self._moving_off = previous

    def _move_off(self, leaving: list[int], nodes: dict[str, Optional[float]]) -> bool:
        started = time.monotonic()
        deadlines = [d for d in nodes.values() if d is not None]
        deadline = min(deadlines) if deadlines else None
        where = ", ".join(short_node(n) for n in nodes)
        left = f"{deadline - time.time():.1f} s before the deadline" if deadline else "no deadline"
        before = self._world_size()
        timeout_s = move_timeout(deadline, self._restart_timeout_s, time.time())
        # A spare still starting (a group formed moments ago) is room the scaling policy should
        # see: wait for it, within a part of the time the notice leaves.
        self._group.await_spares(min(SPARE_WAIT_S, timeout_s / 3))
        resizes = []
        if len(leaving) >= before:
            # Everyone is on a draining node: the replacements come in first, while the state is
            # still there to give them.
            self._state.hand_over(leaving)
            grown = self._resize(before + len(leaving), "preemption", timeout_s=timeout_s)
            resizes.append(grown)
            if grown.lost is None and self._world_size() <= before:
                return self._not_moved(
                    leaving,
                    nodes,
                    before,
                    f"every worker is on draining node(s) {where} "
                    f"({left}) and no replacement started: they stay",
                )
        if all(r.lost is None for r in resizes):
            # Sized by the scaling policy once the leaving workers are gone.
            resizes.append(self._resize(None, "preemption", timeout_s=timeout_s, leaving=leaving))
        if any(r.lost is not None for r in resizes) or not resizes[-1].ok:
            return self._not_moved(
                leaving,
                nodes,
                before,
                f"moving rank(s) {leaving} off draining node(s) {where} "
                f"({left}) failed: a worker was lost, or none could start",
            )
        redone = sum(r.steps_redone for r in resizes)
        self.log.record_move(
            leaving,
            nodes,
            left,
            took_s=time.monotonic() - started,
            before=before,
            after=self._world_size(),
            redone=redone,
        )
        return True

    def _not_moved(
        self, leaving: Sequence[int], nodes: dict[str, Optional[float]], before: int, what: str
    ) -> bool:
        """Record a move that did not happen (a warning event of the preemption kind)."""
        self.log.record_not_moved(
            what,
            leaving,
            nodes,
            before=before,
            after=self._world_size(),
            recovering=self._group.needs_recovery,
        )
        return False

    # ------------------------------------------------------------------------------ repairing
    def repair(self, error: Optional[BaseException] = None) -> bool:
        """REPAIRING, after a call other than a train attempt failed with `error`, or found the
        group broken (`error` None): put the group back in shape for the next call.

        A user error (`WorkerError`) is logged and not counted, as in a train call; a lost worker
        (`WorkerDiedError`) is a loss, counted in `failures` and logged. A group that needs it is
        then re-formed at its size (replacements for lost workers where there is room), with the
        restart timeout and restore, and the resize is logged. The policy is not asked: a call
        other than `train()` has no retry budget, and the call itself is not redone here. Returns
        whether the group is usable now; when it is not, the next train call starts by recovering
        it. `StateLostError` from the restore propagates.
        """
        if isinstance(error, WorkerError):
            self._after_user_error(error)
            return not self._group.needs_recovery
        lost = error if isinstance(error, WorkerDiedError) else None
        alive = None if lost is None else max(0, self._world_size() - len(lost.ranks))
        # A call of its own, unless it is part of a train() call (a checkpoint it writes).
        self._enter(Phase.REPAIRING, new_count=not self._in_call, lost=lost, alive=alive)
        if not self._group.needs_recovery:
            return True
        repaired = self._resize(max(1, self._world_size()), "repair after a failed call").ok
        self._enter(Phase.SUCCEEDED if repaired else Phase.FAILED)
        if not repaired:
            logger.warning(
                "the worker group could not be repaired after a failed call; the next train() "
                "recovers it"
            )
        return repaired

    def _after_user_error(self, err: WorkerError) -> None:
        """Log a user error and repair the group (same size, last good state) without counting it."""
        self.log.record_user_error(err)
        self._enter(Phase.REPAIRING)
        if not self._group.needs_recovery:
            return
        # The raising rank left its process group to release peers blocked in a collective: re-form
        # at the same size, every worker at the last step the group finished, so that the next
        # call starts from a consistent model. This is housekeeping, not a loss of the user's
        # run: a worker lost meanwhile is logged, not counted.
        result = self._resize(
            max(1, self._world_size()), "repair after a user error", counted=False
        )
        if not result.ok:
            logger.warning("the worker group could not be repaired after the user error above")

    # ------------------------------------------------------------------------------ resizing
    def _resize(
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
        state restored on the new group. `num_workers` None: as the scaling policy sizes a move,
        asked once the leaving workers are gone (their room then counts). Every event is derived
        from the returned result.

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
                alive = before - len(leaving)
                sized = self._size("preemption", running=alive, fitting=self._fitting())
                target = max(1, sized.num_workers)
            report = self._group.recover(
                target,
                timeout_s=timeout_s if timeout_s is not None else self._restart_timeout_s,
            )
            formed = time.monotonic()
            if report.found_lost:
                self._note(
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
        self.log.record_resize(result)
        if lost is not None:
            self._note(lost=lost, during_restart=True, counted=counted)
        return result

    # ----------------------------------------------------------------------------- deciding
    def _size(self, moment: str, *, running: int, fitting: int) -> ScalingDecision:
        """Ask the scaling policy for the group's size at `moment`, logged as a decision."""
        wanted = self._num_workers
        status = ScalingStatus(
            moment=moment,
            workers_wanted=wanted,
            workers_running=max(0, min(running, wanted)),
            workers_fitting=max(0, fitting),
            seconds_since_last_failure=self.losses.seconds_since_last(),
        )
        answer, decision = decide_size(self.scaling, status)
        self.log.record(
            EventKind.DECISION,
            f"scaling {self.scaling.name!r} ({moment}: wanted {wanted}, running "
            f"{status.workers_running}, fitting {status.workers_fitting}) -> {answer}",
            action=Action.RETRY.value,
            num_workers_before=status.workers_running,
            num_workers_after=decision.num_workers,
        )
        return decision

    def _decide(self, max_retries: int, *, alive: int, fitting: int, attempt: int = 0) -> Decision:
        """Ask the failure policy what to do after this call's losses, logged as a decision."""
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
        decision = decide_failure(self.policy, status)
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

    def _reclaimable(self, nodes: Sequence[str]) -> int:
        """How many lost workers' slots are free again at once (their node lives on)."""
        try:
            return max(0, int(self._cluster.live_count(nodes)))
        except Exception:  # no answer: count nothing, the group's estimate decides
            logger.debug("counting reclaimable slots failed", exc_info=True)
            return 0


def _stopped_for(result: Any) -> set[str]:
    """Why the workers of a train attempt stopped together at a step boundary (empty: they did
    not; the call's work is done)."""
    if not isinstance(result, list):
        return set()
    return {a.stopped_for for a in result if isinstance(a, TrainAnswer)} - {None}
