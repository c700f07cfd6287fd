"""Spare workers: actors started ahead of a loss and kept out of the process group.

A replacement started only once a worker is lost spends seconds in a fresh process (Ray's worker
start, the torch import, the modules the first optimizer of a process imports) while the survivors
wait for it. A spare has paid for all of that in advance, in a seat of its own: its resources are
reserved like any worker's, so it computes on its own CPUs or GPU once promoted. `recover` promotes
the spares that are up before it starts new actors, and starts the next spares once the group is
formed again.

Every function works on a `RunningGroup`; the spares live in `running.spares`, not in `running.workers`.
"""

from __future__ import annotations

import importlib
import logging

from raysgd_core import kept
from raysgd_core._internal.placement import (
    describe_free_resources,
    estimate_fitting,
    format_resources,
)
from raysgd_core._internal.running import RunningGroup
from raysgd_core._internal.workers import Worker, spawn

__all__ = ["discard", "discard_on", "readiness", "ready", "replenish", "start", "take", "warm_up"]

logger = logging.getLogger("raysgd_core")

#: `Worker.info` keys of the calls queued on a spare when it is spawned.
_PENDING = ("describe_ref", "warm_ref")


def warm_up(extra: tuple[str, ...] = ()) -> None:
    """Runs on a spare: import what every raysgd worker imports before it trains, then `extra`
    (the group's `spare_imports`)."""
    from raysgd_core.ray_options import WORKER_PRELOAD_MODULES

    for name in WORKER_PRELOAD_MODULES:
        importlib.import_module(name)
    for name in extra:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optimisation only: the promoted worker imports it later
            logger.warning("a spare worker could not import %s: %s", name, exc)


def replenish(running: RunningGroup) -> None:
    """Start spares until `spec.options.spare_workers` exist (those still starting count).

    Never raises: a spare is an optimisation, and a cluster without room for one leaves it pending
    (it starts when resources free up) without holding anything else up."""
    start(running, running.spec.options.spare_workers - len(running.spares))


def start(running: RunningGroup, missing: int) -> None:
    """Start `missing` more spares now, whatever `spare_workers` says (replacements started while
    the group trains on smaller). Never raises, as `replenish`."""
    if missing <= 0 or running.pool is None:
        return
    try:
        new = kept.take_for(running, missing)
        missing -= len(new)
        room = estimate_fitting(running.spec.bundle, running.pool)
        if room < missing:
            logger.warning(
                "%d spare worker(s) will wait for resources (%s each): the cluster has %s",
                missing - room,
                format_resources(running.spec.bundle),
                describe_free_resources(),
            )
        new += spawn([running.pool.acquire() for _ in range(missing)], running.spec.actor)
        for w in new:
            w.info["warm_ref"] = w.actor.run.remote(warm_up, running.spec.options.spare_imports)
        running.spares += new
    except Exception:
        logger.warning("could not start a spare worker", exc_info=True)


def readiness(running: RunningGroup) -> list[tuple]:
    """For each spare, the object refs that are all done once it is up (for a waiter elsewhere:
    the workers look at them between steps)."""
    return [tuple(w.info[k] for k in _PENDING) for w in _queued(running)]


def _queued(running: RunningGroup) -> list[Worker]:
    """The spares whose start-up calls are queued (every one `start` made)."""
    return [w for w in running.spares if all(k in w.info for k in _PENDING)]


def ready(running: RunningGroup, wait_s: float = 0.0) -> list[Worker]:
    """The spares that are started and warmed up, after waiting up to `wait_s` for those still
    starting (0: not at all).

    Their `info` (node, pid, ...) is filled in; one that died while starting is dropped. Whether
    the others are still alive is not checked."""
    import ray

    pending = _queued(running)
    refs = [w.info[k] for w in pending for k in _PENDING]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
    done_set = set(done)
    up = []
    for w in pending:
        if not all(w.info[k] in done_set for k in _PENDING):
            continue
        try:
            w.info.update(ray.get(w.info["describe_ref"]))
        except Exception as exc:  # died while starting: `replenish` starts another
            logger.warning("a spare worker died while starting: %s", exc)
            running.drop(w)
            running.spares.remove(w)
            continue
        up.append(w)
    return up


def take(running: RunningGroup, up: list[Worker], alive: list[Worker], count: int) -> list[Worker]:
    """Promote up to `count` spares: those of `up` (from `ready`) that are in `alive` (answered a
    ping) and not on a node Ray is draining. They leave `running.spares` and are joined like newly
    spawned workers. Spares of `up` that did not answer or sit on a draining node are dropped
    (their seat is freed; `replenish` starts others elsewhere); those still starting stay spares."""
    from raysgd_core.drains import draining_nodes

    draining = draining_nodes() if up else {}
    usable = [w for w in up if w in alive and w.node_id not in draining]
    taken = usable[: max(0, count)]
    for w in up:
        if w not in usable and w in running.spares:
            running.drop(w)
            running.spares.remove(w)
    for w in taken:
        running.spares.remove(w)
        w.info.pop("warm_ref", None)
    if taken:
        logger.info("promoting %d spare worker(s)", len(taken))
    return taken


def discard(running: RunningGroup) -> None:
    """Kill every spare and free its seat."""
    for w in running.spares:
        running.drop(w)
    running.spares = []


def discard_on(running: RunningGroup, nodes: set[str]) -> None:
    """Kill the spares on `nodes` (about to go away) and free their seats; `replenish` starts new
    ones elsewhere."""
    leaving = [w for w in running.spares if w.node_id in nodes]
    for w in leaving:
        running.drop(w)
        running.spares.remove(w)
