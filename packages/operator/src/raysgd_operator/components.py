"""`Components`: what one worker trains with, owned by that worker's `OperatorRunner`.

The runner builds one `Components` per worker, with the precision backend and the parallel
strategy already chosen, before the user's `setup` runs. `TrainingOperator.register` and
`register_data` put the models, optimizers, schedulers, loss and loaders into it; the runner, the
default loops and the state code read them back from here by their public names. After the process
group was re-formed with another size, `rebind` re-wraps the models and re-splits the loaders in
place (or says it cannot, and the runner builds a new worker instead).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from raysgd_operator._internal import loaders as _loaders
from raysgd_operator._internal.dataset_loader import DatasetLoader
from raysgd_operator._internal.meta_init import (
    materialize,
    on_meta,
    repoint_optimizers,
    reset_parameters,
)
from raysgd_operator._internal.precision import Precision, check_apex_args
from raysgd_operator._internal.shapes import Shape, flatten, reshape
from raysgd_operator.batch import BATCH_SIZE
from raysgd_operator.dataset_options import DatasetOptions
from raysgd_operator.options import SCHEDULER_STEP_FREQS, TrainingOptions
from raysgd_operator.parallel_strategy import ParallelStrategy, WrapContext

__all__ = ["LOADER_KINDS", "Components", "RankInfo"]

logger = logging.getLogger(__name__)

#: The loaders a worker draws from: `train()` reads "train", `validate()` reads "validation".
LOADER_KINDS = ("train", "validation")


@dataclass(frozen=True)
class RankInfo:
    """One worker's rank, local rank, group size and device in its process group (where its
    actor runs, its Ray placement group, is raysgd_core's business), and which group that is
    (`group`: a re-formed group has another number, the same on every rank)."""

    world_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: int = 0

    @property
    def device_ids(self) -> list[int] | None:
        """``[device.index]`` on a GPU (what DistributedDataParallel wants), else None."""
        return [self.device.index or 0] if self.device.type == "cuda" else None


class Components:
    """The models, optimizers, schedulers, loss, loaders, precision backend and parallel strategy
    of one worker.

    Attributes read by the runner and the loops:
        models: the registered modules, unwrapped (what state dicts and `get_model` use).
        wrapped: the modules the loops call (wrapped by the strategy, compiled when asked).
        optimizers, schedulers: as registered, flattened to lists.
        criterion: the registered loss (None when none was given).
        precision: the precision backend (autocast, loss scaling, optimizer steps).
        strategy: how the models are spread over the workers (`ddp`, `fsdp`, `none`, ...).
        rank_info: this worker's rank, size and device.
        config: this worker's config (``BATCH_SIZE`` already split).
        dataset_iterators: this worker's shards of the trainer's `datasets=`, by name.
    """

    def __init__(
        self,
        *,
        options: TrainingOptions,
        rank_info: RankInfo,
        precision: Precision,
        config: dict[str, Any],
        datasets: Mapping[str, Any] | None = None,
        restoring: bool = False,
    ) -> None:
        """`restoring`: the worker's state is loaded right after setup (a recovery), so wrapping
        the models must not sync them from rank 0 (see `WrapContext.sync_initial_state`)."""
        self.options = options
        self._restoring = restoring
        self.rank_info = rank_info
        self.precision = precision
        self.strategy: ParallelStrategy = options.parallel_strategy
        self.config = config
        # The worker's share of the global batch when setup() ran: a loader built with it follows
        # the share when a resize changes it.
        self._setup_batch = config.get(BATCH_SIZE)
        self.models: list[nn.Module] = []
        self.wrapped: list[nn.Module] = []
        self.model_shape: Shape = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.optimizer_shape: Shape = None
        self.schedulers: list[Any] = []
        self.scheduler_shape: Shape = None
        self.criterion: Any = None
        #: Whether `register` was called (models and optimizers exist).
        self.registered = False
        #: Optimizer steps the loops asked the precision backend for (`optimizer_step`), taken
        #: or skipped: the runner ends an accumulation window at each.
        self.optimizer_steps = 0
        self.ddp_args: dict[str, Any] = {}
        # What the user registered, and the loaders built from it (with a sampler when distributed).
        self.loader_sources: dict[str, Any] = dict.fromkeys(LOADER_KINDS)
        self.loaders: dict[str, Any] = dict.fromkeys(LOADER_KINDS)
        self.dataset_iterators: dict[str, Any] = dict(datasets or {})
        self.dataset_loaders: dict[str, DatasetLoader] = {}
        self._compile = dict(options.compile_args or {}) if options.compile else None
        # compiled model (by id) -> the wrapped model inside it, which the strategy knows
        self._uncompiled: dict[int, nn.Module] = {}
        self._bind_datasets()

    # -- registration (called by TrainingOperator.register / register_data) -------------------
    def register(
        self,
        *,
        models: Any,
        optimizers: Any,
        criterion: Any = None,
        schedulers: Any = None,
        ddp_args: dict[str, Any] | None = None,
        apex_args: dict[str, Any] | None = None,
        init_weights: Callable[[nn.Module], None] = reset_parameters,
    ) -> tuple[Any, ...]:
        """See `TrainingOperator.register`; `init_weights` fills a model built on the meta
        device once it has memory (`TrainingOperator.init_weights`)."""
        if ddp_args is not None and not isinstance(ddp_args, dict):
            raise ValueError(f"ddp_args must be a dict, got {type(ddp_args).__name__}")
        check_apex_args(apex_args)
        if schedulers is not None and self.options.scheduler_step_freq is None:
            raise ValueError(
                "schedulers were registered but scheduler_step_freq is None: pass "
                f"scheduler_step_freq as one of {SCHEDULER_STEP_FREQS}"
            )
        model_list, model_shape = flatten(models, lambda m: isinstance(m, nn.Module), "models")
        for m in model_list:
            if not isinstance(m, nn.Module):
                raise TypeError(f"models must be torch.nn.Module objects, got {type(m).__name__}")
        opt_list, opt_shape = flatten(
            optimizers, lambda o: isinstance(o, torch.optim.Optimizer), "optimizers"
        )
        for o in opt_list:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizers must be torch.optim.Optimizer objects, got {type(o).__name__}"
                )
        device = self.rank_info.device
        # A model built on the meta device gets memory where it will live: after wrapping when
        # the strategy wraps it there (sharding: each worker then holds its shards only), else
        # here, before it is wrapped.
        on_meta_device = [m for m in model_list if on_meta(m)]
        later = self.strategy.wraps_meta_models
        for m in model_list:
            if m not in on_meta_device:
                m.to(device)
            elif not later:
                materialize(m, device, init_weights, opt_list)
        if isinstance(criterion, nn.Module):
            criterion = criterion.to(device)
        if apex_args:
            # Apex takes its options at initialize time, inside the backend's setup below.
            backend_args = getattr(self.precision, "apex_args", None)
            if isinstance(backend_args, dict):
                backend_args.update(apex_args)
            else:
                logger.info(
                    "apex_args ignored: the %s precision backend does not use Apex", self.precision
                )
        result = self.precision.setup(model_list, opt_list, device)
        if result is not None:
            model_list, opt_list = list(result[0]), list(result[1])
        self.models, self.model_shape = list(model_list), model_shape
        self.optimizers, self.optimizer_shape = opt_list, opt_shape
        self.ddp_args = dict(ddp_args or {})
        self.criterion = criterion
        self.wrapped = self._wrap(self.models, sync=not self._restoring)
        if later:
            for m in on_meta_device:
                materialize(m, device, init_weights, self.optimizers)
        if schedulers is not None:
            self.schedulers, self.scheduler_shape = flatten(
                schedulers, lambda s: not isinstance(s, (list, tuple)), "schedulers"
            )
        self.registered = True
        returned = [reshape(self.wrapped, model_shape), reshape(opt_list, opt_shape)]
        if criterion is not None:
            returned.append(criterion)
        if schedulers is not None:
            returned.append(reshape(self.schedulers, self.scheduler_shape))
        return tuple(returned)

    def register_data(self, *, train_loader: Any = None, validation_loader: Any = None) -> None:
        """See `TrainingOperator.register_data`."""
        self.loader_sources = {"train": train_loader, "validation": validation_loader}
        self.loaders = {
            kind: self._prepare_loader(kind, source) for kind, source in self.loader_sources.items()
        }
        for kind in self.dataset_loaders:
            if self.loader_sources.get(kind) is not None and self.rank_info.world_rank == 0:
                logger.warning(
                    "the %s loader registered in setup() is not used: datasets[%r] feeds %s",
                    kind,
                    kind,
                    "train()" if kind == "train" else "validate()",
                )

    # -- what the loops read ---------------------------------------------------------------------
    def loader(self, kind: str) -> Any:
        """The batches of `kind` ("train" or "validation"): a dataset shard's, else the registered
        loader as prepared for this worker; None when there is neither."""
        shard = self.dataset_loaders.get(kind)
        return shard if shard is not None else self.loaders.get(kind)

    def uncompiled(self, model: nn.Module) -> nn.Module:
        """The strategy-wrapped model inside `model` when `model` is a compiled one."""
        return self._uncompiled.get(id(model), model)

    # -- resize ------------------------------------------------------------------------------
    def rebind(
        self,
        rank_info: RankInfo,
        config: dict[str, Any],
        datasets: Mapping[str, Any] | None = None,
    ) -> dict[int, nn.Module] | None:
        """Adopt a re-formed process group: re-wrap the models, re-split the loaders built here.

        `config` is the new per-worker config (``BATCH_SIZE`` already split) and `datasets` this
        worker's shards of the datasets split over the new group (the old shards belong to a split
        over the old group and are never read again). A strategy that cannot wrap its modules
        again (sharded ones are bound to their group) gives unwrapped copies, which are wrapped in
        their place, with the optimizers pointed at their parameters and emptied (the caller
        loads the state into them).

        Returns the modules replaced (``{id(old module or submodule): new one}``, empty when the
        models were re-wrapped in place), or None, changing nothing, when neither can be done or
        a loader cannot follow (the user's own sampler, an iterable dataset whose batch size would
        have to change).
        """
        copies: list[nn.Module] = []
        if self.registered and not self.strategy.rewrappable:
            copies = [self.strategy.unwrapped_copy(m) for m in self.models]  # type: ignore[misc]
            if any(c is None for c in copies):
                return None  # the caller builds the worker again
        new_batch = config.get(BATCH_SIZE)
        moved = (rank_info.world_rank, rank_info.world_size) != (
            self.rank_info.world_rank,
            self.rank_info.world_size,
        )
        shards = dict(datasets or {})
        rebuilds: dict[str, int | None] = {}
        resplits: dict[str, int | None] = {}
        for kind, source in self.loader_sources.items():
            if source is None or kind in shards:
                continue  # a loader that a dataset shard replaces is never read
            # A loader built with the worker's share of the global batch follows that share.
            follows = new_batch is not None and (
                getattr(source, "batch_size", None) == self._setup_batch
            )
            batch = int(new_batch) if follows else None
            current = self.loaders[kind]
            if _loaders.planned_sampler(current) is not None:
                resplits[kind] = batch
                continue
            new_size = batch is not None and batch != getattr(current, "batch_size", None)
            if not (new_size or (moved and self.options.add_dist_sampler)):
                continue
            if not _loaders.can_rebuild(source):
                # The user's own sampler (or an iterable) cannot follow: their setup must run
                # again with the new rank and size.
                return None
            rebuilds[kind] = batch
        self.rank_info, self.config = rank_info, config
        self.dataset_iterators = shards
        self._bind_datasets()
        for kind, batch_size in rebuilds.items():
            self.loaders[kind] = self._prepare_loader(kind, self.loader_sources[kind], batch_size)
        for kind, batch_size in resplits.items():
            _loaders.resplit(
                self.loaders[kind],
                world_size=rank_info.world_size,
                rank=rank_info.world_rank,
                batch_size=batch_size,
            )
        if copies:
            return self._replace_models(copies)
        if self.registered:
            # A re-formed group's state is restored right after: wrapping must not sync it.
            self.wrapped = self._wrap(self.models, sync=False)
        return {}

    def _replace_models(self, copies: list[nn.Module]) -> dict[int, nn.Module]:
        """Wrap `copies` (unwrapped, on the meta device) for the current group in place of the
        models, give them memory, and point the optimizers at their parameters. The optimizers'
        state is dropped and the parameters' values are undefined until a state is loaded; the
        buffers keep the old models' values (a buffer not saved in a state dict stays right)."""
        device = self.rank_info.device
        old_models = self.models
        by_name = {
            id(p): (i, name)
            for i, model in enumerate(old_models)
            for name, p in model.named_parameters()
        }
        for optimizer in self.optimizers:
            optimizer.state.clear()
        self.precision.setup(copies, self.optimizers, device)
        self.wrapped = self._wrap(copies, sync=False)
        for old, new in zip(old_models, copies):
            new.to_empty(device=device)
            buffers = dict(old.named_buffers())
            with torch.no_grad():
                for name, buffer in new.named_buffers():
                    if name in buffers:
                        buffer.copy_(buffers[name])
        params = {
            (i, name): p for i, model in enumerate(copies) for name, p in model.named_parameters()
        }
        repoint_optimizers(
            self.optimizers, {pid: params[key] for pid, key in by_name.items() if key in params}
        )
        self.models = copies
        replaced: dict[int, nn.Module] = {}
        for old, new in zip(old_models, copies):
            subs = dict(new.named_modules())
            replaced.update({id(m): subs[n] for n, m in old.named_modules() if n in subs})
        return replaced

    # -- internals ---------------------------------------------------------------------------
    def _wrap(self, models: list[nn.Module], *, sync: bool) -> list[nn.Module]:
        """Wrap the models with the strategy once a process group exists, then compile if asked."""
        wrapped = list(models)
        if dist.is_available() and dist.is_initialized():
            context = WrapContext(
                device=self.rank_info.device,
                world_size=self.rank_info.world_size,
                precision=self.precision,
                device_ids=self.rank_info.device_ids,
                ddp_args=dict(self.ddp_args),
                sync_initial_state=sync,
                group=self.rank_info.group,
            )
            wrapped = self.strategy.wrap(wrapped, self.optimizers, context)
        self._uncompiled = {}
        if self._compile is not None:
            compiled = []
            for model in wrapped:
                fast = torch.compile(model, **self._compile)
                self._uncompiled[id(fast)] = model
                compiled.append(fast)
            wrapped = compiled
        return wrapped

    def _prepare_loader(self, kind: str, loader: Any, batch_size: int | None = None) -> Any:
        """`loader` as this worker reads it: split over the workers (`add_dist_sampler`), in
        `batch_size` when given, pinned for a GPU. A loader that cannot be rebuilt (the user's own
        sampler, an iterable data set, any other iterable) is used as it is."""
        if loader is None:
            return None
        loader = _loaders.pin_for_device(loader, self.rank_info.device)
        split = self.options.add_dist_sampler and (
            self.rank_info.world_size > 1 or self.options.distributed
        )
        if not (split or batch_size is not None) or not _loaders.can_rebuild(loader):
            return loader
        return _loaders.rebuild_loader(
            loader,
            world_size=self.rank_info.world_size,
            rank=self.rank_info.world_rank,
            batch_size=batch_size,
            split=split,
            # A training step is taken by every worker together; validation has no such need.
            pad=kind == "train",
        )

    def _bind_datasets(self) -> None:
        """Loaders over the current dataset shards, in this worker's batch size."""
        self.dataset_loaders = {
            kind: DatasetLoader(
                shard,
                name=kind,
                batch_size=int(self.config[BATCH_SIZE]),
                device=self.rank_info.device,
                options=self.options.dataset_options or DatasetOptions(),
                group_size=self.rank_info.world_size,
            )
            for kind in LOADER_KINDS
            if (shard := self.dataset_iterators.get(kind)) is not None
        }
