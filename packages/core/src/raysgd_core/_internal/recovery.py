"""`WorkerGroup.recover`: keep the healthy workers, replace the rest, re-form the process group.

Two paths. "keep-healthy": ping every worker with a short timeout (a worker stuck in a collective
does not answer and is killed), drop the dead, destroy the old process group on the survivors, start
new actors (as many as start within the time left) and form a new group over survivors + new ones.
Survivors keep their process, so their `store` (the trainer's runner, the model) is kept. If that
fails, "full-restart": kill every remote worker and start all of them anew.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from raysgd_core._internal.failures import Outcome, collect, raise_for
from raysgd_core._internal.workers import Worker, await_started, kill_worker, run_hooks, spawn

if TYPE_CHECKING:
    from raysgd_core.group import WorkerGroup
    from raysgd_core.info import RecoveryReport

__all__ = ["recover"]

logger = logging.getLogger("raysgd_core")

# A healthy idle actor answers a ping in milliseconds; this leaves room for a loaded machine.
PING_TIMEOUT_S = 5.0


def recover(group: WorkerGroup, target_size: int, timeout_s: float) -> RecoveryReport:
    """See `WorkerGroup.recover`."""
    from raysgd_core.info import RecoveryReport

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    old = list(group._workers)
    rank_before = {id(w): w.rank for w in old}
    try:
        kept, started = _keep_healthy(group, target_size, deadline)
        path = "keep-healthy"
    except Exception as exc:  # includes a failed re-formation; WorkerError from init_hook too
        from raysgd_core.errors import WorkerError

        if isinstance(exc, WorkerError):
            raise
        logger.warning("keeping the healthy workers failed (%s); restarting all of them", exc)
        kept, started = _full_restart(group, target_size, deadline)
        path = "full-restart"
    kept_map = {rank_before[id(w)]: w.rank for w in kept}
    report = RecoveryReport(
        path=path,
        kept=kept_map,
        started=[w.rank for w in started],
        world_size=len(group._workers),
        duration_s=time.monotonic() - t0,
        lost=sorted(rank_before[id(w)] for w in old if id(w) not in {id(k) for k in kept}),
    )
    logger.info("recovered (%s) to %d workers in %.2fs", path, report.world_size, report.duration_s)
    return report


def _keep_healthy(group: WorkerGroup, target: int, deadline: float) -> tuple[list, list]:
    workers = group._workers
    alive = _ping(workers)
    for w in workers:
        if w not in alive:
            kill_worker(w)
            _release(group, w)
    survivors = [w for w in workers if w in alive]
    for w in survivors[target:]:  # shrinking: drop the highest ranks
        kill_worker(w)
        _release(group, w)
    survivors = survivors[:target]
    if not group._broken and len(survivors) == len(workers) == target:
        return survivors, []  # nothing to do: the old group is intact
    # Leave the old group everywhere first; a survivor that cannot do that is not healthy.
    refs = {w.actor.destroy_process_group.remote(): i for i, w in enumerate(survivors) if w.actor}
    outcome = Outcome()
    if group._local is not None:
        group._local.runtime.destroy()
    collect(refs, outcome, kill=lambda i: kill_worker(survivors[i]))
    raise_for(outcome, lambda i: survivors[i].node_id)
    group._workers = survivors
    new = _start_new(group, target - len(survivors), deadline)
    group._workers = survivors + new
    group._broken = True
    group._form()
    return survivors, new


def _full_restart(group: WorkerGroup, target: int, deadline: float) -> tuple[list, list]:
    for w in group._workers:
        kill_worker(w)
    assert group._pool is not None
    group._pool.remove_all()
    kept: list[Worker] = []
    if group._local is not None:
        group._local.runtime.destroy()
        local = next(w for w in group._workers if w.local is not None)
        kept = [local]
    group._workers = list(kept)
    new = _start_new(group, target - len(kept), max(deadline, time.monotonic() + 5.0))
    group._workers = kept + new
    group._broken = True
    group._form()
    return kept, new


def _start_new(group: WorkerGroup, count: int, deadline: float) -> list[Worker]:
    """Start up to `count` workers, keeping those that come up before the deadline (less a
    reserve for forming the group)."""
    if count <= 0:
        return []
    assert group._pool is not None
    slots = [group._pool.acquire() for _ in range(count)]
    spawned = spawn(slots, group._spec)
    reserve = min(10.0, 0.3 * (deadline - time.monotonic()))
    started, missing = await_started(spawned, max(0.5, deadline - time.monotonic() - reserve))
    for w in missing:
        kill_worker(w)
        _release(group, w)
    if missing:
        logger.info("%d of %d new workers did not start in time", len(missing), count)
    try:
        run_hooks(started, None, group._spec.init_hook, first_rank=len(group._workers))
    except BaseException:
        for w in started:
            kill_worker(w)
            _release(group, w)
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


def _release(group: WorkerGroup, worker: Worker) -> None:
    if worker.slot is not None and group._pool is not None:
        group._pool.release(worker.slot)
        worker.slot = None
