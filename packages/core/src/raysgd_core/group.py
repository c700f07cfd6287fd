"""`WorkerGroup`: N Ray actors with a ready `torch.distributed` process group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

from raysgd_base import check_int
from raysgd_core._internal import lifecycle, spares
from raysgd_core._internal.args import check_group_args
from raysgd_core._internal.failures import Outcome, collect, raise_for
from raysgd_core._internal.placement import estimate_fitting, make_bundle
from raysgd_core._internal.recovery import recover as _recover
from raysgd_core._internal.state import GroupSpec, GroupState
from raysgd_core._internal.workers import ActorSpec, kill_worker, record_local
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
        spare_workers: how many workers to keep started outside the process group, each in
            resources reserved like a worker's, to replace a lost worker at once: `recover`
            promotes the spares that are up (torch already imported) before it starts new actors,
            and starts new spares after every `start()` and `recover()`. They cost their
            resources and an idle process each; 0 (the default) keeps none.
        spare_imports: modules (a list or tuple of names) a spare imports while it waits,
            besides torch and the modules every worker imports: those a promoted worker would
            otherwise import after the loss (e.g. `torch.distributed.checkpoint` for a run whose
            state is sharded). A missing one is logged, not raised.
        keep_freed_memory: raise each worker's malloc thresholds (glibc only) so the memory a
            step frees is reused by the next one instead of being returned to the OS and faulted
            back in (what that costs: the raysgd-core README). Applied to the calling
            process too when `use_local` is set. Skipped where the environment already sets
            glibc's `MALLOC_*_` variables; False keeps the allocator's defaults.
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
        spare_workers: int = 0,
        spare_imports: Union[list[str], tuple[str, ...]] = (),
        keep_freed_memory: bool = True,
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
            spare_workers=spare_workers,
            spare_imports=spare_imports,
        )
        self._num_workers = num_workers
        self._placement_group_arg = placement_group
        backend = ("nccl" if num_gpus_per_worker else "gloo") if backend == "auto" else backend
        self._spec = GroupSpec(
            actor=ActorSpec(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                resources=dict(resources_per_worker or {}),
                env_vars={str(k): str(v) for k, v in (env_vars or {}).items()},
                init_hook=init_hook,
                keep_freed_memory=bool(keep_freed_memory),
            ),
            bundle=make_bundle(num_cpus_per_worker, num_gpus_per_worker, resources_per_worker),
            backend=backend,
            timeout_s=float(timeout_s),
            start_timeout_s=float(start_timeout_s),
            placement_strategy=placement_strategy,
            use_local=bool(use_local),
            spare_workers=spare_workers,
            spare_imports=tuple(spare_imports),
        )
        self._state = GroupState(self._spec)
        self._put_values: dict[str, Any] = {}  # ObjectRef hex -> the object `put` stored
        self._started = False

    # Read-only views of the spec (public since the first release).
    @property
    def use_local(self) -> bool:
        """Rank 0 runs in the calling process."""
        return self._spec.use_local

    @property
    def backend(self) -> str:
        """The process group's backend ("gloo" or "nccl")."""
        return self._spec.backend

    @property
    def timeout_s(self) -> float:
        """Timeout of the process group's collectives, in seconds."""
        return self._spec.timeout_s

    @property
    def start_timeout_s(self) -> float:
        """How long `start()` waits for resources, and then for the actors to come up."""
        return self._spec.start_timeout_s

    @property
    def placement_strategy(self) -> str:
        """The placement-group strategy of the workers started by `start()`."""
        return self._spec.placement_strategy

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
        try:
            lifecycle.start(self._state, self._num_workers, self._resolve_placement_group())
        except BaseException:
            lifecycle.teardown(self._state, force=True)
            raise
        self._started = True
        return self

    def _resolve_placement_group(self) -> Any:
        if self._placement_group_arg is None:
            return None
        if self._placement_group_arg == "auto":
            from ray.util import get_current_placement_group

            return get_current_placement_group()
        return self._placement_group_arg

    def __enter__(self) -> WorkerGroup:
        return self if self._started else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker and free the placement groups (idempotent).

        Without `force`, workers first leave the process group cleanly (bounded wait); then the
        actors are killed and the placement groups removed. It returns once Ray reports the groups
        removed (bounded wait), so their resources are back in `ray.available_resources()`.
        """
        lifecycle.teardown(self._state, force=force)
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
        return self._state.world_size

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
            for w in self._state.workers
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
            for w in spares.ready(self._state)
        ]

    @property
    def healthy(self) -> bool:
        """Started, and no failure since the last (re-)formation of the process group."""
        return self._started and not self._state.broken

    @property
    def needs_recovery(self) -> bool:
        """A worker raised or died: call `recover(n)` before running collectives again."""
        return self._started and self._state.broken

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
        remote = [w for w in self._state.workers if w.local is None]
        pending = {w.actor.run.remote(fn, *args, **kwargs): w.rank for w in remote}
        outcome = Outcome()
        if self._state.local is not None:
            self._run_local(outcome, fn, args, kwargs)
        self._finish(pending, outcome)
        return [outcome.results[r] for r in range(len(self._state.workers))]

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
        if not 0 <= rank < len(self._state.workers):
            raise ValueError(f"rank must be in [0, {len(self._state.workers)}), got {rank}")
        ship_by_value(fn, args, kwargs)
        worker = self._state.workers[rank]
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
            for w in self._state.workers
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
        if not 0 <= rank < len(self._state.workers):
            raise ValueError(f"rank must be in [0, {len(self._state.workers)}), got {rank}")
        worker = self._state.workers[rank]
        if worker.local is not None:
            raise ValueError(f"rank {rank} runs in this process: call it with execute_single")
        ship_by_value(fn, args, kwargs)
        return worker.actor.run_raising.remote(fn, *args, **kwargs)

    def _run_local(
        self, outcome: Outcome, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        import ray

        assert self._state.local is not None

        def resolve(value: Any) -> Any:
            if not isinstance(value, ray.ObjectRef):
                return value
            key = value.hex()
            return self._put_values[key] if key in self._put_values else ray.get(value)

        args = tuple(resolve(a) for a in args)
        kwargs = {k: resolve(v) for k, v in kwargs.items()}
        record_local(outcome, 0, self._state.local.runtime.run(fn, args, kwargs))

    def _finish(self, pending: dict, outcome: Outcome) -> None:
        by_rank = {w.rank: w for w in self._state.workers}
        collect(pending, outcome, kill=lambda r: kill_worker(by_rank[r]))
        if not outcome.ok:
            self._state.broken = True
            for r in outcome.died:
                by_rank[r].alive = False
            raise_for(outcome, lambda r: by_rank[r].node_id if r in by_rank else "?")

    def _check_usable(self) -> None:
        if not self._started:
            raise RuntimeError(
                "WorkerGroup is not started (call start() or use it as a context manager)"
            )
        if self._state.broken:
            raise RuntimeError(
                "WorkerGroup needs recovery after a worker failure: call recover(n) (or shutdown())"
            )

    # -------------------------------------------------------------------------------- recovery
    def recover(self, num_workers: int, *, timeout_s: float = 60.0) -> RecoveryReport:
        """Replace dead or stuck workers and re-form the process group with up to `num_workers` ranks.

        Survivors keep their process and `WorkerContext.store`; ranks are renumbered in the old
        order, new workers come last. As many new workers are started as actually start within
        `timeout_s` (the result may be smaller than `num_workers`, even 0). When keeping the
        survivors fails, every remote worker is replaced ("full-restart").
        """
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        check_int("num_workers", num_workers, minimum=1 if self.use_local else 0)
        self._num_workers = num_workers
        return _recover(self._state, num_workers, timeout_s)

    def retire(self, ranks: Sequence[int]) -> None:
        """Stop healthy workers on purpose, e.g. because their node is about to be reclaimed.

        The workers of `ranks` are killed and their slots are not reused while their node drains;
        spares on the same nodes are dropped too. The group then needs `recover(n)`, which keeps
        the others and starts replacements elsewhere (spares first), as after a loss.
        """
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        workers = self._state.workers
        bad = [r for r in ranks if not 0 <= r < len(workers)]
        if bad:
            raise ValueError(f"ranks {bad} are not in [0, {len(workers)})")
        if any(workers[r].local is not None for r in ranks):
            raise ValueError("rank 0 runs in this process (use_local=True) and cannot be retired")
        nodes = {workers[r].node_id for r in ranks}
        for r in ranks:
            self._state.drop(workers[r])
        spares.discard_on(self._state, nodes)
        self._state.broken = True

    def replace_spares_on(self, nodes: Iterable[str]) -> None:
        """Drop the spares on `nodes` (about to go away) and start new ones elsewhere."""
        if not self._started:
            raise RuntimeError("WorkerGroup is not started")
        spares.discard_on(self._state, set(nodes))
        spares.replenish(self._state)

    def estimate_fitting(self) -> int:
        """A cheap guess of how many more workers the cluster has room for right now (spares that
        are up count: `recover` promotes them)."""
        return estimate_fitting(self._spec.bundle, self._state.pool) + len(
            spares.ready(self._state)
        )
