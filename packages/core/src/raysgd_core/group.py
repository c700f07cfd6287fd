"""`WorkerGroup`: N Ray actors with a ready `torch.distributed` process group."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Union

from raysgd_core._internal import recovery as _recovery
from raysgd_core._internal.args import check_group_args
from raysgd_core._internal.failures import Outcome, collect, raise_for
from raysgd_core._internal.local import LocalWorker
from raysgd_core._internal.placement import (
    SlotPool,
    describe_free_resources,
    describe_request,
    estimate_fitting,
    make_bundle,
)
from raysgd_core._internal.workers import (
    ActorSpec,
    Worker,
    await_started,
    form_group,
    kill_worker,
    run_hooks,
    spawn,
    wait_ready,
)
from raysgd_core.errors import ResourcesUnavailableError, WorkerDiedError
from raysgd_core.info import RecoveryReport, WorkerInfo
from raysgd_core.shipping import ship_by_value

__all__ = ["RecoveryReport", "WorkerGroup", "WorkerInfo"]

logger = logging.getLogger("raysgd_core")


class WorkerGroup:
    """A pool of Ray actors (optionally plus the calling process as rank 0) in one process group.

    Args:
        num_workers: number of ranks (with `use_local=True`, rank 0 is the calling process).
        num_cpus_per_worker: CPUs reserved per worker.
        num_gpus_per_worker: GPUs reserved per worker (each worker then computes on `cuda:0` of its
            own `CUDA_VISIBLE_DEVICES`).
        resources_per_worker: extra Ray resources per worker.
        backend: "gloo", "nccl" or "auto" (nccl when GPUs are requested, else gloo).
        timeout_s: timeout of the process group's collectives, in seconds (or a `timedelta`).
        placement_strategy: placement-group strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        init_hook: called with no arguments on every worker before the process group is formed
            (also on workers started by `recover`).
        env_vars: environment variables set in each actor before anything else runs there.
        use_local: run rank 0 in the calling process.
        placement_group: "auto" (use the current placement group when the caller runs inside one
            that captures child tasks, e.g. a Tune trial; else make one), a `PlacementGroup` to
            place the workers in (any bundle with room), or None (always make one).
        start_timeout_s: how long `start()` waits for resources, and then for the actors to come up.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        resources_per_worker: Optional[dict[str, float]] = None,
        backend: str = "auto",
        timeout_s: Union[float, timedelta] = 1800,
        placement_strategy: str = "SPREAD",
        init_hook: Optional[Callable[[], Any]] = None,
        env_vars: Optional[dict[str, str]] = None,
        use_local: bool = False,
        placement_group: Union[str, Any, None] = "auto",
        start_timeout_s: float = 30.0,
    ) -> None:
        timeout_s = check_group_args(
            num_workers,
            num_cpus_per_worker=num_cpus_per_worker,
            num_gpus_per_worker=num_gpus_per_worker,
            backend=backend,
            timeout_s=timeout_s,
            placement_strategy=placement_strategy,
            init_hook=init_hook,
            placement_group=placement_group,
            start_timeout_s=start_timeout_s,
        )
        self.num_workers = num_workers
        self.use_local = bool(use_local)
        self.backend = ("nccl" if num_gpus_per_worker else "gloo") if backend == "auto" else backend
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.placement_strategy = placement_strategy
        self._placement_group_arg = placement_group
        self._bundle = make_bundle(num_cpus_per_worker, num_gpus_per_worker, resources_per_worker)
        self._spec = ActorSpec(
            num_cpus=num_cpus_per_worker,
            num_gpus=num_gpus_per_worker,
            resources=dict(resources_per_worker or {}),
            env_vars={str(k): str(v) for k, v in (env_vars or {}).items()},
            init_hook=init_hook,
        )
        self._workers: list[Worker] = []
        self._pool: Optional[SlotPool] = None
        self._local: Optional[LocalWorker] = None
        self._started = False
        self._broken = False  # the process group is unusable until recover()

    # ----------------------------------------------------------------------------- life cycle
    def start(self) -> WorkerGroup:
        """Place the workers, start them, run `init_hook`, form the process group.

        Raises:
            ResourcesUnavailableError: the cluster could not place or start the workers within
                `start_timeout_s` (nothing is left behind).
            WorkerError / WorkerDiedError: `init_hook` raised, or a worker died while starting.
        """
        import ray

        if self._started:
            raise RuntimeError("WorkerGroup.start() was already called")
        if not ray.is_initialized():
            ray.init()
        t0 = time.monotonic()
        borrowed = self._resolve_placement_group()
        self._pool = SlotPool(self._bundle, self.placement_strategy, borrowed)
        try:
            self._start(borrowed, t0)
        except BaseException:
            self._teardown(force=True)
            raise
        self._started = True
        return self

    def _start(self, borrowed: Any, t0: float) -> None:
        assert self._pool is not None
        n_remote = self.num_workers - (1 if self.use_local else 0)
        waits = []
        if self.use_local:
            self._local = LocalWorker()
            self._workers = [Worker(local=self._local, info=self._local.runtime.describe())]
            if borrowed is None:
                pg = self._local.reserve(self._bundle, self.start_timeout_s)
                if pg is not None:
                    waits.append(pg.ready())
        slots = self._pool.create_main([self._bundle] * n_remote) if n_remote else []
        if slots and slots[0].owned:
            waits.append(slots[0].pg.ready())
        # Actors are created before the placement group is ready: Ray starts each one the moment
        # its bundle is reserved, with no round trip in between.
        spawned = spawn(slots, self._spec)
        self._workers += spawned
        request = describe_request(self.num_workers, self._bundle, self.placement_strategy)
        if not wait_ready(waits, self.start_timeout_s):
            raise ResourcesUnavailableError(
                f"Could not reserve {request} within {self.start_timeout_s:g}s; "
                f"the cluster has {describe_free_resources()}."
            )
        t_pg = time.monotonic()
        logger.debug("placement group ready in %.2fs", t_pg - t0)
        if self._local is not None:
            self._local.learn_gpu(self._spec.num_gpus)
        started, missing = await_started(spawned, self.start_timeout_s)
        died = [w.info["start_error"] for w in missing if "start_error" in w.info]
        if died:
            raise WorkerDiedError(
                f"{len(died)} of {n_remote} worker actors died while starting: {died[0]}",
                [],
                [],
            )
        if missing:
            raise ResourcesUnavailableError(
                f"Only {len(started)} of {n_remote} worker actors started within "
                f"{self.start_timeout_s:g}s for {request}; the cluster has {describe_free_resources()}."
            )
        t_actors = time.monotonic()
        logger.debug("%d actors up in %.2fs", len(started), t_actors - t_pg)
        run_hooks(
            started, self._local, self._spec.init_hook, first_rank=len(self._workers) - len(started)
        )
        self._form()
        t_done = time.monotonic()
        logger.info(
            "WorkerGroup of %d ready in %.2fs (placement %.2fs, actors %.2fs, process group %.2fs)",
            self.num_workers,
            t_done - t0,
            t_pg - t0,
            t_actors - t_pg,
            t_done - t_actors,
        )

    def _resolve_placement_group(self) -> Any:
        if self._placement_group_arg is None:
            return None
        if self._placement_group_arg == "auto":
            from ray.util import get_current_placement_group

            return get_current_placement_group()
        return self._placement_group_arg

    def _form(self) -> None:
        form_group(
            self._workers,
            backend=self.backend,
            timeout_s=self.timeout_s,
            formation_timeout_s=max(self.start_timeout_s, 10.0),
            remote_gpu_index=0 if self._spec.num_gpus else None,
        )
        self._broken = False

    def __enter__(self) -> WorkerGroup:
        return self if self._started else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker and free the placement groups (idempotent).

        Without `force`, workers first leave the process group cleanly (bounded wait); then the
        actors are killed and the placement groups removed, so their resources go back to Ray.
        """
        self._teardown(force=force)
        self._started = False

    def _teardown(self, force: bool) -> None:
        import ray

        if not ray.is_initialized():  # Ray already shut down: its actors and groups went with it
            self._workers = []
            if self._local is not None:
                self._local.runtime.destroy()
                self._local.reservation_pg = self._local._holder = None
                self._local.close()
                self._local = None
            return
        remote = [w for w in self._workers if w.actor is not None and w.alive]
        if not force and remote:
            refs = [w.actor.destroy_process_group.remote() for w in remote]
            ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for w in self._workers:
            kill_worker(w)
        self._workers = []
        if self._pool is not None:
            self._pool.remove_all()
        if self._local is not None:
            self._local.close()
            self._local = None

    # ------------------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        """Number of ranks in the current process group."""
        return len(self._workers)

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
            for w in self._workers
        ]

    @property
    def healthy(self) -> bool:
        """Started, and no failure since the last (re-)formation of the process group."""
        return self._started and not self._broken

    @property
    def needs_recovery(self) -> bool:
        """A worker raised or died: call `recover(n)` before running collectives again."""
        return self._started and self._broken

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
        remote = [w for w in self._workers if w.local is None]
        pending = {w.actor.run.remote(fn, *args, **kwargs): w.rank for w in remote}
        outcome = Outcome()
        if self._local is not None:
            self._run_local(outcome, fn, args, kwargs)
        self._finish(pending, outcome)
        return [outcome.results[r] for r in range(len(self._workers))]

    def execute_single(self, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on one rank and return its result (errors as in `execute`)."""
        self._check_usable()
        if not 0 <= rank < len(self._workers):
            raise ValueError(f"rank must be in [0, {len(self._workers)}), got {rank}")
        ship_by_value(fn, args, kwargs)
        worker = self._workers[rank]
        outcome = Outcome()
        pending = {}
        if worker.local is not None:
            self._run_local(outcome, fn, args, kwargs)
        else:
            pending = {worker.actor.run.remote(fn, *args, **kwargs): rank}
        self._finish(pending, outcome)
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
            for w in self._workers
            if w.local is None
        ]

    def _run_local(
        self, outcome: Outcome, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        import ray

        assert self._local is not None
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        kwargs = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
        from raysgd_core._internal.workers import _record_local

        _record_local(outcome, 0, self._local.runtime.run(fn, args, kwargs))

    def _finish(self, pending: dict, outcome: Outcome) -> None:
        by_rank = {w.rank: w for w in self._workers}
        collect(pending, outcome, kill=lambda r: kill_worker(by_rank[r]))
        if not outcome.ok:
            self._broken = True
            for r in outcome.died:
                by_rank[r].alive = False
            raise_for(outcome, lambda r: by_rank[r].node_id if r in by_rank else "?")

    def _check_usable(self) -> None:
        if not self._started:
            raise RuntimeError(
                "WorkerGroup is not started (call start() or use it as a context manager)"
            )
        if self._broken:
            raise RuntimeError(
                "WorkerGroup needs recovery after a worker failure: call recover(n) (or shutdown())"
            )

    # -------------------------------------------------------------------------------- recovery
    def recover(self, target_size: int, *, timeout_s: float = 60.0) -> RecoveryReport:
        """Replace dead or stuck workers and re-form the process group with up to `target_size` ranks.

        Survivors keep their process and `WorkerContext.store`; ranks are renumbered in the old
        order, new workers come last. As many new workers are started as actually start within
        `timeout_s` (the result may be smaller than `target_size`, even 0). When keeping the
        survivors fails, every remote worker is replaced ("full-restart").
        """
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        minimum = 1 if self.use_local else 0
        if (
            isinstance(target_size, bool)
            or not isinstance(target_size, int)
            or target_size < minimum
        ):
            raise ValueError(f"target_size must be an int >= {minimum}, got {target_size!r}")
        return _recovery.recover(self, target_size, timeout_s)

    def estimate_fitting(self) -> int:
        """A cheap guess of how many more workers the cluster has room for right now."""
        return estimate_fitting(self._bundle, self._pool)
