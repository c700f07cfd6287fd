"""The recovery loop around one `TorchTrainer.train()` call: detect, decide, resize, restore, redo.

The protocol, RaySGD's fault tolerance in this module's terms:

1. ``attempt()`` runs one train call on the current worker group. A lost actor or node surfaces at
   once as `WorkerDiedError` (the group sees the dead actor; nobody waits for a collective timeout).
2. The loss is counted and logged, and the failure policy (`raysgd_fault`) is asked what to do, given
   how many workers are wanted, alive, and could start now.
3. RETRY: ``group.recover(k)`` drops the broken process group, keeps healthy workers where it can
   (its report says "keep-healthy" or "full-restart"), starts replacements and re-forms the group.
   The trainer then re-binds runners, re-splits the global batch and loads the last good state, and
   the interrupted epoch is redone, so the result equals a run without the failure.
   WAIT: sleep (the policy's exponential backoff) and ask again. GIVE_UP: `RuntimeError` naming every
   loss seen in this call.
4. A restart that itself fails (a new worker dies or raises in its init hook, a survivor dies while
   re-forming) is one more loss and goes back to step 2; a restart that starts no worker is an empty
   round (the policy backs off on those).

Errors raised by user code (`WorkerError`) are never retried: they reach the caller unchanged, with the
worker's traceback; the group is only repaired (same size, last good state) so the trainer stays usable.

Deliberate differences from RaySGD 1.x's recovery: the group is sized in workers (not raw CPUs),
growth is asked of the policy at the start of every `train()`, and survivors are re-joined instead of
killed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar

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
from raysgd_core import WorkerDiedError, WorkerError
from raysgd_fault import Action, Decision, FailurePolicy, FailureStatus

__all__ = [
    "DEFAULT_RESTART_TIMEOUT_S",
    "GROW_BACKOFF_S",
    "MAX_EMPTY_ROUNDS",
    "MAX_GROW_BACKOFF_S",
    "Recovery",
]

logger = logging.getLogger("raysgd.recovery")

T = TypeVar("T")

#: Bound on one ``group.recover`` call: how long new workers may take to start (those that do not
#: are dropped and the group goes on smaller). Dead workers are reported long before this.
DEFAULT_RESTART_TIMEOUT_S = 30.0

#: Hard cap on consecutive empty rounds (WAIT, or a restart that started no worker) in one recovery,
#: whatever the policy says: a policy that never gives up must not hang `train()` forever. v1 used 10.
MAX_EMPTY_ROUNDS = 10

#: After a grow that started no new worker, skip growing for this long, doubling up to the maximum.
GROW_BACKOFF_S = 30.0
MAX_GROW_BACKOFF_S = 600.0


class Recovery:
    """Runs train attempts for a `TorchTrainer`, recovering from lost workers as its policy decides.

    Args:
        trainer: The owning trainer, used through its seams: ``_group`` (the `WorkerGroup`),
            ``_num_workers`` (the size asked for) and ``_restore_after_resize(report)``.
        policy: The failure policy deciding retry / wait / give up and the group size.
        restart_timeout_s: Bound on one ``group.recover`` call (see `DEFAULT_RESTART_TIMEOUT_S`).
        sleep: How WAIT decisions sleep (injectable so that an embedding driver can interrupt waits).
    """

    def __init__(
        self,
        *,
        trainer: Any,
        policy: FailurePolicy,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not restart_timeout_s > 0:
            raise ValueError(f"restart_timeout_s must be > 0, got {restart_timeout_s!r}")
        self._trainer = trainer
        self.policy = policy
        self._restart_timeout_s = float(restart_timeout_s)
        self._sleep = sleep
        self._log = RecoveryLog()
        self._total_failures = 0
        self._call_failures: list[FailureRecord] = []
        self._last_failure_at: Optional[float] = None
        self._last_error: Optional[BaseException] = None  # chained to the give-up RuntimeError
        self._grow_backoff_s = 0.0
        self._next_grow_at = 0.0

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

        Raises:
            WorkerError: user code raised on a worker (not retried; the group is left usable).
            RuntimeError: the policy gave up or `max_retries` ran out; the message names every loss.
            TypeError / ValueError: `max_retries` is not an int >= 0.
        """
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            raise TypeError(f"max_retries must be an int, got {type(max_retries).__name__}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._call_failures, self._last_error = [], None
        if self._trainer._group.needs_recovery:  # an earlier repair failed: re-form first
            self._recover(max_retries, alive=self._size(), reclaimable=0)
        detected_at: Optional[float] = None
        while True:
            try:
                result = attempt()
            except WorkerError as err:
                self._after_user_error(err)
                raise
            except WorkerDiedError as err:
                detected_at = detected_at or time.monotonic()
                alive = max(0, self._size() - len(err.ranks))
                self._note_loss(err.ranks, err.nodes, err, during_restart=False, alive=alive)
                self._recover(max_retries, alive=alive, reclaimable=_on_live_nodes(err.nodes))
                continue
            if detected_at is not None:
                took = time.monotonic() - detected_at
                self._log.record(
                    EventKind.RECOVERED,
                    f"recovered: the interrupted work was redone on {self._size()} worker(s); "
                    f"{took:.2f} s from detecting the failure to the end of the redone call",
                    duration_s=took,
                    num_workers_after=self._size(),
                )
            return result

    def maybe_grow(self, *, max_retries: int = 0) -> bool:
        """At the start of `train()`: grow back towards `num_workers` if the policy says so.

        The trainer must have captured the current state first (the grow restores it everywhere).
        Returns True if the group grew. A grow that fails is logged and the group is put back to its
        old size; one that starts no new worker (the room the cluster reported was not real) makes
        later calls skip growing for a while (doubling, `GROW_BACKOFF_S` up to `MAX_GROW_BACKOFF_S`),
        so that a lasting shortage does not slow down every `train()`. Neither fails the call.
        """
        self._call_failures = []  # a new train() call starts here
        wanted, current = self._wanted(), self._size()
        if current >= wanted or time.monotonic() < self._next_grow_at:
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
        if self._size() > current:
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
            num_workers_after=self._size(),
        )
        return False

    def _recover(self, max_retries: int, *, alive: int, reclaimable: int) -> None:
        """Ask the policy until a resize succeeds; raise RuntimeError when it gives up.

        `alive` is the survivors' count and `reclaimable` how many of the lost workers' reserved
        slots are on live nodes (a killed actor frees a slot that `recover` can reuse at once, but
        the cluster's free resources do not show it yet).
        """
        empty_rounds = 0
        while True:
            if self.failures_this_call > max_retries:
                self._give_up(f"retry budget exhausted (max_retries={max_retries})", max_retries)
            if empty_rounds >= MAX_EMPTY_ROUNDS:
                self._give_up(f"no worker could be started in {empty_rounds} rounds", max_retries)
            decision = self._decide(
                max_retries,
                alive=alive,
                fitting=self._fitting() + reclaimable,
                phase="failure",
                attempt=empty_rounds,
            )
            if decision.action is Action.GIVE_UP:
                self._give_up(decision.reason, max_retries)
            if decision.action is Action.WAIT:
                self._sleep(decision.wait_s)
                empty_rounds += 1
                continue
            losses = self.failures_this_call
            if self._resize(decision.num_workers, why="failure"):
                return
            # Slots of workers lost so far were released by the recover call (the group's own
            # estimate counts them from now on), and the group may have shrunk meanwhile.
            reclaimable, alive = 0, min(alive, self._size())
            if self.failures_this_call == losses:
                empty_rounds += 1  # nothing started and nothing died: room is still missing

    def _resize(self, target: int, *, why: str) -> bool:
        """`group.recover(target)` and restore the state there; False (logged) if it failed."""
        trainer, before = self._trainer, self._size()
        started = time.monotonic()
        try:
            report = trainer._group.recover(target, timeout_s=self._restart_timeout_s)
            formed = time.monotonic()
            if report.world_size < 1:
                self._log.record(
                    EventKind.RESTART_FAILED,
                    f"restart ({why}) asked for {target} worker(s) but none started "
                    f"({formed - started:.2f} s)",
                    level=logging.WARNING,
                    duration_s=formed - started,
                    num_workers_before=before,
                    num_workers_after=0,
                )
                return False
            trainer._restore_after_resize(report)
        except Exception as err:  # any error while restarting is one more loss, retried
            logger.debug("restart (%s) failed", why, exc_info=True)
            ranks, nodes = where_lost(err)
            self._note_loss(ranks, nodes, err, during_restart=True, alive=None)
            return False
        done = time.monotonic()
        self._log.record(
            EventKind.RESIZE,
            f"resized ({why}) {before} -> {report.world_size} worker(s) via {report.path} in "
            f"{done - started:.2f} s (re-form group {formed - started:.2f} s, restore state "
            f"{done - formed:.2f} s); {describe_report(report)}",
            duration_s=done - started,
            num_workers_before=before,
            num_workers_after=report.world_size,
            path=report.path,
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
        if not self._trainer._group.needs_recovery:
            return
        # The raising rank left its process group to release peers blocked in a collective, and the
        # workers hold a half-done epoch: re-form at the same size and roll back to the last good
        # state, so that the next call starts from a consistent model. This is housekeeping, not a
        # loss of the user's run, so it is not counted.
        counters = (self._total_failures, list(self._call_failures), self._last_failure_at)
        last_error = self._last_error
        if not self._resize(max(1, self._size()), why="repair after a user error"):
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
    ) -> None:
        record = FailureRecord(tuple(ranks), tuple(nodes), short_error(err), during_restart)
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
            num_workers_before=self._size(),
            num_workers_after=alive,
        )

    def _decide(
        self, max_retries: int, *, alive: int, fitting: int, phase: str, attempt: int = 0
    ) -> Decision:
        wanted = self._wanted()
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

    def _wanted(self) -> int:
        return int(self._trainer._num_workers)

    def _size(self) -> int:
        # `world_size` is the live size; the group's `num_workers` stays what it was built with.
        return int(self._trainer._group.world_size)

    def _fitting(self) -> int:
        try:
            return max(0, int(self._trainer._group.estimate_fitting()))
        except Exception:  # an estimate must never break recovery: assume room, starts decide
            logger.debug("estimate_fitting failed", exc_info=True)
            return self._wanted()


def _on_live_nodes(nodes: Sequence[str]) -> int:
    """How many of `nodes` (one entry per lost worker) Ray still reports alive."""
    if not nodes:
        return 0
    try:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # no answer from the GCS: count nothing, the group's estimate decides
        logger.debug("ray.nodes() failed", exc_info=True)
        return 0
    return sum(1 for node in nodes if node in alive)
