"""Starting remote workers and forming the process group over a list of workers."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from raysgd_core._internal.actor import remote_worker_class
from raysgd_core._internal.failures import GRACE_S, Outcome, collect, raise_for
from raysgd_core._internal.liveness import Liveness
from raysgd_core._internal.local import LocalWorker
from raysgd_core._internal.placement import Seat

__all__ = [
    "ActorSpec",
    "Worker",
    "abort_workers",
    "await_started",
    "form_group",
    "kill_worker",
    "record_local",
    "run_hooks",
    "spawn",
    "wait_ready",
]

logger = logging.getLogger("raysgd_core")


@dataclass
class ActorSpec:
    """How to start one remote worker."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    env_vars: dict[str, str]
    init_hook: Optional[Callable[[], Any]]
    #: Raise the process's malloc thresholds (`host_memory.keep_freed_memory`).
    keep_freed_memory: bool = True


@dataclass(eq=False)
class Worker:
    """The driver's record of one rank (remote actor, or the local rank 0 when `local` is set)."""

    actor: Any = None
    local: Optional[LocalWorker] = None
    seat: Optional[Seat] = None
    info: dict[str, Any] = field(default_factory=dict)
    rank: int = -1
    local_rank: int = 0
    local_world_size: int = 1
    device: str = "cpu"
    alive: bool = True
    #: Killed because it did not answer: its seat is not used again (its node may be frozen).
    unresponsive: bool = False

    @property
    def node_id(self) -> str:
        return self.info.get("node_id", "?")


def spawn(seats: list[Seat], spec: ActorSpec) -> list[Worker]:
    """Create one actor per seat without waiting; `await_started` collects them.

    The init hook is queued right behind the start, so it runs with no extra round trip.
    """
    cls = remote_worker_class()
    workers = []
    for seat in seats:
        actor = cls.options(
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            resources=spec.resources or None,
            scheduling_strategy=seat.strategy(),
        ).remote(spec.env_vars, spec.keep_freed_memory)
        worker = Worker(actor=actor, seat=seat)
        worker.info["describe_ref"] = actor.describe.remote()
        if spec.init_hook is not None:
            worker.info["hook_ref"] = actor.run.remote(spec.init_hook)
        workers.append(worker)
    return workers


def await_started(workers: list[Worker], wait_s: float) -> tuple[list[Worker], list[Worker]]:
    """Wait up to `wait_s` for spawned actors to come up: (started, not started)."""
    import ray

    refs = {w.info.pop("describe_ref"): w for w in workers}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s) if refs else ([], [])
    started, missing = [], []
    for ref, w in refs.items():
        if ref not in ready:
            missing.append(w)
            continue
        try:
            w.info.update(ray.get(ref))
            started.append(w)
        except Exception as exc:  # died while starting (a bad env, its node went away, ...)
            logger.warning("a worker died while starting: %s", exc)
            w.info["start_error"] = str(exc)
            missing.append(w)
    return started, missing


def run_hooks(
    workers: list[Worker],
    local: Optional[LocalWorker],
    hook: Any,
    first_rank: int,
    liveness: Optional[Liveness] = None,
) -> None:
    """Wait for the init hooks queued by `spawn` (and run it on the local rank, rank 0); raise on
    error. `first_rank` is the rank `workers[0]` will get (errors name that rank). A worker that
    `liveness` finds silent meanwhile is killed (None: not probed)."""
    outcome = Outcome()
    if local is not None and hook is not None:
        result = local.runtime.run(hook, (), {})
        record_local(outcome, 0, result)
    by_index = {first_rank + i: w for i, w in enumerate(workers)}
    pending = {w.info.pop("hook_ref"): i for i, w in by_index.items() if "hook_ref" in w.info}
    collect(
        pending,
        outcome,
        kill=lambda i: kill_worker(by_index[i], unresponsive=True),
        liveness=_wait(liveness, {i: w.actor for i, w in by_index.items()}),
    )
    raise_for(outcome, by_index.get)


def form_group(
    workers: list[Worker],
    *,
    backend: str,
    timeout_s: float,
    formation_timeout_s: float,
    remote_gpu_index: Optional[int],
    generation: int = 0,
    liveness: Optional[Liveness] = None,
) -> None:
    """Form a new process group over `workers` (rank = position), replacing any old one;
    `generation` names it (an abort meant for an older group is void). A worker that
    `liveness` finds silent meanwhile is killed (None: not probed)."""

    world_size = len(workers)
    if world_size == 0:
        return
    per_node = Counter(w.node_id for w in workers)
    seen: Counter = Counter()
    for rank, w in enumerate(workers):
        w.rank = rank
        w.local_rank = seen[w.node_id]
        w.local_world_size = per_node[w.node_id]
        seen[w.node_id] += 1
    member = workers.__getitem__
    head = workers[0]
    if head.local is not None:
        host, port = head.local.runtime.open_store(world_size, formation_timeout_s)
    else:
        outcome = Outcome()
        collect(
            {head.actor.open_store.remote(world_size, formation_timeout_s): 0},
            outcome,
            kill=lambda r: kill_worker(workers[r], unresponsive=True),
            liveness=_wait(liveness, {0: head.actor}),
        )
        raise_for(outcome, member)
        host, port = outcome.results[0]

    def kwargs(w: Worker, gpu_index: Optional[int]) -> dict:
        return dict(
            backend=backend,
            host=host,
            port=port,
            rank=w.rank,
            world_size=world_size,
            local_rank=w.local_rank,
            local_world_size=w.local_world_size,
            timeout_s=timeout_s,
            formation_timeout_s=formation_timeout_s,
            gpu_index=gpu_index,
            generation=generation,
        )

    pending = {
        w.actor.form.remote(**kwargs(w, remote_gpu_index)): w.rank
        for w in workers
        if w.local is None
    }
    outcome = Outcome()
    if head.local is not None:
        # Joining blocks until every rank has joined (bounded by the formation timeout), so the
        # remote ranks were asked first.
        local = head.local
        result = local.runtime.run(local.runtime.form, (), kwargs(head, local.gpu_index))
        record_local(outcome, 0, result)
    # A rank lost while the others join would leave them waiting in the rendezvous until its
    # timeout: they are aborted out of it at once (their waits in the store end), and keep their
    # process and state. One whose abort does not arrive fails on its own by its timeout and is
    # never killed for it.
    collect(
        pending,
        outcome,
        kill=lambda r: kill_worker(workers[r], unresponsive=True),
        grace_s=formation_timeout_s + GRACE_S,
        abort=lambda ranks: abort_workers([workers[r] for r in ranks], generation),
        liveness=_wait(liveness, {w.rank: w.actor for w in workers}),
    )
    raise_for(outcome, member)
    for w in workers:
        w.device = outcome.results[w.rank]


def _wait(liveness: Optional[Liveness], actors: dict[int, Any]) -> Any:
    """`liveness`'s probes for one wait on `actors` (None without probes)."""
    return None if liveness is None else liveness.wait(actors)


def abort_workers(workers: list[Worker], generation: int) -> None:
    """Abort the collectives of group `generation` on `workers` (see `abort.py`) without
    waiting: on a remote worker's control thread, beside the call it may be blocked in."""
    for w in workers:
        if w.actor is not None and w.alive:
            try:
                w.actor.abort.remote(generation)
            except Exception:  # its actor is gone: nothing left to release
                logger.debug("abort could not be sent", exc_info=True)


def kill_worker(worker: Worker, *, unresponsive: bool = False) -> None:
    """Kill a remote worker's actor (no restart); the local rank is never killed. `unresponsive`:
    it is killed for not answering."""
    import ray

    worker.alive = worker.local is not None
    worker.unresponsive = worker.unresponsive or unresponsive
    if worker.actor is not None:
        try:
            ray.kill(worker.actor, no_restart=True)
        except Exception:
            logger.debug("ray.kill failed", exc_info=True)


def record_local(outcome: Outcome, rank: int, result: Any) -> None:
    from raysgd_core._internal.runtime import Failure

    if isinstance(result, Failure):
        result.rank = rank
        outcome.add_failure(result)
    else:
        outcome.results[rank] = result


def wait_ready(refs: list[Any], timeout_s: float) -> bool:
    """Whether all `refs` (placement-group ready refs) complete within `timeout_s`."""
    import ray

    if not refs:
        return True
    deadline = time.monotonic() + timeout_s
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    return len(ready) == len(refs)
