"""`WorkerGroup`: N Ray actors with a ready `torch.distributed` process group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from raysgd_base import check_int
from raysgd_core import kept
from raysgd_core._internal import lifecycle, spares
from raysgd_core._internal.failures import Outcome, collect, raise_for
from raysgd_core._internal.liveness import Wait, watch_while
from raysgd_core._internal.placement import estimate_fitting
from raysgd_core._internal.recover import recover as _recover
from raysgd_core._internal.running import GroupSpec, RunningGroup
from raysgd_core._internal.workers import record_local
from raysgd_core.info import RecoveryReport, WorkerInfo
from raysgd_core.options import GroupOptions
from raysgd_core.ray_options import ensure_ray
from raysgd_core.shipping import ship_by_value

__all__ = ["RecoveryReport", "WorkerGroup", "WorkerInfo"]

logger = logging.getLogger("raysgd_core")


class WorkerGroup:
    """A pool of Ray actors (optionally plus the calling process as rank 0) in one process group.

    Args:
        num_workers: number of ranks (with `use_local=True`, rank 0 is the calling process).
        options: how the workers are placed, started and connected (`GroupOptions`: resources,
            backend, timeouts, placement, `init_hook`, `use_local`, spares, ...).
        **fields: `GroupOptions` fields given as keywords, applied over `options`:
            ``WorkerGroup(2, num_cpus_per_worker=2, backend="gloo")`` is
            ``WorkerGroup(2, GroupOptions(num_cpus_per_worker=2, backend="gloo"))``. An unknown
            name is a TypeError that lists the options.

    Nothing starts until `start()` (or `with WorkerGroup(...) as group:`); the options are checked
    here, so a bad one fails before anything is placed.
    """

    def __init__(
        self, num_workers: int, options: Optional[GroupOptions] = None, **fields: Any
    ) -> None:
        check_int("num_workers", num_workers)
        self._options = GroupOptions.build(options, **fields)
        self._num_workers = num_workers
        self._spec = GroupSpec.from_options(self._options)
        self._running = RunningGroup(self._spec)
        self._put_values: dict[str, Any] = {}  # ObjectRef hex -> the object `put` stored
        self._started = False

    @property
    def options(self) -> GroupOptions:
        """The options the group was built with."""
        return self._options

    # Read-only views of the options (public since the first release).
    @property
    def use_local(self) -> bool:
        """Rank 0 runs in the calling process."""
        return self._options.use_local

    @property
    def backend(self) -> str:
        """The process group's backend ("gloo" or "nccl")."""
        return self._spec.backend

    @property
    def timeout_s(self) -> float:
        """Timeout of the process group's collectives, in seconds."""
        return float(self._options.timeout_s)

    @property
    def start_timeout_s(self) -> float:
        """How long `start()` waits for resources, and then for the actors to come up."""
        return self._options.start_timeout_s

    @property
    def placement_strategy(self) -> str:
        """The placement-group strategy of the workers started by `start()`."""
        return self._options.placement_strategy

    # ----------------------------------------------------------------------------- life cycle
    def start(self) -> WorkerGroup:
        """Place the workers, start them, run `init_hook`, form the process group.

        Raises:
            ResourcesUnavailableError: the cluster could not place or start the workers within
                `start_timeout_s` (nothing is left behind).
            WorkerError / WorkerDiedError: `init_hook` raised, or a worker died while starting.

        Starts a local Ray instance first when none is initialised (`ensure_ray`).
        """
        if self._started:
            raise RuntimeError("WorkerGroup.start() was already called")
        ensure_ray()
        try:
            lifecycle.start(self._running, self._num_workers, self._resolve_placement_group())
        except BaseException:
            lifecycle.teardown(self._running, force=True)
            raise
        self._started = True
        return self

    def _resolve_placement_group(self) -> Any:
        if self._options.placement_group is None:
            return None
        if self._options.placement_group == "auto":
            from ray.util import get_current_placement_group

            return get_current_placement_group()
        return self._options.placement_group

    def __enter__(self) -> WorkerGroup:
        return self if self._started else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker and free the placement groups (idempotent).

        Without `force`, workers first leave the process group cleanly (bounded wait); then the
        actors are killed and the placement groups removed. It returns once Ray reports the groups
        removed (bounded wait), so their resources are back in `ray.available_resources()`.
        Where the driver keeps workers for its next group (`KEEP_WORKERS_ENV`), those that left
        the process group cleanly live on instead, each in its own placement group.
        """
        lifecycle.teardown(self._running, force=force)
        self._started = False

    # ------------------------------------------------------------------------------ properties
    @property
    def num_workers(self) -> int:
        """The size asked for: by the constructor, then by the last `recover(num_workers)`.

        Fewer may be running (`world_size`) when not all of them could be started."""
        return self._num_workers

    @property
    def world_size(self) -> int:
        """Number of ranks in the current process group: the live size."""
        return self._running.world_size

    @property
    def workers(self) -> list[WorkerInfo]:
        """Per-rank metadata, in rank order."""
        return [
            WorkerInfo(
                rank=w.rank,
                local_rank=w.local_rank,
                local_world_size=w.local_world_size,
                node_id=w.node_id,
                node_ip=w.info.get("node_ip", "?"),
                pid=w.info.get("pid", -1),
                device=w.device,
                is_local=w.local is not None,
            )
            for w in self._running.workers
        ]

    @property
    def spares(self) -> list[WorkerInfo]:
        """The spare workers that are up (started, torch imported), ready to replace a lost
        worker; `rank` is -1. Spares still starting are not listed."""
        return [
            WorkerInfo(
                rank=-1,
                local_rank=0,
                local_world_size=1,
                node_id=w.node_id,
                node_ip=w.info.get("node_ip", "?"),
                pid=w.info.get("pid", -1),
                device="?",
            )
            for w in spares.ready(self._running)
        ]

    @property
    def spares_starting(self) -> int:
        """Spare workers started but not up yet."""
        up = len(spares.ready(self._running))  # first: it drops the spares that died starting
        return len(self._running.spares) - up

    def start_spares(self, count: int) -> None:
        """Start `count` more spares now, beside `spare_workers`: replacements for lost workers
        that start while the group trains on smaller, to join it once they are up (a `recover`
        to the larger size promotes them). A cluster without room leaves them pending."""
        check_int("count", count, minimum=0)
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        spares.start(self._running, count)

    def spare_readiness(self) -> list[tuple[Any, ...]]:
        """For each spare, the `ObjectRef`s that are all done once it is up: a worker can wait on
        them (`ray.wait`) to learn, between steps, that a spare can join."""
        return spares.readiness(self._running)

    def await_spares(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the spares still starting; how many are up then. A move
        with time before its deadline waits for them rather than shrink the group."""
        return len(spares.ready(self._running, wait_s=max(0.0, float(timeout_s))))

    @property
    def healthy(self) -> bool:
        """Started, and no failure since the last (re-)formation of the process group."""
        return self._started and not self._running.broken

    @property
    def needs_recovery(self) -> bool:
        """A worker raised or died: call `recover(n)` before running collectives again."""
        return self._started and self._running.broken

    # ------------------------------------------------------------------------------- execution
    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Top-level `ObjectRef` arguments are resolved on every rank. With `use_local=True`, rank 0
        runs in the calling thread while the others run concurrently.

        Raises:
            WorkerError: `fn` raised on a rank (its traceback is in the message).
            WorkerDiedError: a worker (or its node) died. Either way `needs_recovery` is then True.
        """
        self._check_usable()
        ship_by_value(fn, args, kwargs)
        remote = [w for w in self._running.workers if w.local is None]
        pending = {w.actor.run.remote(fn, *args, **kwargs): w.rank for w in remote}
        outcome = Outcome()
        liveness = self._running.liveness()
        if self._running.local is not None:
            # The remote ranks are probed meanwhile: a silent one lets the local rank out of
            # the collectives that wait for it.
            stop = watch_while(liveness, pending.values, self._abort_all_but)
            try:
                self._run_local(outcome, fn, args, kwargs)
            finally:
                stop()
        self._finish(pending, outcome, liveness)
        return [outcome.results[r] for r in range(len(self._running.workers))]

    def put(self, value: Any, *, by_value: tuple[Any, ...] = ()) -> Any:
        """Store `value` once in Ray's object store and return its `ObjectRef`, for `execute` calls.

        `value` is pickled now, once: a class or function from the user's script is shipped as it
        is at this call (its closure cells included), and every later call that passes the ref
        reuses that copy instead of pickling the object again. Modules of `value`, of the items of
        a tuple/list `value` and of `by_value` (objects `value` holds where this cannot see them)
        travel by value, as for `execute` arguments. With `use_local=True`, rank 0 gets `value`
        itself rather than a copy.
        """
        import ray

        ship_by_value(value, tuple(by_value))
        ref = ray.put(value)
        # The local rank gets the object itself: unpickling a by-value class in the process that
        # defined it would overwrite its methods with the copies (closures as they were here).
        self._put_values[ref.hex()] = value
        return ref

    def execute_single(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on one rank and return its result (errors as in `execute`)."""
        self._check_usable()
        if not 0 <= rank < len(self._running.workers):
            raise ValueError(f"rank must be in [0, {len(self._running.workers)}), got {rank}")
        ship_by_value(fn, args, kwargs)
        worker = self._running.workers[rank]
        outcome = Outcome()
        pending = {}
        if worker.local is not None:
            self._run_local(outcome, fn, args, kwargs)
        else:
            pending = {worker.actor.run.remote(fn, *args, **kwargs): rank}
        self._finish(pending, outcome, self._running.liveness())
        return outcome.results[rank]

    def execute_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Start `fn` on the *remote* ranks only and return their `ObjectRef`s in rank order.

        With `use_local=True` rank 0 is not included (run it yourself). `ray.get` on a ref raises
        the `WorkerError` (wrapped by Ray) if `fn` raised, or a `RayActorError` if the actor died.
        """
        self._check_usable()
        ship_by_value(fn, args, kwargs)
        return [
            w.actor.run_raising.remote(fn, *args, **kwargs)
            for w in self._running.workers
            if w.local is None
        ]

    def execute_single_async(
        self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Start `fn` on one remote rank and return its `ObjectRef` (errors as `execute_async`).

        The call queues behind whatever the rank is running, and the next call to that rank
        queues behind it. The local rank (`use_local=True`) cannot be called this way.
        """
        self._check_usable()
        if not 0 <= rank < len(self._running.workers):
            raise ValueError(f"rank must be in [0, {len(self._running.workers)}), got {rank}")
        worker = self._running.workers[rank]
        if worker.local is not None:
            raise ValueError(f"rank {rank} runs in this process: call it with execute_single")
        ship_by_value(fn, args, kwargs)
        return worker.actor.run_raising.remote(fn, *args, **kwargs)

    def _run_local(
        self, outcome: Outcome, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        import ray

        assert self._running.local is not None

        def resolve(value: Any) -> Any:
            if not isinstance(value, ray.ObjectRef):
                return value
            key = value.hex()
            return self._put_values[key] if key in self._put_values else ray.get(value)

        args = tuple(resolve(a) for a in args)
        kwargs = {k: resolve(v) for k, v in kwargs.items()}
        record_local(outcome, 0, self._running.local.runtime.run(fn, args, kwargs))

    def _abort_all_but(self, silent: list[int]) -> None:
        self._running.abort([r for r in range(self._running.world_size) if r not in silent])

    def _finish(self, pending: dict, outcome: Outcome, liveness: Optional[Wait]) -> None:
        by_rank = {w.rank: w for w in self._running.workers}
        collect(
            pending,
            outcome,
            kill=lambda r: self._running.drop(by_rank[r], unresponsive=True),
            grace_s=self._options.peer_grace_s,
            abort=self._running.abort,
            liveness=liveness,
        )
        if not outcome.ok:
            self._running.broken = True
            raise_for(outcome, by_rank.get)

    def _check_usable(self) -> None:
        if not self._started:
            raise RuntimeError(
                "WorkerGroup is not started (call start() or use it as a context manager)"
            )
        if self._running.broken:
            raise RuntimeError(
                "WorkerGroup needs recovery after a worker failure: call recover(n) (or shutdown())"
            )

    # -------------------------------------------------------------------------------- recovery
    def recover(self, num_workers: int, *, timeout_s: float = 60.0) -> RecoveryReport:
        """Replace dead or stuck workers and re-form the process group with up to `num_workers` ranks.

        Survivors keep their process and `WorkerContext.store`; ranks are renumbered in the old
        order, new workers come last. As many new workers are started as actually start within
        `timeout_s` (the result may be smaller than `num_workers`, even 0). A worker lost while
        the group re-forms raises `WorkerDiedError` and leaves the group needing recovery, the
        others kept: call `recover` again. When keeping the survivors fails otherwise, every
        remote worker is replaced ("full-restart").
        """
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        check_int("num_workers", num_workers, minimum=1 if self.use_local else 0)
        self._num_workers = num_workers
        return _recover(self._running, num_workers, timeout_s)

    def retire(self, ranks: Sequence[int]) -> None:
        """Stop healthy workers on purpose, e.g. because their node is about to be reclaimed.

        The workers of `ranks` are killed and their seats are not reused while their node drains;
        spares on the same nodes are dropped too. The group then needs `recover(n)`, which keeps
        the others and starts replacements elsewhere (spares first), as after a loss.
        """
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        workers = self._running.workers
        bad = [r for r in ranks if not 0 <= r < len(workers)]
        if bad:
            raise ValueError(f"ranks {bad} are not in [0, {len(workers)})")
        if any(workers[r].local is not None for r in ranks):
            raise ValueError("rank 0 runs in this process (use_local=True) and cannot be retired")
        nodes = {workers[r].node_id for r in ranks}
        for r in ranks:
            self._running.drop(workers[r])
        spares.discard_on(self._running, nodes)
        self._running.broken = True

    def replace_spares_on(self, nodes: Iterable[str]) -> None:
        """Drop the spares on `nodes` (about to go away) and start new ones elsewhere."""
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        spares.discard_on(self._running, set(nodes))
        spares.replenish(self._running)

    def estimate_fitting(self) -> int:
        """A cheap guess of how many more workers the cluster has room for right now (spares that
        are up count: `recover` promotes them; so do workers kept by an earlier group that
        `recover` takes, and the room of kept ones it releases: see `raysgd_core.kept`)."""
        ready, freeable = kept.room_for(self._running)
        return (
            estimate_fitting(self._spec.bundle, self._running.pool, freeable)
            + len(spares.ready(self._running))
            + ready
        )
