"""`TorchTrainer`: RaySGD's distributed PyTorch trainer on today's Ray and PyTorch.

The driver holds a `raysgd_core.WorkerGroup`, the failure policy and the last good state; every
worker holds one long-lived `raysgd_operator.OperatorRunner` (see `raysgd._internal.worker`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from raysgd._internal import worker
from raysgd._internal.checkpoint import read_file, state_from_bytes, state_to_bytes
from raysgd._internal.cluster import driver_has_cuda, ensure_ray
from raysgd._internal.datasets import DatasetSplitter, check_datasets, warn_if_no_room_for_data
from raysgd._internal.driver import TrainerDriver
from raysgd._internal.driver_copy import DEFAULT_LIMIT_MB, DriverCopy
from raysgd._internal.preemption import Preemption
from raysgd._internal.recovery import Recovery
from raysgd._internal.run_loggers import RunLoggers, trainer_options
from raysgd._internal.sharded_state import ShardedState, is_sharded_checkpoint
from raysgd._internal.trainer_keywords import route_keywords
from raysgd._internal.validation import (
    check_optional_args,
    check_train_args,
    resolve_operator_cls,
    resolve_timeout,
    start_timeout,
)
from raysgd.loggers import Logger
from raysgd_base import check_int, check_number
from raysgd_core import GroupOptions, WorkerGroup, require_cluster_gpus, resolve_use_gpu
from raysgd_fault import FailurePolicy, get_policy
from raysgd_operator import (
    SHARDED_STATE_IMPORTS,
    DatasetOptions,
    TrainingOptions,
    check_batch_size,
)

__all__ = ["TorchTrainer"]


class TorchTrainer(TrainerDriver):
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
    states up to `state_copy_limit_mb` (refreshed after `train()` calls, asynchronously, taking at
    most 2% of the training time; 0 turns it off).

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
        self._group: WorkerGroup = WorkerGroup(
            self._num_workers,
            GroupOptions(
                **group_fields,
                num_cpus_per_worker=num_cpus_per_worker,
                num_gpus_per_worker=1 if self._options.use_gpu else 0,
                timeout_s=resolve_timeout(timeout_s),
                spare_imports=SHARDED_STATE_IMPORTS if self._options.sharded else (),
                **start_timeout(),
            ),
        )
        self._use_local = self._group.use_local

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
                self._group.options,
                num_workers=self._num_workers,
                failure_policy=policy.name,
                state_copy_limit_mb=state_copy_limit_mb,
            ),
        )
        self._user_config: dict[str, Any] = dict(config or {})
        self._config: dict[str, Any] = dict(self._user_config)
        self._checkpoint_dir = checkpoint_dir
        self._sharded = ShardedState() if self._options.sharded else None
        self._copy = DriverCopy(int(state_copy_limit_mb * 2**20))
        self._datasets = DatasetSplitter(given_datasets)
        self._shut_down = False
        # The operator class (and the creator functions a built one holds) is pickled once, here:
        # every start and restart reuses this copy. Pickling it again at a restart would take
        # its closure cells as they are then: one that by then refers to the trainer itself
        # would ship the whole trainer (or fail to pickle it).
        creators = (model_creator, data_creator, optimizer_creator, loss_creator, scheduler_creator)
        if dataset_options is not None:
            # Travels inside the options: registering its module ships it by value too.
            creators += (dataset_options.collate_fn,)
        self._operator_ref = self._group.put(
            self._operator_cls, by_value=tuple(fn for fn in creators if fn is not None)
        )
        self._start_workers()
        self._recovery = Recovery(
            group=self._group,
            num_workers=self._num_workers,
            restore=self._restore_after_resize,
            policy=policy,
        )
        self._preemption = Preemption(
            group=lambda: self._group,
            recovery=self._recovery,
            before_retire=self._prepare_leaving,
            local_checkpoint=self._checkpoint_at_notice,
        )

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

        def attempt() -> list[tuple[dict, int, Optional[int], bool]]:
            # Reads `self._group` at call time: recovery may have replaced or re-formed it. After
            # a failure the same call id makes the workers go on with the call, not start it again.
            return self._group.execute(
                worker.train_epoch, num_steps, profile, info, call_id, watch[0]
            )

        while True:
            returned = self._recovery.run(attempt, max_retries=max_retries)
            if not any(answer[3] for answer in returned):
                break
            # The workers stopped together at a step boundary: a node of theirs is draining.
            self._move_off_draining(max_retries)
            watch[0] = self._preemption.watch_spec()
        results = self._train_results(returned)
        rows = [answer[2] for answer in returned if answer[2] is not None]
        if self._copy_wanted() and self._copy.due():
            self._copy.refresh(
                self._group.execute_single_async(0, worker.state_copy, self._copy.limit_bytes)
            )
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
        results = self._call(worker.validate, num_steps, profile, info)
        return self._results("validate", results, reduce_results)

    def state_dict(self) -> dict[str, Any]:
        """The full training state (`epoch`, `operator`, `models`, `optimizers`, `schedulers`,
        `precision`, position), on the CPU."""
        self._check_alive()
        if self._sharded is not None:
            # Every worker's part comes to this process: what asking for the whole state means.
            with self._repairing():
                self._sharded.capture(self._group)
                return self._sharded.gather(self._group)
        return state_from_bytes(self._read(worker.state_bytes))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state` (from `state_dict()` or a checkpoint) into every worker."""
        self._check_alive()
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict from TorchTrainer.state_dict(), got {type(state)}"
            )
        if state.get("format") == "raysgd-dcp":
            self._load_sharded(lambda: self._sharded_view().load_gathered(self._group, state))
            return
        self._load_bytes(state_to_bytes(state))

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Write the state to `path` atomically; returns the absolute path. A worker on this
        machine writes it, so the state does not pass through the driver."""
        self._check_alive()
        return self._save_to(path)

    def load(self, path: Union[str, os.PathLike]) -> None:
        """Load a checkpoint written by `save` into every worker. Never runs code from the file; a
        file that is not a checkpoint raises ValueError and leaves the trainer as it was."""
        self._check_alive()
        if is_sharded_checkpoint(os.fspath(path)):
            self._load_sharded(lambda: self._sharded_view().load(self._group, os.fspath(path)))
            return
        data, _ = read_file(path)
        self._load_bytes(data, os.fspath(path))

    def get_model(self, to_cpu: bool = False) -> Any:
        """The trained model(s), without DDP wrappers (one model bare, several as a list).

        `to_cpu=True` returns CPU copies. On a driver without CUDA, models trained on GPUs come back
        as CPU copies anyway (they could not be unpickled here otherwise); a model already on the
        CPU comes back as it is.
        """
        self._check_alive()
        if self._sharded is not None:
            raise NotImplementedError(
                "get_model() with a sharded strategy: no worker holds the whole model. save() a "
                "checkpoint and load it into a TorchTrainer(strategy='none'), or use "
                "apply_all_operators"
            )
        models = self._read(worker.get_models, to_cpu, not driver_has_cuda())
        if isinstance(models, (list, tuple)) and len(models) == 1:
            return models[0]
        return list(models) if isinstance(models, tuple) else models

    def get_local_operator(self) -> Any:
        """The rank-0 operator living in this process; only with `use_local=True`."""
        self._check_alive()
        if not self._use_local:
            raise NotImplementedError(
                "get_local_operator() needs TorchTrainer(use_local=True): without it every operator "
                "lives in a remote worker (use apply_all_operators instead)"
            )
        return self._call(worker.get_operator, rank=0)

    def update_scheduler(self, metric: Any) -> None:
        """Step every registered scheduler with `metric` on every worker (`scheduler_step_freq="manual"`)."""
        self._check_alive()
        self._call(worker.update_scheduler, metric)

    def apply_all_workers(self, fn: Callable[[], Any]) -> list[Any]:
        """`fn()` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_workers needs a zero-argument callable")
        return self._call(worker.apply_fn, fn)

    def apply_all_operators(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(operator)` on every worker; the results in rank order."""
        self._check_alive()
        if not callable(fn):
            raise TypeError("apply_all_operators needs a callable taking the operator")
        return self._call(worker.apply_operator, fn)

    def shutdown(self, force: bool = False) -> None:
        """Stop the workers and release their resources. Calling it again does nothing; any other
        method then raises RuntimeError. `force=True` kills the workers without a graceful stop."""
        if self._shut_down:
            return
        self._shut_down = True
        self._stop_workers(force)

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
        return self._config

    @property
    def num_workers(self) -> int:
        """Workers training now (fewer than asked for after a loss the cluster could not refill)."""
        self._check_alive()
        return self._world_size()

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
        return self._group
