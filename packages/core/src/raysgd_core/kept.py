"""Worker processes kept between the groups of one driver, for the next group of the same kind.

Starting a worker process costs seconds of CPU (importing torch and Ray, and torch's compiler
stack on the first optimizer), far more than the training step of a small model. A driver that
runs one group after another (a sweep in a loop, a notebook run again, a test suite) pays that for
every group. With `KEEP_WORKERS_ENV` set to a number of seconds, a group that stops cleanly keeps
its healthy remote workers, each in its own placement group (so still holding its resources),
for that long. A group of this driver whose workers are started the same way (resources,
environment variables) takes them instead of starting new processes, at its start, for a
replacement or for a spare; workers kept of another kind are released when a group starts, so
that their room is free for it. A kept worker joins its next group with an empty store and no
process group; what user code changed in the process itself (a torch setting, a module's global)
stays, as with any reused process.

Off by default: a stopped group then frees its resources at once, as users of a cluster expect.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from raysgd_core._internal.placement import nodes_that_fit, wait_removed
from raysgd_core._internal.running import GroupSpec, RunningGroup
from raysgd_core._internal.workers import Worker, await_started, kill_worker

__all__ = ["KEEP_WORKERS_ENV", "release_kept_workers"]

logger = logging.getLogger("raysgd_core")

#: Seconds a stopped group's workers are kept for the next group of this driver (unset or 0: off).
KEEP_WORKERS_ENV = "RAYSGD_KEEP_WORKERS_S"
#: How long a kept worker may take to ready itself for a new group before a new one is started.
RESET_WAIT_S = 10.0
#: How long a release waits for the kept workers' placement groups to give their room back.
REMOVE_WAIT_S = 10.0


@dataclass(eq=False)
class _Kept:
    key: tuple
    worker: Worker
    until: float

    @property
    def bundle(self) -> dict[str, float]:
        """The room its placement group holds (the last part of `key_of`)."""
        return dict(self.key[-1])


_lock = threading.Lock()
_kept: list[_Kept] = []


def keep_seconds() -> float:
    """How long a stopped group's workers are kept (`KEEP_WORKERS_ENV`); 0 when unset or not a number
    of seconds >= 0 (a bad value is logged, never fatal: it only costs the reuse)."""
    raw = os.environ.get(KEEP_WORKERS_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        logger.warning(
            "%s=%r is not a number of seconds >= 0: workers are not kept", KEEP_WORKERS_ENV, raw
        )
        return 0.0
    return seconds


def key_of(spec: GroupSpec) -> tuple:
    """What two groups' workers must share for one's to serve the other: the cluster (first:
    `_release` reads it) and job, how the process was started (resources, environment) and the
    room it holds (last: `_Kept.bundle` reads it)."""
    import ray

    context = ray.get_runtime_context()
    actor = spec.actor
    return (
        context.gcs_address,
        context.get_job_id(),
        actor.num_cpus,
        actor.num_gpus,
        tuple(sorted(actor.resources.items())),
        tuple(sorted(actor.env_vars.items())),
        actor.keep_freed_memory,
        tuple(sorted(spec.bundle.items())),
    )


def keep(workers: list[Worker], key: tuple, seconds: float) -> None:
    """Keep `workers` (stopped cleanly, out of any process group, each in a seat of its own) for
    `seconds`; they are released then unless a group took them."""
    until = time.monotonic() + seconds
    with _lock:
        _kept.extend(_Kept(key, w, until) for w in workers)
    timer = threading.Timer(seconds + 0.1, _release_expired)
    timer.daemon = True
    timer.start()


def serves(running: RunningGroup) -> bool:
    """Whether kept workers can serve `running` (and its own be kept for a later group): its
    seats are its own (not a borrowed group's), on a cluster of one node that fits a worker
    (on several, the placement strategy chooses the nodes)."""
    pool = running.pool
    return pool is not None and pool.borrowed is None and nodes_that_fit(running.spec.bundle) == 1


def room_for(running: RunningGroup) -> tuple[int, dict[str, float]]:
    """What the kept workers hold for `running`: how many of its kind `take_for` would give it,
    and the resources held by those of other kinds (released when it takes workers). Nothing
    where kept workers cannot serve it: they are released when such a group starts."""
    if not serves(running):
        return 0, {}
    key = key_of(running.spec)
    freeable: dict[str, float] = {}
    with _lock:
        mine = sum(1 for k in _kept if k.key == key)
        for k in _kept:
            if k.key != key:
                for resource, amount in k.bundle.items():
                    freeable[resource] = freeable.get(resource, 0.0) + amount
    return mine, freeable


def take_for(running: RunningGroup, count: int) -> list[Worker]:
    """Up to `count` kept workers of `running`'s kind, given to its seat pool, each readied for
    the group (asked to leave what it held, then queued like a newly spawned worker: its
    `describe_ref`, and the group's init hook). Kept workers of other kinds are released (their
    room is for this group); extra ones of this kind stay kept. Where kept workers cannot serve
    `running` (see `serves`), none: all are released, since their room may be needed."""
    if not serves(running):
        release_kept_workers()
        return []
    if count <= 0:
        return []
    assert running.pool is not None
    key = key_of(running.spec)
    with _lock:
        mine = [k for k in _kept if k.key == key]
        others = [k for k in _kept if k.key != key]
        taken = [k.worker for k in mine[:count]]
        _kept[:] = mine[count:]
    _release(others)
    if not taken:
        return []
    for worker in taken:
        assert worker.seat is not None
        running.pool.owned_pgs.append(worker.seat.pg)
        worker.info = {"describe_ref": worker.actor.reset.remote()}
    ready, gone = await_started(taken, RESET_WAIT_S)
    for worker in gone:  # died since it was kept (killed, its node lost): a new one instead
        kill_worker(worker)
        # Removed, not left free in the pool: a group starting now places its new workers in
        # groups of their own, and a free one would hold room they may need.
        running.pool.release(worker.seat, reuse=False)
    hook = running.spec.actor.init_hook
    for worker in ready:
        worker.info = {"describe_ref": worker.actor.describe.remote()}
        if hook is not None:
            worker.info["hook_ref"] = worker.actor.run.remote(hook)
    logger.info("%d worker(s) of %d are kept processes of an earlier group", len(ready), count)
    return ready


def release_kept_workers() -> None:
    """Release every worker kept for a later group (see `KEEP_WORKERS_ENV`) now: its process
    ends and its resources go back to the cluster."""
    with _lock:
        released = list(_kept)
        _kept.clear()
    _release(released)


def _release_expired() -> None:
    now = time.monotonic()
    with _lock:
        expired = [k for k in _kept if k.until <= now]
        for k in expired:
            _kept.remove(k)
    _release(expired)


def _release(released: list[_Kept]) -> None:
    """Kill the workers of `released` and remove their placement groups, waiting (bounded) until
    their room is free; those of a cluster Ray no longer runs here went with it."""
    import ray

    if not released or not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    current = ray.get_runtime_context().gcs_address
    removed = []
    for k in released:
        if k.key[0] != current:
            continue
        kill_worker(k.worker)
        pg: Optional[Any] = k.worker.seat.pg if k.worker.seat is not None else None
        if pg is not None:
            try:
                remove_placement_group(pg)
                removed.append(pg)
            except Exception:  # gone already: nothing left to free
                logger.debug("remove_placement_group failed", exc_info=True)
    # As a group's shutdown does: a group started right after finds the room free.
    wait_removed(removed, REMOVE_WAIT_S)
