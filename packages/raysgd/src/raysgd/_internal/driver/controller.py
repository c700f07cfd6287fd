"""The run controller: the one loop that owns every transition of the trainer's run.

It works on narrow views (`group_view`: the worker group, the training state, the cluster) and
owns its parts, each in a module of its own: the policies as it asks them (`policies.Policies`;
what their answers mean is `decide`'s, pure), the resizes (`resize.Resizer`: the only code that
changes the group), growing back (`growth.Growth`) and moving off draining nodes
(`drains.Moves`). The controller alone writes the phase; its parts enter phases through it. Its
phases (`phases.Phase`):

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
are recorded in the event log (`log`) by the controller and its parts, which the loggers and
goodput read.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, TypeVar, Union

from raysgd._internal.driver.checkpoints import Checkpoints
from raysgd._internal.driver.decide import count_fruitless, split_background, watch_spec
from raysgd._internal.driver.drains import Drains, Moves
from raysgd._internal.driver.events import RecoveryEvent, RecoveryLog
from raysgd._internal.driver.group_view import (
    ClusterView,
    ElasticGroup,
    RayCluster,
    RestorableState,
)
from raysgd._internal.driver.growth import Growth
from raysgd._internal.driver.guard import CallGuard, in_one_form
from raysgd._internal.driver.losses import Losses
from raysgd._internal.driver.phases import (
    NEXT_PHASE,
    Phase,
    Transition,
    TransitionObserver,
    legal,
)
from raysgd._internal.driver.policies import Policies
from raysgd._internal.driver.resize import DEFAULT_RESTART_TIMEOUT_S, Resizer
from raysgd._internal.protocol import DRAIN, SPARE, TrainAnswer
from raysgd._internal.worker import calls as worker
from raysgd_base import check_number
from raysgd_core import WorkerDiedError, WorkerError
from raysgd_fault import Decision, FailurePolicy, ScalingPolicy

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
        self._checkpoints = checkpoints
        self._cluster = cluster if cluster is not None else RayCluster()
        self._sleep = sleep
        self._drains = Drains(group=group, cluster=self._cluster, checkpoints=checkpoints)
        #: Every event so far (`events`).
        self.log = RecoveryLog()
        #: Every loss so far (`failures`): called with every transition, before the observers.
        self.losses = Losses(self.log, self._cluster)
        self._observers: list[TransitionObserver] = []
        self.phase = Phase.IDLE
        #: The failure and scaling policies, asked with what the run knows.
        self.policies = Policies(
            policy,
            scaling if scaling is not None else policy.scaling,
            num_workers=num_workers,
            losses=self.losses,
            log=self.log,
        )
        #: Every resize of the group (the one code that changes it).
        self.resizer = Resizer(
            group=group,
            state=state,
            policies=self.policies,
            log=self.log,
            run=self,
            restart_timeout_s=restart_timeout_s,
        )
        #: Growing back to `num_workers`: at a call's start, and spares joining inside one.
        self.growth = Growth(
            group=group,
            state=state,
            policies=self.policies,
            resizer=self.resizer,
            log=self.log,
            run=self,
        )
        #: Guards the calls other than `train()` (a group found broken or left broken by a
        #: failure inside one is repaired: `repair`).
        self.guard = CallGuard(group, self.repair)
        #: Moving off draining nodes.
        self.moves = Moves(
            group=group,
            state=state,
            drains=self._drains,
            resizer=self.resizer,
            guard=self.guard,
            log=self.log,
            run=self,
        )
        # Names each train() call, so that a call a failure interrupted is continued, not
        # started again.
        self._call_id = 0
        #: The workers' recent step time: bounds a joining worker's first collectives.
        self._step_s = 0.0
        self._in_call = False  # inside a train() call: its losses count against one budget

    # ---------------------------------------------------------------------------- observation
    def subscribe(self, observer: TransitionObserver) -> None:
        """Call `observer` with every transition from now on, after the loss ledger."""
        self._observers.append(observer)

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

    def enter(self, phase: Phase, **what: Any) -> None:
        """Go to `phase` (the one writer of `self.phase`), telling every observer; `what`: the
        `Transition`'s other fields."""
        if not legal(self.phase, phase):
            # A bug of the controller's, never the user's: said, not raised (the run goes on).
            logger.error(
                "the run went from phase %s to %s, which no path allows", self.phase, phase
            )
        transition = Transition(
            self.phase, phase, self._world_size(), nodes=self.moves.moving_off, **what
        )
        self.phase = phase
        self.losses.account(transition)  # counted before anyone reads the count
        for observer in self._observers:
            observer(transition)

    def note(self, **what: Any) -> None:
        """Something happened inside the current phase (a worker lost during a resize, say)."""
        self.enter(self.phase, **what)

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
        self.growth.maybe_grow()
        self._in_call = True
        try:
            return self._run(call)
        finally:
            self._in_call = False

    def _run(self, call: CallSpec) -> list[TrainAnswer]:
        self.moves.check()
        if call.checkpoint:
            self.enter(Phase.CHECKPOINTING)
            started = time.perf_counter()
            assert self._checkpoints is not None
            self.guard.again_once(self._checkpoints.before_call, call.checkpoint)
            self.note(checkpoint_s=time.perf_counter() - started)
        self._call_id += 1
        answers = self._attempts(
            functools.partial(self._attempt, call, self._call_id), call.max_retries
        )
        self._state.after_train(
            max(answer.step for answer in answers), max(answer.epochs for answer in answers)
        )
        self._step_s = max(answer.step_s for answer in answers)
        self.enter(
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
            watch_spec(self._drains.watched_nodes(), self.growth.joining()),
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
        """The loop of a call's phases: each handler does its phase's work and names the next
        phase with its payload; RUNNING's returns the call's result once its work is done."""
        carried = _Carried(max_retries, alive=self._world_size())
        # An earlier repair failed: the group must be re-formed before anything runs on it.
        self.enter(
            Phase.FAILED if self._group.needs_recovery else Phase.RUNNING, new_count=new_count
        )
        handlers = {
            Phase.FAILED: self._failed,
            Phase.WAITING: self._waiting,
            Phase.RESTARTING: self._restarting,
            Phase.GAVE_UP: self._gave_up,
        }
        while True:
            if self.phase is Phase.RUNNING:
                outcome = self._running(attempt, carried)
                if not isinstance(outcome, _Next):
                    return outcome
            else:
                outcome = handlers[self.phase](carried)
            self.enter(outcome.phase, **outcome.what)

    def _running(self, attempt: Callable[[], T], carried: _Carried) -> Union[T, _Next]:
        """RUNNING: an attempt of the call; its result once the call's work is done (SUCCEEDED
        entered), else the next phase (FAILED after a loss; RUNNING again after the workers
        stopped for spares to join or to move off a draining node)."""
        try:
            result = attempt()
        except WorkerError as err:
            self._after_user_error(err)
            raise in_one_form(err)  # noqa: B904 (its cause is the user's exception)
        except WorkerDiedError as err:
            carried.detected_at = carried.detected_at or time.monotonic()
            carried.alive = max(0, self._world_size() - len(err.ranks))
            # A silent rank's node may be frozen: its room is not counted on.
            answered = [n for r, n in zip(err.ranks, err.nodes) if r not in err.silent]
            carried.reclaimable, carried.fruitless = self._reclaimable(answered), 0
            return _Next(Phase.FAILED, lost=err, alive=carried.alive)
        recovered_s = (
            None if carried.detected_at is None else time.monotonic() - carried.detected_at
        )
        stops = _stopped_for(result)
        if not stops:
            self.enter(Phase.SUCCEEDED, recovered_s=recovered_s)
            return result
        if SPARE in stops:
            self.enter(Phase.JOINING, recovered_s=recovered_s)
            recovered_s = None
            self.growth.join_spares()
        if DRAIN in stops:
            self.moves.check(recovered_s=recovered_s)
        # The rest of the call, at the new size (a loss on the way left it to recover).
        carried.since_success(self._world_size())
        return _Next(Phase.FAILED if self._group.needs_recovery else Phase.RUNNING)

    def _failed(self, carried: _Carried) -> _Next:
        """FAILED: the failure policy answers this call's losses (RESTARTING, WAITING, GAVE_UP)."""
        carried.decision = self.policies.after_losses(
            carried.max_retries,
            alive=carried.alive,
            fitting=self.policies.room(self._group) + carried.reclaimable,
            attempt=carried.fruitless,
        )
        return _Next(NEXT_PHASE[carried.decision.action])

    def _waiting(self, carried: _Carried) -> _Next:
        """WAITING: the policy's backoff, then FAILED again (the policy is asked anew)."""
        assert carried.decision is not None
        started = time.monotonic()
        self._sleep(carried.decision.wait_s)
        carried.fruitless = count_fruitless(carried.fruitless, started=False, lost=False)
        return _Next(Phase.FAILED, waited_s=time.monotonic() - started)

    def _restarting(self, carried: _Carried) -> _Next:
        """RESTARTING: re-form the group as the policy said (replacements started beside it when
        it said so) and restore its state: RUNNING, or FAILED when the resize failed."""
        assert carried.decision is not None
        losses = self.failures_this_call
        now, later = split_background(
            carried.decision,
            spares_up=len(self._group.spares),
            spares_starting=self._group.spares_starting,
        )
        if self.resizer.resize(now, "failure").ok:
            if later:
                self._group.start_spares(later)
            return _Next(Phase.RUNNING)
        # The recover call released the lost workers' slots (the group's own estimate counts
        # them from now on), and the group may have shrunk meanwhile.
        carried.reclaimable, carried.alive = 0, min(carried.alive, self._world_size())
        carried.fruitless = count_fruitless(
            carried.fruitless, started=False, lost=self.failures_this_call > losses
        )
        return _Next(Phase.FAILED)

    def _gave_up(self, carried: _Carried) -> NoReturn:
        """GAVE_UP: the call raises, naming every loss."""
        assert carried.decision is not None
        self.losses.give_up(carried.decision.reason, carried.max_retries)

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
        self.enter(Phase.REPAIRING, new_count=not self._in_call, lost=lost, alive=alive)
        if not self._group.needs_recovery:
            return True
        repaired = self.resizer.resize(max(1, self._world_size()), "repair after a failed call").ok
        self.enter(Phase.SUCCEEDED if repaired else Phase.FAILED)
        if not repaired:
            logger.warning(
                "the worker group could not be repaired after a failed call; the next train() "
                "recovers it"
            )
        return repaired

    def _after_user_error(self, err: WorkerError) -> None:
        """Log a user error and repair the group (same size, last good state) without counting it."""
        self.log.record_user_error(err)
        self.enter(Phase.REPAIRING)
        if not self._group.needs_recovery:
            return
        # The raising rank left its process group to release peers blocked in a collective: re-form
        # at the same size, every worker at the last step the group finished, so that the next
        # call starts from a consistent model. This is housekeeping, not a loss of the user's
        # run: a worker lost meanwhile is logged, not counted.
        result = self.resizer.resize(
            max(1, self._world_size()), "repair after a user error", counted=False
        )
        if not result.ok:
            logger.warning("the worker group could not be repaired after the user error above")

    def _world_size(self) -> int:
        return int(self._group.world_size)

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


class _Next:
    """The phase a handler goes to, with the payload of its transition (`Transition`'s fields)."""

    __slots__ = ("phase", "what")

    def __init__(self, phase: Phase, **what: Any) -> None:
        self.phase = phase
        self.what = what


@dataclass
class _Carried:
    """What a call's phases carry from one to the next."""

    max_retries: int
    #: Workers alive after the last loss.
    alive: int
    #: When the first loss since the last success was seen (None: none since).
    detected_at: Optional[float] = None
    #: The lost workers' slots that are free again at once (their nodes live on).
    reclaimable: int = 0
    #: Restarts and waits that came to nothing since the last loss (`decide.count_fruitless`).
    fruitless: int = 0
    #: The failure policy's last answer.
    decision: Optional[Decision] = None

    def since_success(self, alive: int) -> None:
        """A part of the call succeeded: losses are counted from none again."""
        self.detected_at, self.alive, self.reclaimable, self.fruitless = None, alive, 0, 0
