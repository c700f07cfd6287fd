"""Waiting for the ranks of one call and turning what went wrong into one typed error.

The rule that keeps callers from hanging: results are awaited with `ray.wait`, so a dead actor is
seen as soon as Ray knows (no collective timeout involved). At the first failure (an actor gone,
user code raising, a collective that waited out its bound) every rank still running has its
group's collectives aborted (`abort.py`), so the ranks waiting in one for a lost peer return at
once, at any group size, and keep their process and state. They get a grace to finish or fail on
their own, for work that is not a collective (a checkpoint being written, say). Once a rank
reports that a collective waited out its bound, the ranks that still have not answered a short
while later are the silent ones: they are killed and reported lost, without waiting for Ray to
notice (a frozen node stays "alive" for as long as its health checks take). A wait given a
liveness `Wait` also probes the ranks it waits for (`liveness.py`): one that answers no probe within
its bound is silent too, whatever it was doing, and is killed the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from raysgd_core._internal.liveness import Wait
from raysgd_core._internal.runtime import Failure, is_collateral, is_peer_timeout
from raysgd_core.errors import WorkerDiedError, WorkerError
from raysgd_core.options import DEFAULT_PEER_GRACE_S

__all__ = ["GRACE_S", "Outcome", "collect", "failure_to_error", "raise_for"]

logger = logging.getLogger("raysgd_core")

# How long peers of a failed rank may take to come back before they are killed, when nothing
# longer is asked for; also the wait, after a rank timed out in a collective, for the other ranks
# waiting in that collective to time out too.
GRACE_S = DEFAULT_PEER_GRACE_S


@dataclass
class Outcome:
    """What came back from one call on several ranks."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    died: dict[int, str] = field(default_factory=dict)  # rank -> Ray's reason
    preempted: set[int] = field(default_factory=set)  # died ranks Ray marked as preempted
    killed: list[int] = field(default_factory=list)  # stuck after a failure, killed by us
    #: The ranks in `killed` were silent: a peer's collective waited out its bound for them.
    silent: bool = False

    @property
    def ok(self) -> bool:
        return not (self.failures or self.died or self.killed)

    def add_failure(self, failure: Failure) -> None:
        self.failures.append(failure)


def collect(
    pending: dict[Any, int],
    outcome: Outcome,
    *,
    kill: Callable[[int], None],
    grace_s: float = GRACE_S,
    abort: Optional[Callable[[list[int]], None]] = None,
    liveness: Optional[Wait] = None,
) -> Outcome:
    """Wait for every ref in `pending` (ref -> rank) and record results and failures in `outcome`.

    At the first failure, `abort(ranks)` is called with the ranks still running (see the module
    docstring); they get `grace_s`; after a rank reports a peer timeout, at most `GRACE_S` more.
    Those left are killed: `kill(rank)`. With `liveness`, a rank found silent by its probes
    (including one found before this call, in `liveness.silent`) is killed at once."""
    import ray
    from ray.exceptions import RayActorError

    pending = dict(pending)
    deadline: Optional[float] = None if outcome.ok else time.monotonic() + grace_s
    aborted = False
    # A rank reported that a collective waited out its bound: the peer it waited for is silent.
    waited_out = False
    while pending:
        if liveness is not None:
            _kill_silent(pending, outcome, liveness, kill)
            if not pending:
                break
        if not aborted and not outcome.ok and abort is not None:
            aborted = True
            abort(sorted(pending.values()))
        if deadline is None and not outcome.ok:
            deadline = time.monotonic() + grace_s
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if liveness is not None:
            timeout = (
                liveness.every_s / 2 if timeout is None else min(timeout, liveness.every_s / 2)
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not ready and (deadline is None or time.monotonic() < deadline):
            continue  # only a liveness poll is due
        if not ready:
            for rank in pending.values():
                if waited_out:
                    logger.warning(
                        "rank %d did not answer: a peer's collective waited out its bound for "
                        "it; killing it",
                        rank,
                    )
                else:
                    logger.warning(
                        "rank %d still running %.1fs after a failure: killing it", rank, grace_s
                    )
                kill(rank)
                outcome.killed.append(rank)
            outcome.silent = outcome.silent or waited_out
            break
        timed_out = own = False
        for ref in ready:
            rank = pending.pop(ref)
            try:
                value = ray.get(ref)
            except RayActorError as exc:
                outcome.died[rank] = _first_line(str(exc))
                if getattr(exc, "preempted", False):
                    outcome.preempted.add(rank)
            except Exception as exc:  # e.g. fn or an argument could not be unpickled there
                outcome.add_failure(_failure_from_ray_error(rank, exc))
            else:
                if isinstance(value, Failure):
                    value.rank = rank
                    outcome.add_failure(value)
                    timed_out = timed_out or value.peer_timeout
                    own = own or not value.collateral
                else:
                    outcome.results[rank] = value
        now = time.monotonic()
        if deadline is None and not outcome.ok:
            deadline = now + grace_s
        if own:
            # User code raised: that rank is alive and holds the state, and its peers were let out
            # of their collectives (the abort): they are not waited for past the short grace.
            deadline = min(deadline, now + min(grace_s, GRACE_S))
        waited_out = waited_out or timed_out
        if waited_out and not outcome.died:
            # The peers waiting in the same collective time out within moments of this one;
            # whoever is still running after that is the peer they were waiting for, and so is
            # the last rank left. Not so once a rank is known to be gone: the waits were for
            # it, and the ranks still running wait for it too, each up to its own bound (they
            # keep the grace of the first failure). With probes, a rank that answers them is not
            # silent, whatever it waits for (a copy to a peer, bounded by the slow bound): it
            # gets the short grace after the abort, and the probes find the silent ones.
            outcome.silent = True
            assert deadline is not None
            last = len(pending) == 1 and liveness is None
            deadline = now if last else min(deadline, now + min(grace_s, GRACE_S))
    return outcome


def _kill_silent(
    pending: dict[Any, int],
    outcome: Outcome,
    liveness: Wait,
    kill: Callable[[int], None],
) -> None:
    """Kill the ranks of `pending` that `liveness` finds silent (and those it found before)."""
    liveness.poll(pending.values())
    for ref, rank in list(pending.items()):
        if rank in liveness.silent:
            logger.warning(
                "rank %d answered no liveness probe for %.1fs (stopped, frozen or cut off): "
                "killing it",
                rank,
                liveness.silent[rank],
            )
            kill(rank)
            del pending[ref]
            outcome.killed.append(rank)
            outcome.silent = True


def failure_to_error(failure: Failure, lost_ranks: Sequence[int] = ()) -> WorkerError:
    """A `WorkerError` for `failure`, with the original exception as `__cause__` when possible."""
    message = (
        f"rank {failure.rank} (node {failure.node_id}) raised {failure.message}\n\n"
        f"Traceback on the worker:\n{failure.traceback}"
    )
    if lost_ranks:
        message += f"\nRanks {sorted(lost_ranks)} were lost after this failure; call recover()."
    error = WorkerError(message, failure.rank, failure.node_id, failure.traceback, lost_ranks)
    cause = failure.exception()
    if cause is not None:
        error.__cause__ = cause
    return error


class _Member(Protocol):
    """What `raise_for` needs of the driver's record of a rank (`workers.Worker`)."""

    alive: bool

    @property
    def node_id(self) -> str: ...


def raise_for(outcome: Outcome, member: Callable[[int], Optional[_Member]]) -> None:
    """Raise the one error that best explains `outcome` (nothing when every rank succeeded);
    `member(rank)` is the record of the rank the outcome calls `rank` (None: unknown).

    A user exception explains everything else (peers' "connection closed" errors, ranks killed while
    stuck), so it wins; then deaths; a lone process-group error (no other cause known) comes last.
    Every rank that died is marked not alive first: its loss is reported here, so a later
    `recover` does not take it for one nobody reported (`RecoveryReport.found_lost`).
    """
    if outcome.ok:
        return
    for rank in outcome.died:
        record = member(rank)
        if record is not None:
            record.alive = False

    def node_of(rank: int) -> str:
        record = member(rank)
        return record.node_id if record is not None else "?"

    lost = sorted(set(outcome.died) | set(outcome.killed))
    own = sorted((f for f in outcome.failures if not f.collateral), key=lambda f: f.time)
    if own:
        raise failure_to_error(own[0], lost)
    if lost:
        parts = [
            f"rank {r} (node {node_of(r)}) died: {outcome.died[r]}" for r in sorted(outcome.died)
        ]
        if outcome.killed and outcome.silent:
            parts.append(
                f"ranks {sorted(outcome.killed)} stopped answering (a stopped process, a frozen "
                "or cut-off node: no answer to the driver's probes, or their peers waited out a "
                "collective's bound for them) and were killed"
            )
        elif outcome.killed:
            parts.append(
                f"ranks {sorted(outcome.killed)} were stuck after the failure and were killed"
            )
        raise WorkerDiedError(
            "Workers lost: " + "; ".join(parts) + ". Call recover() to replace them.",
            lost,
            [node_of(r) for r in lost],
            sorted(outcome.preempted),
            sorted(outcome.killed) if outcome.silent else (),
        )
    first = min(outcome.failures, key=lambda f: f.time)
    raise failure_to_error(first)


def _failure_from_ray_error(rank: int, exc: Exception) -> Failure:
    """A failure Ray reported as an error of the call itself (the group's own calls, such as
    forming the process group, raise rather than return a `Failure`); one caused by a peer is
    collateral as in `WorkerRuntime.run`."""
    cause = getattr(exc, "cause", None)
    text = str(exc)
    return Failure(
        rank=rank,
        node_id="?",
        type_name=type(cause or exc).__qualname__,
        message=_first_line(text),
        traceback=text,
        exception_bytes=None,
        collateral=is_collateral(text),
        time=time.time(),
        peer_timeout=is_peer_timeout(text),
    )


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else text
