"""Starting and stopping the workers of a `RunningGroup` (`WorkerGroup.start` / `shutdown`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from raysgd_core import kept
from raysgd_core._internal import host_memory, spares
from raysgd_core._internal.local import LocalWorker
from raysgd_core._internal.placement import (
    SeatPool,
    describe_free_resources,
    describe_request,
    wait_removed,
)
from raysgd_core._internal.running import RunningGroup
from raysgd_core._internal.workers import (
    Worker,
    await_started,
    kill_worker,
    run_hooks,
    spawn,
    wait_ready,
)
from raysgd_core.errors import ResourcesUnavailableError, WorkerDiedError

__all__ = ["start", "teardown"]

logger = logging.getLogger("raysgd_core")

#: How long `teardown` waits for the removed placement groups to give their resources back.
REMOVE_WAIT_S = 10.0


def start(running: RunningGroup, num_workers: int, borrowed: Any) -> None:
    """Place, start and hook `num_workers` workers and form their process group; on any error the
    caller tears the running group down. `borrowed`: a placement group to place the workers in, or None."""
    spec = running.spec
    t0 = time.monotonic()
    running.pool = pool = SeatPool(spec.bundle, spec.options.placement_strategy, borrowed)
    n_remote = num_workers - (1 if spec.options.use_local else 0)
    waits = []
    if spec.options.use_local:
        running.local = local = LocalWorker()
        if spec.actor.keep_freed_memory:
            host_memory.keep_freed_memory()
        running.workers = [Worker(local=local, info=local.runtime.describe())]
        if borrowed is None:
            pg = local.reserve(spec.bundle, spec.options.start_timeout_s)
            if pg is not None:
                waits.append(pg.ready())
    request = describe_request(num_workers, spec.bundle, spec.options.placement_strategy)
    reused = kept.take_for(running, n_remote)
    n_new = n_remote - len(reused)
    seats = pool.create_main(n_new, spec.options.start_timeout_s) if n_new else []
    placed, seats = seats is not None, seats or []
    waits += [seat.pg.ready() for seat in seats if seat.owned]
    # Actors are created before their groups are ready: Ray starts each one the moment its
    # bundle is reserved, with no round trip in between.
    spawned = reused + spawn(seats, spec.actor)
    running.workers += spawned
    if not placed or not wait_ready(waits, spec.options.start_timeout_s):
        raise ResourcesUnavailableError(
            f"Could not reserve {request} within {spec.options.start_timeout_s:g}s; "
            f"the cluster has {describe_free_resources()}."
        )
    t_pg = time.monotonic()
    if running.local is not None:
        running.local.learn_gpu(spec.actor.num_gpus)
    started, missing = await_started(spawned, spec.options.start_timeout_s)
    died = [w.info["start_error"] for w in missing if "start_error" in w.info]
    if died:
        raise WorkerDiedError(
            f"{len(died)} of {n_remote} worker actors died while starting: {died[0]}", [], []
        )
    if missing:
        raise ResourcesUnavailableError(
            f"Only {len(started)} of {n_remote} worker actors started within "
            f"{spec.options.start_timeout_s:g}s for {request}; the cluster has {describe_free_resources()}."
        )
    t_actors = time.monotonic()
    run_hooks(
        started,
        running.local,
        spec.actor.init_hook,
        first_rank=running.world_size - len(started),
        liveness=running.probes,
    )
    running.form()
    t_done = time.monotonic()
    # After the group is formed, so that the spares' start does not slow the workers' own.
    spares.replenish(running)
    logger.info(
        "WorkerGroup of %d ready in %.2fs (placement %.2fs, actors %.2fs, process group %.2fs)",
        num_workers,
        t_done - t0,
        t_pg - t0,
        t_actors - t_pg,
        t_done - t_actors,
    )


def _keep(running: RunningGroup, stopped: list[Worker]) -> list[Worker]:
    """Keep the workers that left their process group cleanly for the next group (see
    `kept.py`); returns the others."""
    seconds = kept.keep_seconds()
    if not seconds or not kept.serves(running):
        return running.workers
    assert running.pool is not None
    keepable = [w for w in stopped if w.seat is not None and w.seat.owned and not w.unresponsive]
    for worker in keepable:
        assert worker.seat is not None
        if worker.seat.pg in running.pool.owned_pgs:
            running.pool.owned_pgs.remove(worker.seat.pg)
    kept.keep(keepable, kept.key_of(running.spec), seconds)
    return [w for w in running.workers if w not in keepable]


def teardown(running: RunningGroup, force: bool) -> None:
    """Stop every worker and remove the placement groups; returns once Ray reports them removed
    (bounded by `REMOVE_WAIT_S`), so that their resources are free when the caller goes on."""
    import ray

    if not ray.is_initialized():  # Ray already shut down: its actors and groups went with it
        running.workers, running.spares = [], []
        if running.local is not None:
            running.local.runtime.destroy()
            running.local.forget_reservation()
            running.local.close()
            running.local = None
        return
    remote = [w for w in running.workers if w.actor is not None and w.alive]
    to_kill = running.workers
    if not force and remote:
        refs = {w.actor.destroy_process_group.remote(): w for w in remote}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=5.0)
        to_kill = _keep(running, [refs[ref] for ref in ready if _left_cleanly(ref)])
    for w in to_kill:
        kill_worker(w)
    running.workers = []
    spares.discard(running)
    removed = []
    if running.pool is not None:
        removed += running.pool.remove_all()
    if running.local is not None:
        removed += running.local.close()
        running.local = None
    wait_removed(removed, REMOVE_WAIT_S)


def _left_cleanly(ref: Any) -> bool:
    """Whether a worker's `destroy_process_group` call returned (rather than raised: it died)."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return False
    return True
