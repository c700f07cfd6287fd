"""`WorkerGroup.recover`: keep the healthy workers, replace the rest, re-form the process group.

Two paths. "keep-healthy": ping every worker with a short timeout (a worker stuck in a collective
does not answer and is killed), drop the dead, start the replacements and, while they come up, make
the survivors leave the old process group; then form a new group over survivors + new ones.
Survivors keep their process, so their `store` (the trainer's runner, the model) is kept. Spare
workers that are up replace lost ones before any new actor is started. If that fails,
"full-restart": kill every remote worker (and the spares) and start all of them anew. Either way
the spares are started again once the group is formed.

Everything here works on a `RunningGroup` (what runs) and its `GroupSpec` (what to run).
"""

from __future__ import annotations

import logging
import time

from raysgd_core import kept
from raysgd_core._internal import spares
from raysgd_core._internal.failures import Outcome, collect, raise_for
from raysgd_core._internal.running import RunningGroup
from raysgd_core._internal.workers import (
    Worker,
    await_started,
    run_hooks,
    spawn,
)
from raysgd_core.errors import WorkerDiedError, WorkerError
from raysgd_core.info import RecoveryReport

__all__ = ["recover"]

logger = logging.getLogger("raysgd_core")

# A healthy idle actor answers a ping in milliseconds; this leaves room for a loaded machine.
PING_TIMEOUT_S = 5.0


def recover(running: RunningGroup, num_workers: int, timeout_s: float) -> RecoveryReport:
    """See `WorkerGroup.recover`."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    old = list(running.workers)
    rank_before = {id(w): w.rank for w in old}
    timings: dict[str, float] = {}
    found_lost: dict[int, str] = {}
    try:
        kept, started = _keep_healthy(running, num_workers, deadline, timings, found_lost)
        path = "keep-healthy"
    except Exception as exc:  # includes a failed re-formation; WorkerError from init_hook too
        if isinstance(exc, (WorkerError, WorkerDiedError)):
            # A worker lost meanwhile (a burst, a replacement that died while joining): the
            # others are fine and keep their state; the group stays broken, and the next
            # recover keeps them again. Restarting all of them would throw that state away.
            running.broken = True
            raise
        logger.warning("keeping the healthy workers failed (%s); restarting all of them", exc)
        timings.clear()
        kept, started = _full_restart(running, num_workers, deadline, timings)
        path = "full-restart"
    kept_ids = {id(k) for k in kept}
    report = RecoveryReport(
        path=path,
        kept={rank_before[id(w)]: w.rank for w in kept},
        started=[w.rank for w in started],
        world_size=running.world_size,
        duration_s=time.monotonic() - t0,
        lost=sorted(rank_before[id(w)] for w in old if id(w) not in kept_ids),
        timings=timings,
        found_lost=found_lost,
    )
    logger.info("recovered (%s) to %d workers in %.2fs", path, report.world_size, report.duration_s)
    spares.replenish(running)
    return report


def _keep_healthy(
    running: RunningGroup,
    target: int,
    deadline: float,
    timings: dict[str, float],
    found_lost: dict[int, str],
) -> tuple[list, list]:
    workers = running.workers
    t0 = time.monotonic()
    spares_up = spares.ready(running)
    alive = _ping(workers + spares_up)
    timings["ping_s"] = time.monotonic() - t0
    for w in workers:
        if w not in alive:
            if w.alive:  # no call reported it: lost since (see `RecoveryReport.found_lost`)
                found_lost[w.rank] = w.node_id
            running.drop(w)
    survivors = [w for w in workers if w in alive]
    for w in survivors[target:]:  # shrinking: drop the highest ranks
        running.drop(w)
    survivors = survivors[:target]
    if not running.broken and len(survivors) == len(workers) == target:
        return survivors, []  # nothing to do: the old group is intact
    # Replacements start first: their process start and imports (the slow part) overlap with the
    # survivors leaving the old group. Spares that are up go first: they have paid for all that.
    t_spawn = time.monotonic()
    spawned = spares.take(running, spares_up, alive, target - len(survivors))
    spawned += _spawn(running, target - len(survivors) - len(spawned))
    try:
        # Leave the old group everywhere; a survivor that cannot do that is not healthy.
        refs = {
            w.actor.destroy_process_group.remote(): i for i, w in enumerate(survivors) if w.actor
        }
        outcome = Outcome()
        if running.local is not None:
            running.local.runtime.destroy()
        collect(
            refs,
            outcome,
            kill=lambda i: running.drop(survivors[i], unresponsive=True),
            liveness=running.liveness(dict(enumerate(survivors))),
        )
        raise_for(outcome, survivors.__getitem__)
        timings["leave_s"] = time.monotonic() - t_spawn
        running.workers = survivors
        new = _await_new(running, spawned, deadline)
        timings["start_s"] = time.monotonic() - t_spawn
    except BaseException:
        for w in spawned:
            running.drop(w)
        raise
    _form(running, survivors + new, timings)
    return survivors, new


def _full_restart(
    running: RunningGroup, target: int, deadline: float, timings: dict[str, float]
) -> tuple[list, list]:
    for w in running.workers:
        running.drop(w)
    spares.discard(running)  # removing the placement groups below would kill them anyway
    assert running.pool is not None
    running.pool.remove_all()
    kept: list[Worker] = []
    if running.local is not None:
        running.local.runtime.destroy()
        kept = [w for w in running.workers if w.local is not None][:1]
    running.workers = list(kept)
    t_spawn = time.monotonic()
    spawned = _spawn(running, target - len(kept))
    new = _await_new(running, spawned, max(deadline, time.monotonic() + 5.0))
    timings["start_s"] = time.monotonic() - t_spawn
    _form(running, kept + new, timings)
    return kept, new


def _form(running: RunningGroup, workers: list[Worker], timings: dict[str, float]) -> None:
    """Form the new process group over `workers` (rank = position)."""
    running.workers = workers
    running.broken = True  # until the new group is formed
    t0 = time.monotonic()
    running.form()
    timings["form_s"] = time.monotonic() - t0


def _spawn(running: RunningGroup, count: int) -> list[Worker]:
    """`count` new workers without waiting for them (`_await_new` collects them): kept
    processes of an earlier group first (see `kept.py`), else new actors."""
    if count <= 0:
        return []
    assert running.pool is not None
    reused = kept.take_for(running, count)
    return reused + spawn(
        [running.pool.acquire() for _ in range(count - len(reused))], running.spec.actor
    )


def _await_new(running: RunningGroup, spawned: list[Worker], deadline: float) -> list[Worker]:
    """Keep the spawned workers that come up before the deadline (less a reserve for forming the
    group) and whose init hook succeeds; they will be ranked after `running.workers`."""
    if not spawned:
        return []
    reserve = min(10.0, 0.3 * (deadline - time.monotonic()))
    started, missing = await_started(spawned, max(0.5, deadline - time.monotonic() - reserve))
    for w in missing:
        running.drop(w)
    if missing:
        logger.info("%d of %d new workers did not start in time", len(missing), len(spawned))
    try:
        run_hooks(
            started,
            None,
            running.spec.actor.init_hook,
            first_rank=running.world_size,
            liveness=running.probes,
        )
    except BaseException:
        for w in started:
            running.drop(w)
        raise
    return started


def _ping(workers: list[Worker]) -> list[Worker]:
    """The workers that answer a ping in time (the local rank always does)."""
    import ray

    refs = {w.actor.ping.remote(): w for w in workers if w.actor is not None and w.alive}
    ready, _ = (
        ray.wait(list(refs), num_returns=len(refs), timeout=PING_TIMEOUT_S) if refs else ([], [])
    )
    alive = [w for w in workers if w.local is not None]
    for ref in ready:
        try:
            ray.get(ref)
            alive.append(refs[ref])
        except Exception:
            pass
    return [w for w in workers if w in alive]
