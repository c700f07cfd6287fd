"""`TorchTrainer`: RaySGD's distributed PyTorch trainer on today's Ray and PyTorch.

The trainer is composed of parts, each owning one thing, and its public methods delegate to them:
`WorkerCalls` (`_internal/driver.py`: the `WorkerGroup`, how the per-worker runners are built, the
calls to them), a `TrainingState` (`_internal/trainer_state.py`: replicated or sharded, how the
state is restored, saved, loaded and what it falls back on), the `Recovery` loop (every resize),
`Preemption` (drain notices), `RunLoggers` (experiment trackers). Every worker holds one
long-lived `raysgd_operator.OperatorRunner` (see `raysgd._internal.worker`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from raysgd._internal import worker
from raysgd._internal.cluster import driver_has_cuda
from raysgd._internal.datasets import DatasetSplitter, check_datasets, warn_if_no_room_for_data
from raysgd._internal.driver import RunnerRecipe, WorkerCalls, in_one_form
from raysgd._internal.driver_copy import DEFAULT_LIMIT_MB
from raysgd._internal.preemption import Preemption
from raysgd._internal.recovery import Recovery
from raysgd._internal.restore_plan import RestoreOutcome
from raysgd._internal.run_loggers import RunLoggers, trainer_options
from raysgd._internal.trainer_keywords import route_keywords
from raysgd._internal.trainer_state import TrainingState, training_state
from raysgd._internal.validation import (
    check_optional_args,
    check_train_args,
    resolve_operator_cls,
    start_timeout,
)
from raysgd.loggers import Logger
from raysgd_base import check_int, check_number
from raysgd_core import (
    GroupOptions,
    WorkerError,
    WorkerGroup,
    ensure_ray,
    require_cluster_gpus,
    resolve_use_gpu,
)
from raysgd_fault import FailurePolicy, get_policy
from raysgd_operator import (
    NUM_SAMPLES,
    SHARDED_STATE_IMPORTS,
    DatasetOptions,
    TrainingOptions,
    check_batch_size,
    reduce_worker_results,
)

__all__ = ["TorchTrainer"]

logger = logging.getLogger("raysgd")


class TorchTrainer:
    """Train a PyTorch model on `num_workers` Ray workers with DistributedDataParallel.

    Built either from a `TrainingOperator` subclass (`training_operator_cls=`) or from RaySGD's creator
    functions (`model_creator=`, `data_creator=`, `optimizer_creator=`, optional `loss_creator=` and
    `scheduler_creator=`). All arguments are keyword-only and keep RaySGD's meaning; the new ones are
    `accumulate_grad_batches`, `clip_grad_norm`, `failure_policy` ("default", a registered name or a
    `raysgd_fault.FailurePolicy`), `checkpoint_dir` (where `train(checkpoint="auto")` writes) and
    `logdir` (TensorBoard scalars of every result). `timeout_s=None` reads `NCCL_TIMEOUT_S`, else 1800.

    `loggers=[...]` records the run in experiment trackers: `raysgd.loggers` instances
    (`MLflowLogger`, `WandbLogger`, `TensorBoardLogger`, `CSVLogger`, your own `Logger`) or their
    names ("mlflow", "wandb", "tensorboard", "csv"); `logdir=` adds a `TensorBoardLogger(logdir)`.

    `strategy` says how models are spread over the workers: "ddp" (default; `wrap_ddp=False` means
    "none"), "fsdp" (FSDP2: parameters, gradients and optimizer state sharded; `strategy_args`
    `shard_modules`, `reshard_after_forward`, `cpu_offload`), "none", or a registered
    `raysgd_operator.ParallelStrategy`. With "fsdp", `save()`/`checkpoint=` write a checkpoint directory
    (each worker its shards) that loads with any number of workers and any strategy. Every
    `snapshot_every` steps each fsdp worker snapshots its shards in memory, asynchronously, with a
    copy on a peer: a lost worker costs at most the steps since the last snapshot.
    `compile=True` runs `torch.compile(model, **compile_args)` on every worker after wrapping.
    `spare_workers=k` keeps k more workers started, in reserved resources, to replace lost ones at
    once (`raysgd_core.GroupOptions.spare_workers`).

    A node Ray drains for a preemption (a spot machine's warning) is left before its deadline: the
    workers stop at a step boundary, spares or new workers elsewhere take over (or the group shrinks
    where there is no room) and training goes on from that step; not counted as a failure.

    The training state stays on the workers. After a lost worker, the survivor furthest along
    gives its state to the replacements and training goes on from the last finished step: at most
    the step in flight is done again, and the rest of the epoch is re-split over the new group so
    that every row is trained once. Only when every worker is lost at once does the state come
    from elsewhere: the last checkpoint written or loaded, or the driver's copy, which it keeps of
    states up to `state_copy_limit_mb` (refreshed after `train()` calls, asynchronously, within a
    small bounded share of the training time, which the raysgd README gives; 0 turns it off).

    User errors have one form. An exception raised by user code on a worker (an operator's hook,
    a creator, a function given to `apply_all_workers`) is not retried, and every method (`train`,
    `validate`, `save`, `load`, `state_dict`, `get_model`, `apply_*`, ...) raises it as one
    exception that is an instance of both `raysgd_core.WorkerError` (the worker's traceback in its
    message; `rank`, `node_id`, `remote_traceback`) and the user's exception class (its `args` and
    attributes; the original is `__cause__`), so `except WorkerError` and `except ValueError` both
    catch a worker's ValueError. Where that class cannot be subclassed it is a plain `WorkerError`
    with the original as `__cause__`. Before it is raised the group is repaired (its size kept,
    every worker at the last step the group finished, recorded in `recovery_events`) and the
    trainer stays usable. At construction, a ValueError or TypeError from a creator or `setup` is
    the user's input error and is raised as itself, chained to the `WorkerError`.

    `datasets={"train": ds, "validation": ds2}` feeds the loops from Ray Data (`raysgd[data]`): each
    dataset is split over the workers with `streaming_split(n, equal=True)`, again after every
    resize or recovery, and each worker draws batches of its `config[BATCH_SIZE]` share;
    `dataset_options` (a `raysgd.DatasetOptions` or a dict of its fields) sets the columns that
    make the `(*features, target)` batch, dtypes, a collate function and shuffling.

    Example::

        trainer = TorchTrainer(model_creator=..., data_creator=..., optimizer_creator=...,
                               loss_creator=nn.MSELoss, config={BATCH_SIZE: 64}, num_workers=2)
        for _ in range(5):
            print(trainer.train(), trainer.validate())
        model = trainer.get_model()
        trainer.shutdown()
    """

    def __init__(
        self,
        *,
        training_operator_cls: Optional[type] = None,
        model_creator: Optional[Callable[..., Any]] = None,
        data_creator: Optional[Callable[..., Any]] = None,
        optimizer_creator: Optional[Callable[..., Any]] = None,
        loss_creator: Optional[Any] = None,
        scheduler_creator: Optional[Callable[..., Any]] = None,
        initialization_hook: Optional[Callable[[], None]] = None,
        config: Optional[dict[str, Any]] = None,
        num_workers: int = 1,
        num_cpus_per_worker: float = 1,
        use_gpu: Union[bool, str] = "auto",
        backend: str = "auto",
        wrap_ddp: bool = True,
        timeout_s: Optional[float] = None,
        use_fp16: Any = False,
        apex_args: Optional[dict[str, Any]] = None,
        use_tqdm: bool = False,
        add_dist_sampler: bool = True,
        scheduler_step_freq: Optional[str] = None,
        use_local: bool = False,
        serialize_data_creation: bool = True,
        accumulate_grad_batches: int = 1,
        clip_grad_norm: Optional[float] = None,
        failure_policy: Union[str, FailurePolicy] = "default",
        checkpoint_dir: Optional[str] = None,
        logdir: Optional[str] = None,
        loggers: Optional[Sequence[Union[str, Logger]]] = None,
        strategy: Any = "ddp",
        strategy_args: Optional[dict[str, Any]] = None,
        compile: bool = False,
        compile_args: Optional[dict[str, Any]] = None,
        datasets: Optional[dict[str, Any]] = None,
        dataset_options: Union[DatasetOptions, dict[str, Any], None] = None,
        spare_workers: int = 0,
        state_copy_limit_mb: float = DEFAULT_LIMIT_MB,
        snapshot_every: int = 20,
    ) -> None:
        # The keywords as given, before anything else is bound in this frame.
        keywords = {name: value for name, value in locals().items() if name != "self"}
        # Everything that can be checked on the driver is checked before any worker starts.
        self._num_workers = check_int("num_workers", num_workers)
        given_datasets, dataset_options = check_datasets(datasets, dataset_options, config or {})
        check_optional_args(
            config=config,
            num_cpus_per_worker=num_cpus_per_worker,
            initialization_hook=initialization_hook,
        )
        check_number("state_copy_limit_mb", state_copy_limit_mb)
        # A global batch too small to give every worker a sample fails here, not on the workers.
        check_batch_size(config or {}, self._num_workers)
        # The options of the workers and of their group, each validated once here and shipped
        # whole. Keywords named like a field fill it (`trainer_keywords` says where the rest go).
        training_fields, group_fields = route_keywords(keywords)
        self._options = TrainingOptions(
            **training_fields,
            use_gpu=resolve_use_gpu(use_gpu),
            num_threads=max(1, int(num_cpus_per_worker)),
            dataset_options=dataset_options,
            distributed=self._num_workers > 1,
        )
        self._operator_cls = resolve_operator_cls(
            training_operator_cls,
            model_creator=model_creator,
            data_creator=data_creator,
            optimizer_creator=optimizer_creator,
            loss_creator=loss_creator,
            scheduler_creator=scheduler_creator,
            serialize_data_creation=serialize_data_creation,
            has_datasets=bool(given_datasets),
        )
        policy = get_policy(failure_policy)
        # Built (arguments checked) before Ray starts; nothing runs until `start()`.
        group = WorkerGroup(
            self._num_workers,
            GroupOptions(
                **group_fields,
                num_cpus_per_worker=num_cpus_per_worker,
                num_gpus_per_worker=1 if self._options.use_gpu else 0,
                spare_imports=SHARDED_STATE_IMPORTS if self._options.sharded else (),
                **start_timeout(),
            ),
        )
        ensure_ray()
        if self._options.use_gpu:
            require_cluster_gpus()
        if given_datasets:
            warn_if_no_room_for_data(self._num_workers, num_cpus_per_worker)
        # Before any worker starts, so that a missing tracker library or a bad name costs nothing.
        self._loggers = RunLoggers.start(
            loggers,
            logdir=logdir,
            config=config or {},
            options=trainer_options(
                self._options,
                group.options,
                num_workers=self._num_workers,
                failure_policy=policy.name,
                state_copy_limit_mb=state_copy_limit_mb,
            ),
        )
        self._checkpoint_dir = checkpoint_dir
        self._shut_down = False
        # Names each train() call, so that a call a failure interrupted is continued, not
        # started again.
        self._call_id = 0
        # The operator class (and the creator functions a built one holds) is pickled once, here:
        # every start and restart reuses this copy. Pickling it again at a restart would take
        # its closure cells as they are then: one that by then refers to the trainer itself
        # would ship the whole trainer (or fail to pickle it).
        creators = (model_creator, data_creator, optimizer_creator, loss_creator, scheduler_creator)
        if dataset_options is not None:
            # Travels inside the options: registering its module ships it by value too.
            creators += (dataset_options.collate_fn,)
        try:
            recipe = RunnerRecipe(
                operator_ref=group.put(
                    self._operator_cls, by_value=tuple(fn for fn in creators if fn is not None)
                ),
                options=self._options,
                user_config=dict(config or {}),
                config=dict(config or {}),
                datasets=DatasetSplitter(given_datasets),
            )
            # The parts. The state knows how it is kept and restored; the recovery loop owns
            # every resize (after a loss, to grow, to move off a draining node, to repair after a
            # failed call) and restores through the state; the worker calls go through the loop.
            self._state: TrainingState = training_state(
                self._options.sharded,
                copy_limit_bytes=int(state_copy_limit_mb * 2**20),
                use_local=group.use_local,
            )
            self._recovery = Recovery(
                group=group,
                num_workers=self._num_workers,
                restore=self._restore_after_resize,
                policy=policy,
            )
            self._workers = WorkerCalls(group, recipe, self._recovery)
            self._start_workers()
            self._preemption = Preemption(
                group=lambda: group,
                recovery=self._recovery,
                before_retire=lambda leaving: self._state.prepare_leaving(self._workers, leaving),
                local_checkpoint=self._checkpoint_at_notice,
            )
        except BaseException:
            # Whatever fails once the loggers have started (pickling the user's creators,
            # starting the workers, ...) leaves no worker running and no run open in a tracker:
            # finished while the error propagates, the runs are marked failed.
            self._shut_down = True
            try:
                group.shutdown()
            finally:
                self._loggers.finish(status="failed")
            raise

    # --------------------------------------------------------------------------------- public
    def train(
        self,
        num_steps: Optional[int] = None,
        profile: bool = False,
        reduce_results: bool = True,
        max_retries: int = 3,
        checkpoint: Optional[Union[str, os.PathLike]] = None,
        info: Optional[dict[str, Any]] = None,
    ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """One pass over the training data (or `num_steps` batches, continuing where the last call
        stopped) on every worker; survives lost workers up to `max_retries` times.

        Returns the results reduced over batches then workers (`epoch`, `batch_count`, `num_samples`,
        `train_loss`, `last_train_loss`, custom metrics; `profile` timers with `profile=True`), or
        the per-worker list with `reduce_results=False`. `checkpoint="auto"` (or a file path) also
        writes the state from before this call to disk, atomically (by a worker on this machine:
        the state does not pass through the driver).

        After a lost worker the call goes on from the last step the group finished; its results
        then count every step of the call once, and `num_samples` every row once, also those of
        workers lost in it (whose loss values are lost with them: the averages cover the rest).
        An exception raised by user code is not retried: it is raised in the one form every
        method gives it (see the class docstring).
        """
        self._check_alive()
        check_train_args(max_retries, checkpoint, num_steps)
        self._recovery.maybe_grow(max_retries=max_retries)
        self._move_off_draining(max_retries)
        if checkpoint:
            self._write_checkpoint(checkpoint)
        self._call_id += 1
        call_id = self._call_id
        watch = [self._preemption.watch_spec()]
        group = self._workers.group

        def attempt() -> list[tuple[dict, int, Optional[int], bool]]:
            # Recovery re-forms the group in place between attempts. After a failure the same
            # call id makes the workers go on with the call, not start it again.
            return group.execute(worker.train_epoch, num_steps, profile, info, call_id, watch[0])

        while True:
            returned = self._workers.run(attempt, max_retries=max_retries)
            if not any(answer[3] for answer in returned):
                break
            # The workers stopped together at a step boundary: a node of theirs is draining.
            self._move_off_draining(max_retries)
            watch[0] = self._preemption.watch_spec()
        self._state.after_train(self._workers, max(answer[1] for answer in returned))
        results = [answer[0] for answer in returned]
        rows = [answer[2] for answer in returned if answer[2] is not None]
        return self._results("train", results, reduce_results, rows[0] if rows else None)

    def validate(
        self,
        num_steps: Optional[int] = None,
        profile: bool = False,
        reduce_results: bool = True,
        info: Optional[dict[str, Any]] = None,
    ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """Evaluate on the validation data: `batch_count`, `num_samples`, `val_loss`,
        `last_val_loss`, `val_accuracy`, `last_val_accuracy` (and custom metrics)."""
        self._check_alive()
        if num_steps is not None:
            check_int("num_steps", num_steps)
        results = self._workers.call(worker.validate, num_steps, profile, info)
        return self._results("validate", results, reduce_results)

    def state_dict(self) -> dict[str, Any]:
        """The full training state (`epoch`, `operator`, `models`, `optimizers`, `schedulers`,
        `precision`, position), on the CPU."""
        self._check_alive()
        return self._state.state_dict(self._workers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (from `state_dict()` or a checkpoint) into every worker."""
        self._check_alive()
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict from TorchTrainer.state_dict(), got {type(state)}"
            )
        self._state.load_state_dict(self._workers, state)

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Write the state to `path` atomically; returns the absolute path. A worker on this
        machine writes it, so the state does not pass through the driver."""
        self._check_alive()
        return self._state.save(self._workers, path)

    def load(self, path: Union[str, os.PathLike]) -> None:
        """Load a checkpoint written by `save` into every worker. Never runs code from the file; a
        file that is not a checkpoint raises ValueError and leaves the trainer as it was."""
        self._check_alive()
        self._state.load(self._workers, path)

    def get_model(self, to_cpu: bool = False) -> Any:
        """The trained model(s), without DDP wrappers (one model bare, several as a list).

        `to_cpu=True` returns CPU copies. On a driver without CUDA, models trained on GPUs come back
        as CPU copies anyway (they could not be unpickled here otherwise); a model already on the
        CPU comes back as it is.
        """
        self._check_alive()
        self._state.require_whole_model()
        models = self._workers.read(worker.get_models, to_cpu, not driver_has_cuda())
        if isinstance(models, (list, tuple)) and len(models) == 1:
            return models[0]
        return list(models) if isinstance(models, tuple) else models

    def get_local_operator(self) -> Any:
        """The rank-0 operator living in this process; only with `use_local=True`."""
        self._check_alive()
        if not self._workers.use_local:
            raise NotImplementedError(
                "get_local_operator() needs TorchTrainer(use_local=True): without it every operator "
                "lives in a remote worker (use apply_all_operators instead)"
            )
        return self._workers.call(worker.get_operator, rank=0)

    def update_scheduler(self, metric: Any) -> None:
        """Step every registered scheduler with `metric` on every worker (`scheduler_step_freq="manual"`)."""
        self._check_alive()
        self._workers.call(worker.update_scheduler, metric)

    def apply_all_workers(self, fn: Callable[[], Any]) -> list[Any]:
        """`fn()` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_workers needs a zero-argument callable")
        return self._workers.call(worker.apply_fn, fn)

    def apply_all_operators(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(operator)` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_operators needs a callable taking the operator")
        return self._workers.call(worker.apply_operator, fn)

    def shutdown(self, force: bool = False) -> None:
        """Stop the workers and release their resources. Calling it again does nothing; any other
        method then raises RuntimeError. `force=True` kills the workers without a graceful stop."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            self._workers.stop(force)
        finally:
            self._loggers.finish(self._recovery.events)

    def __enter__(self) -> TorchTrainer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    @classmethod
    def as_trainable(
        cls, *args: Any, override_tune_step: Optional[Callable[..., Any]] = None, **kwargs: Any
    ) -> type:
        """A Ray Tune trainable class that builds this trainer from `kwargs` (Tune's config wins)."""
        from raysgd_tune import make_trainable  # Tune is an optional extra: import only when used

        return make_trainable(cls, *args, override_tune_step=override_tune_step, **kwargs)

    # ----------------------------------------------------------------------------- properties
    @property
    def config(self) -> dict[str, Any]:
        """The trainer's config; `config[BATCH_SIZE]` is the global batch actually used."""
        return self._workers.recipe.config

    @property
    def num_workers(self) -> int:
        """Workers training now (fewer than asked for after a loss the cluster could not refill)."""
        self._check_alive()
        return self._workers.world_size

    @property
    def failures(self) -> int:
        """Worker failures seen over the trainer's life."""
        return int(self._recovery.failures)

    @property
    def recovery_events(self) -> list[Any]:
        """What the recovery loop saw and did (failures, decisions, resizes)."""
        return list(getattr(self._recovery, "events", []))

    @property
    def worker_group(self) -> WorkerGroup:
        """The `raysgd_core.WorkerGroup` running the workers."""
        self._check_alive()
        return self._workers.group

    # ------------------------------------------------------------------------------- internals
    def _start_workers(self) -> None:
        """Start the workers and their runners (on an error the constructor stops them)."""
        try:
            first = self._workers.start(self._state.copy_limit_bytes)
            self._state.started(self._workers, first)
        except WorkerError as exc:
            if isinstance(exc.__cause__, (ValueError, TypeError)):
                # A bad creator or operator set-up is the user's input error: raise it as its
                # own type, chained to the WorkerError that holds the worker's traceback (the
                # cause's own frames do not survive the trip back from the worker).
                raise exc.__cause__ from exc
            raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception)

    def _restore_after_resize(self, report: Any = None) -> RestoreOutcome:
        """The recovery loop's restore seam: the state brings every worker of the re-formed
        group back (see `TrainingState.restore`)."""
        return self._state.restore(self._workers)

    def _move_off_draining(self, max_retries: int) -> None:
        """Act on preemption notices for the group's nodes (see `Preemption`). A move that fails
        (the node went first) is counted as a loss and leaves the group to the recovery loop."""
        self._preemption.handle(max_retries=max_retries)

    def _checkpoint_at_notice(self) -> Optional[str]:
        """A checkpoint written now, when rank 0 cannot leave a draining node (use_local)."""
        if self._checkpoint_dir is None:
            return None
        return self._write_checkpoint("auto")

    def _write_checkpoint(self, checkpoint: Union[str, os.PathLike]) -> str:
        """Write the current state to `checkpoint` or, for "auto", into `checkpoint_dir`."""
        if checkpoint == "auto":
            if self._checkpoint_dir is None:
                self._checkpoint_dir = tempfile.mkdtemp(prefix="raysgd-checkpoints-")
                logger.info("checkpoint='auto' writes to %s", self._checkpoint_dir)
            checkpoint = os.path.join(self._checkpoint_dir, self._state.checkpoint_name)
        return self._state.save(self._workers, checkpoint)

    def _results(
        self, kind: str, results: list[dict], reduce_results: bool, call_rows: Optional[int] = None
    ) -> Any:
        reduced = reduce_worker_results(results) if reduce_results or self._loggers else None
        if reduced is not None and call_rows is not None:
            # A call that went on after a recovery knows the rows the whole group trained in it,
            # those of workers lost meanwhile included: that is the call's num_samples.
            reduced[NUM_SAMPLES] = call_rows
        if self._loggers:
            self._loggers.log(
                kind, reduced, num_workers=self._workers.world_size, events=self._recovery.events
            )
        return reduced if reduce_results else results

    def _check_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("This TorchTrainer has been shut down; create a new one.")
