"""`TorchTrainer`: RaySGD's distributed PyTorch trainer on today's Ray and PyTorch.

The trainer is composed of parts, each the one owner of its concern, and its public methods check
their arguments and delegate: `WorkerCalls` (the `WorkerGroup`, how the per-worker runners are
built), `TrainingState` (where the training state is, how it is restored, saved and loaded),
`Checkpoints` (`checkpoint_dir`), the `RunController` (the one loop of every train call, loss,
drain, grow and resize, and every call guarded by it) and `RunLoggers` (experiment trackers). Calls
go top-down: the trainer to the controller, the controller to the state, the state to the workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from raysgd._internal.driver.arguments import (
    check_optional_args,
    check_train_args,
    resolve_gpus_per_worker,
    resolve_operator_cls,
    start_timeout,
)
from raysgd._internal.driver.checkpoints import Checkpoints, KnownCheckpoints, checkpoint_root
from raysgd._internal.driver.cluster import available_memory_bytes, driver_has_cuda
from raysgd._internal.driver.controller import CallSpec, RunController
from raysgd._internal.driver.datasets import (
    DatasetSplitter,
    check_datasets,
    warn_if_no_room_for_data,
)
from raysgd._internal.driver.goodput import GoodputMeter
from raysgd._internal.driver.guard import in_one_form
from raysgd._internal.driver.keywords import route_keywords
from raysgd._internal.driver.run_loggers import RunLoggers, trainer_options
from raysgd._internal.driver.state_copy import DEFAULT_LIMIT_MB, DriverCopy
from raysgd._internal.driver.training_state import TrainingState
from raysgd._internal.driver.worker_calls import RunnerRecipe, WorkerCalls
from raysgd._internal.state.pick import kind_for
from raysgd._internal.worker import calls as worker
from raysgd._internal.worker.collective_bound import slow_bound
from raysgd.loggers import Logger
from raysgd_base import check_int, check_number
from raysgd_core import (
    DEFAULT_PEER_GRACE_S,
    GroupOptions,
    WorkerError,
    WorkerGroup,
    ensure_ray,
    require_cluster_gpus,
    resolve_timeout,
    resolve_use_gpu,
)
from raysgd_fault import FailurePolicy, get_policy
from raysgd_operator import (
    BatchSplit,
    DatasetOptions,
    TrainingOptions,
    reduce_worker_results,
)

__all__ = ["TorchTrainer"]

logger = logging.getLogger("raysgd")


class TorchTrainer:
    """Train a PyTorch model on `num_workers` Ray workers (RaySGD's `TorchTrainer`).

    All arguments are keyword-only. Build it from a `TrainingOperator` subclass or from RaySGD's
    creator functions; the root README and the raysgd package README show both.

    Args:
        training_operator_cls: a `TrainingOperator` subclass (operator style).
        model_creator, data_creator, optimizer_creator, loss_creator, scheduler_creator:
            RaySGD's creator functions (creator style); `loss_creator` may also be a loss class
            or instance.
        initialization_hook: called with no arguments on every worker before anything else.
        config: passed to every hook; `config[BATCH_SIZE]` is the global batch, split over the
            workers.
        num_workers: workers to train on (> 0).
        num_cpus_per_worker: CPUs reserved per worker (> 0); also the worker's torch threads.
        use_gpu: True, False or "auto" (a GPU per worker when this machine has CUDA).
        num_gpus_per_worker: GPUs each worker reserves (None: one with `use_gpu`). A share
            below one (0.5) lets workers share a GPU, where NCCL refuses two ranks: give them
            `backend="gloo"` (enough for ddp; fsdp needs a GPU per worker). Above one, whole.
        backend: "gloo", "nccl" or "auto".
        wrap_ddp: wrap models in DistributedDataParallel (False: strategy "none").
        timeout_s: the longest a collective may wait (None: `NCCL_TIMEOUT_S`, else 1800 s).
        use_fp16: False, True (native mixed precision), "fp16", "bf16", "apex" or a
            `raysgd_amp.Precision`.
        apex_args: keyword arguments of Apex's `amp.initialize` (with ``use_fp16="apex"``).
        use_tqdm: progress bars on rank 0.
        add_dist_sampler: split registered DataLoaders over the workers.
        scheduler_step_freq: "batch", "epoch" or "manual" (`update_scheduler`).
        use_local: rank 0 runs in this process.
        serialize_data_creation: `data_creator` runs on one worker at a time.
        accumulate_grad_batches: batches whose gradients are summed before each optimizer step
            (a window): `num_steps`, `batch_count`, `checkpoint_every` and `global_step` count
            batches (micro-batches), "batch" schedulers step once per optimizer step, and a
            recovery, a load or a resume goes back to the start of the window it falls in.
        clip_grad_norm: clip the total gradient norm to this value before each step.
        failure_policy: "default", "elastic", "never", a registered name or a
            `raysgd_fault.FailurePolicy`: what to do after a lost worker.
        checkpoint_dir: where `train(checkpoint="auto")` and `checkpoint_every` write (a path or
            any fsspec URL: s3://, gs://, abfs://, memory://, file://). Without it, "auto" writes
            to a temporary folder that `shutdown()` removes.
        storage_options: fsspec options (endpoint, credentials) for `checkpoint_dir` and for the
            URLs given to `save` and `load`; else each client reads the environment. Never
            logged or stored.
        checkpoint_every: write a checkpoint every this many steps (batches) inside `train()`
            calls, at the first end of an accumulation window at or after each, in the
            background (the loop waits only for the copy to host memory), each into a new folder
            of `checkpoint_dir` with its manifest written last (0: never).
        keep_checkpoints: how many complete checkpoints of `checkpoint_every` to keep (None: all);
            older ones are removed only after a newer one is complete.
        resume: before the first call, load the newest complete checkpoint in `checkpoint_dir`
            (the data position included: the run goes on at the row after it, on any number of
            workers); with none, start fresh and say so.
        logdir: TensorBoard scalars of every result.
        loggers: experiment loggers (`raysgd.loggers` instances or names: "mlflow", "wandb",
            "tensorboard", "csv").
        strategy: "ddp" (default), "fsdp" (FSDP2), "none" or a registered
            `raysgd_operator.ParallelStrategy`; `strategy_args` are its keyword arguments.
        compile: `torch.compile` every model after wrapping (`compile_args` its arguments).
        datasets: Ray Data datasets by name ("train", "validation"), split over the workers;
            `dataset_options` (a `raysgd.DatasetOptions` or a dict) says how batches are drawn.
        spare_workers: workers kept started, in reserved resources, to replace lost ones at once.
        state_copy_limit_mb: the largest whole state the driver keeps a copy of, for the day every
            worker is lost at once (0: none).
        snapshot_every: with "fsdp", every how many steps each worker snapshots its part in
            memory, with a copy on a peer; "auto": as often as keeps their measured cost under
            3% of the training time.
        snapshot_memory_mb: with "fsdp", the host memory each worker's snapshots may take (two
            copies of its part, four while one is taken); when four do not fit, none is kept and
            a lost worker costs a return to the newest checkpoint. None: no bound.
        peer_timeout_s: how long a worker may go without answering the driver's probes (a stopped
            process, a frozen or cut-off node) before it is killed and replaced, in any phase;
            also the shortest time a worker waits for a peer in a training step's collective
            (that bound grows with the step time).
        flops_per_sample: the model's FLOPs in one training step per unit of `num_samples`
            (per row, or per token when `train_batch` counts tokens; see
            `raysgd_operator.measure_flops_per_sample`): `train()` then reports `flops_per_s`
            and `mfu`.
        peak_flops_per_s: one device's peak FLOP/s for `mfu` (None: a table of known GPUs by
            device name and compute dtype; on a CPU, no `mfu` without it).

    Raises:
        ValueError, TypeError: a bad argument, before any worker starts (a bad creator or `setup`
            is raised as itself too).
        ImportError: a `checkpoint_dir` URL whose client library is missing (names the extra).
        raysgd_core.ResourcesUnavailableError: the cluster could not start the workers.

    User errors have one form: an exception raised by user code on a worker reaches the caller of
    any method as one exception that is both a `raysgd_core.WorkerError` (with the worker's
    traceback) and an instance of the user's exception class; it is not retried, and the trainer
    stays usable. Lost workers are recovered as the raysgd package README describes.
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
        num_gpus_per_worker: Optional[float] = None,
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
        snapshot_every: Union[int, str] = "auto",
        snapshot_memory_mb: Optional[float] = None,
        peer_timeout_s: float = 10.0,
        flops_per_sample: Optional[float] = None,
        peak_flops_per_s: Optional[float] = None,
        storage_options: Optional[dict[str, Any]] = None,
        checkpoint_every: int = 0,
        keep_checkpoints: Optional[int] = None,
        resume: bool = False,
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
        # A checkpoint_dir whose client is missing or that the credentials cannot reach fails
        # here, before any worker starts.
        checkpoint_location = checkpoint_root(
            checkpoint_dir,
            storage_options,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            resume=resume,
        )
        # A global batch too small to give every worker a sample fails here, not on the workers;
        # one that does not divide is said here, once. Resizes split it again for their size.
        batch_split = BatchSplit.of(config or {}, self._num_workers)
        batch_split.warn_if_uneven()
        # The options of the workers and of their group, each validated once here and shipped
        # whole. Keywords named like a field fill it (`driver.keywords` says where the rest go).
        training_fields, group_fields = route_keywords(keywords)
        self._options = TrainingOptions(
            **training_fields,
            use_gpu=resolve_use_gpu(use_gpu),
            num_threads=max(1, int(num_cpus_per_worker)),
            dataset_options=dataset_options,
            distributed=self._num_workers > 1,
        )
        # What the strategy's workers hold: all the driver does differently for a sharded state.
        self._kind = kind_for(self._options)
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
        # A rank waits for a peer in one collective at most the slow bound (see
        # `collective_bound`): the group is formed with it, and after a failure the other ranks
        # get that long to come back before they count as stuck.
        slow_s = slow_bound(resolve_timeout(timeout_s), self._options.peer_timeout_s)
        group = WorkerGroup(
            self._num_workers,
            GroupOptions(
                **group_fields,
                timeout_s=slow_s,
                peer_grace_s=slow_s + DEFAULT_PEER_GRACE_S,
                # A stopped worker is found by the driver's probes within this, whatever the
                # phase: the collectives' slow bound is for hung processes that still answer.
                liveness_timeout_s=self._options.peer_timeout_s,
                num_cpus_per_worker=num_cpus_per_worker,
                num_gpus_per_worker=resolve_gpus_per_worker(
                    num_gpus_per_worker, self._options.use_gpu
                ),
                spare_imports=self._kind.spare_imports,
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
        self._shut_down = False
        self._goodput = GoodputMeter()
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
                datasets=DatasetSplitter(given_datasets),
                state_class=self._kind.worker_class,
                splits={self._num_workers: batch_split},
            )
            # The parts, built top-down: each gets what it calls, nothing calls back up.
            self._workers = WorkerCalls(group, recipe)
            known = KnownCheckpoints(checkpoint_location, self._kind.checkpoint_name)
            self._state = TrainingState(
                self._workers,
                kind=self._kind,
                copy=DriverCopy(int(state_copy_limit_mb * 2**20)),
                known=known,
                storage_options=storage_options,
            )
            self._checkpoints = Checkpoints(
                self._state, known, every=checkpoint_every, keep=keep_checkpoints
            )
            self._controller = RunController(
                group=group,
                num_workers=self._num_workers,
                state=self._state,
                policy=policy,
                checkpoints=self._checkpoints,
            )
            # What each resize and checkpoint cost, as the controller records and reports it;
            # the events for the trackers.
            self._controller.log.subscribe(self._goodput.take)
            self._controller.subscribe(self._goodput.on_transition)
            self._controller.log.subscribe(self._loggers.take, amended=self._loggers.amend)
            self._start_workers()
            if resume:
                self._checkpoints.resume()
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
        `train_loss`, `last_train_loss`, custom metrics; `profile` timers with `profile=True`;
        the throughput: `loop_s`, `samples_per_s` or `tokens_per_s`, and `flops_per_s` and `mfu`
        with `flops_per_sample`, see `raysgd_operator.throughput`), or the per-worker list with
        `reduce_results=False`. `checkpoint="auto"` (or a file path) also
        writes the state from before this call to disk, atomically (by a worker on this machine:
        the state does not pass through the driver).

        `num_steps` counts batches (micro-batches with `accumulate_grad_batches`). After a lost
        worker the call goes on from the start of the accumulation window the group was in (the
        last step it finished, without accumulation), every batch of that window done again; its results
        then count every step of the call once, and `num_samples` every row once, also those of
        workers lost in it (whose loss values are lost with them: the averages cover the rest).
        A `train_batch` whose `num_samples` counts something else than rows (tokens, say) gets
        the sum of what the ranks counted: what a lost rank had counted in the call travels with
        its per-rank state to the worker that takes its place. Only a batch whose `train_batch`
        never returned (its worker lost between the optimizer step and the return) is counted
        at that rank's mean batch.
        An exception raised by user code is not retried: it is raised in the one form every
        method gives it (see the class docstring).
        """
        self._check_alive()
        check_train_args(max_retries, checkpoint, num_steps)
        with self._goodput.call():
            answers = self._controller.run(
                CallSpec(num_steps, profile, info, max_retries, checkpoint)
            )
        rows = [answer.rows for answer in answers if answer.rows is not None]
        metrics = [answer.metrics for answer in answers]
        return self._results("train", metrics, rows[0] if rows else None, reduce_results)

    def validate(
        self,
        num_steps: Optional[int] = None,
        profile: bool = False,
        reduce_results: bool = True,
        info: Optional[dict[str, Any]] = None,
    ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """Evaluate on the validation data: `batch_count`, `num_samples`, `val_loss`,
        `last_val_loss`, `val_accuracy`, `last_val_accuracy` (and custom metrics).

        A worker lost meanwhile is replaced and the call done again on the new group, from the
        start of a validation pass (every row counted once)."""
        self._check_alive()
        if num_steps is not None:
            check_int("num_steps", num_steps)
        with self._goodput.call():
            results = self._controller.guard.again_once(
                self._controller.guard.call, worker.validate, num_steps, profile, info
            )
        self._goodput.end_call(0.0)
        return self._results("validate", results, None, reduce_results)

    def state_dict(self) -> dict[str, Any]:
        """The full training state (`epoch`, `operator`, `models`, `optimizers`, `schedulers`,
        `precision`, position), on the CPU."""
        self._check_alive()
        return self._controller.guard.again_once(self._state.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (from `state_dict()` or a checkpoint) into every worker."""
        self._check_alive()
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict from TorchTrainer.state_dict(), got {type(state)}"
            )
        with self._controller.guard.guarded():
            self._checkpoints.load_state_dict(state)

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Write the state to `path` atomically; returns the absolute path. A worker on this
        machine writes it, so the state does not pass through the driver."""
        self._check_alive()
        return self._controller.guard.again_once(self._checkpoints.save, path)

    def load(self, path: Union[str, os.PathLike]) -> None:
        """Load a checkpoint written by `save` into every worker. Never runs code from the file; a
        file that is not a checkpoint raises ValueError and leaves the trainer as it was."""
        self._check_alive()
        with self._controller.guard.guarded():
            self._checkpoints.load(path)

    def get_model(self, to_cpu: bool = False) -> Any:
        """The trained model(s), without wrappers (one model bare, several as a list).

        `to_cpu=True` returns CPU copies. On a driver without CUDA, models trained on GPUs come back
        as CPU copies anyway (they could not be unpickled here otherwise); a model already on the
        CPU comes back as it is. With a sharded strategy (``fsdp``) every parameter is gathered
        once into new, whole models on the CPU; a MemoryError names the size when they cannot fit
        in this process.
        """
        self._check_alive()
        if not self._kind.gathers_models:
            models = self._controller.guard.read(worker.get_models, to_cpu, not driver_has_cuda())
        else:
            needed = self._controller.guard.read(worker.models_nbytes)
            available = available_memory_bytes()
            if available is not None and needed > available:
                raise MemoryError(
                    f"get_model() gathers the whole model, {needed / 2**30:.2f} GiB, into this "
                    f"process, which has {available / 2**30:.2f} GiB available: save() a "
                    "checkpoint instead and load it where it fits"
                )
            models = self._controller.guard.call(worker.get_models, True, True)[0]
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
        return self._controller.guard.call(worker.get_operator, rank=0)

    def update_scheduler(self, metric: Any) -> None:
        """Step every registered scheduler with `metric` on every worker (`scheduler_step_freq="manual"`)."""
        self._check_alive()
        self._controller.guard.call(worker.update_scheduler, metric)

    def apply_all_workers(self, fn: Callable[[], Any]) -> list[Any]:
        """`fn()` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_workers needs a zero-argument callable")
        return self._controller.guard.call(worker.apply_fn, fn)

    def apply_all_operators(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(operator)` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_operators needs a callable taking the operator")
        return self._controller.guard.call(worker.apply_operator, fn)

    def shutdown(self, force: bool = False) -> None:
        """Stop the workers and release their resources (unless the driver keeps them for its next
        trainer: `RAYSGD_KEEP_WORKERS_S`). Calling it again does nothing; any other method then
        raises RuntimeError. `force=True` kills the workers without a graceful stop."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if not force and not self._workers.group.needs_recovery:
                try:
                    self._checkpoints.finish()
                except Exception as exc:  # a lost worker must not keep the rest from stopping
                    logger.warning("waiting for the checkpoint uploads failed: %s", exc)
            self._workers.stop(force)
        finally:
            self._checkpoints.close()
            self._loggers.finish()

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
        """The trainer's config; `config[BATCH_SIZE]` is the global batch actually used (a
        multiple of the live number of workers)."""
        return self._workers.recipe.config_for(self._workers.world_size)

    def goodput(self) -> dict[str, Any]:
        """How much of the time inside `train()` and `validate()` went into work that was kept:
        ``wall_s``, ``productive_s``, ``lost_s`` by cause (``detection``, ``start``,
        ``restore``, ``redone``, ``checkpoint``, ``waiting``), ``steps_redone``, ``failures``
        and ``goodput`` (productive over wall). How each part is measured: the raysgd README."""
        return self._goodput.report(self.failures)

    @property
    def epoch(self) -> int:
        """Epochs trained to their end so far (a resumed run's included): a script that trains
        `n` epochs in all goes on with ``for _ in range(trainer.epoch, n): trainer.train()``."""
        return self._state.epochs

    @property
    def num_workers(self) -> int:
        """Workers training now (fewer than asked for after a loss the cluster could not refill)."""
        self._check_alive()
        return self._workers.world_size

    @property
    def failures(self) -> int:
        """Worker failures seen over the trainer's life."""
        return int(self._controller.failures)

    @property
    def recovery_events(self) -> list[Any]:
        """What the run controller saw and did (failures, decisions, resizes, moves)."""
        return list(self._controller.events)

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
            self._state.started(first)
        except WorkerError as exc:
            if isinstance(exc.__cause__, (ValueError, TypeError)):
                # A bad creator or operator set-up is the user's input error: raise it as its
                # own type, chained to the WorkerError that holds the worker's traceback (the
                # cause's own frames do not survive the trip back from the worker).
                raise exc.__cause__ from exc
            raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception)

    def _results(
        self, kind: str, results: list[dict], call_rows: Optional[int], reduce_results: bool
    ) -> Any:
        # A call that went on after a recovery knows the rows the whole group trained in it,
        # those of workers lost meanwhile included: that is the call's num_samples, and its
        # rates are computed from it.
        reduced = (
            reduce_worker_results(results, num_samples=call_rows)
            if reduce_results or self._loggers
            else None
        )
        if self._loggers:
            self._loggers.log(kind, reduced, num_workers=self._workers.world_size)
            self._loggers.log("goodput", self.goodput(), num_workers=self._workers.world_size)
        return reduced if reduce_results else results

    def _check_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("This TorchTrainer has been shut down; create a new one.")
