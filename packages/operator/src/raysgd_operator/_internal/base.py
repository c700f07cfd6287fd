"""Registration of models, optimizers, schedulers and loaders (the non-loop half of the operator)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raysgd_operator._internal import loaders as _loaders
from raysgd_operator._internal.precision import Precision, check_apex_args
from raysgd_operator._internal.shapes import flatten, reshape, same_objects
from raysgd_operator.batch import BATCH_SIZE
from raysgd_operator.options import SCHEDULER_STEP_FREQS, TrainingOptions
from raysgd_operator.strategies.ddp import DDPStrategy
from raysgd_operator.strategy import Strategy, WrapContext

__all__ = ["OperatorBase"]

logger = logging.getLogger(__name__)


class _Registered:
    """A property over a registered group, assignable by the user.

    RaySGD users write ``self.model, self.optimizer = self.register(...)``. Assigning back exactly
    the registered objects keeps the property live (so that a re-wrap after a resize is seen);
    assigning anything else is the user's override and is returned as is.
    """

    def __init__(self, group: str, first: bool, doc: str) -> None:
        self.group, self.first, self.__doc__ = group, first, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.name in obj._assigned:
            return obj._assigned[self.name]
        if self.group not in obj._groups:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name}: nothing registered yet; call "
                f"self.register(...) in setup()"
            )
        items, shape = obj._groups[self.group]
        if self.first:
            if not items:
                raise AttributeError(f"{type(obj).__name__}.{self.name}: none registered")
            return items[0]
        return reshape(items, shape)

    def __set__(self, obj: Any, value: Any) -> None:
        items = obj._groups.get(self.group, ([], None))[0]
        if items and (same_objects(value, items) or (self.first and value is items[0])):
            obj._assigned.pop(self.name, None)
        else:
            obj._assigned[self.name] = value


class OperatorBase:
    """State and registration shared by every `TrainingOperator`; see that class for the API."""

    model = _Registered(
        "models", True, "The first registered model (DDP-wrapped when distributed)."
    )
    models = _Registered("models", False, "The registered model(s), in the shape registered.")
    optimizer = _Registered("optimizers", True, "The first registered optimizer.")
    optimizers = _Registered("optimizers", False, "The registered optimizer(s).")
    criterion = _Registered("criterion", True, "The registered loss (None when none was given).")
    scheduler = _Registered("schedulers", True, "The first registered scheduler.")
    schedulers = _Registered("schedulers", False, "The registered scheduler(s).")

    _config: dict[str, Any]
    _options: TrainingOptions
    _precision: Precision
    _strategy: Strategy
    _compile: dict[str, Any] | None

    def _init_state(self) -> None:
        self._groups: dict[str, tuple[list[Any], Any]] = {}
        self._assigned: dict[str, Any] = {}
        self._original_models: list[nn.Module] = []
        # compiled model (by id) -> the wrapped model inside it, which the strategy knows
        self._uncompiled: dict[int, nn.Module] = {}
        self._ddp_args: dict[str, Any] = {}
        self._loader_sources: dict[str, Any] = {"train": None, "validation": None}
        self._loaders: dict[str, Any] = {"train": None, "validation": None}
        self._own_loaders: dict[str, Any] = {}  # see TrainingOperator.train_loader
        self._dataset_shards: dict[str, Any] = {}

    # -- registration ------------------------------------------------------------------------
    def register(
        self,
        *,
        models: Any,
        optimizers: Any,
        criterion: Any = None,
        schedulers: Any = None,
        ddp_args: dict[str, Any] | None = None,
        apex_args: dict[str, Any] | None = None,
    ) -> Any:
        """Register the training objects; call it once, in ``setup``.

        Models (and the criterion, when a module) are moved to ``self.device``, handed to the
        precision backend, and wrapped in ``DistributedDataParallel(**ddp_args)`` when distributed
        and ``wrap_ddp`` is on. Returns ``(models, optimizers[, criterion][, schedulers])``, each in
        the shape given (one object, tuple or list), the models being the wrapped ones.
        """
        if ddp_args is not None and not isinstance(ddp_args, dict):
            raise ValueError(f"ddp_args must be a dict, got {type(ddp_args).__name__}")
        check_apex_args(apex_args)
        if schedulers is not None and self._options.scheduler_step_freq is None:
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

        given = {id(x) for x in (*model_list, *opt_list, criterion)}
        model_list = [m.to(self.device) for m in model_list]
        if isinstance(criterion, nn.Module):
            criterion = criterion.to(self.device)
        if apex_args:
            # Apex takes its options at initialize time, inside the backend's setup below.
            backend_args = getattr(self._precision, "apex_args", None)
            if isinstance(backend_args, dict):
                backend_args.update(apex_args)
            else:
                logger.info(
                    "apex_args ignored: the %s precision backend does not use Apex", self._precision
                )
        result = self._precision.setup(model_list, opt_list, self.device)
        if result is not None:
            model_list, opt_list = list(result[0]), list(result[1])

        # ``self.model = Net()`` before register must not hide the wrapped model afterwards.
        given |= {id(x) for x in (*model_list, *opt_list, criterion)}
        for name, value in list(self._assigned.items()):
            values = value if isinstance(value, (list, tuple)) else [value]
            if values and all(id(v) in given for v in values):
                del self._assigned[name]
        self._original_models = list(model_list)
        self._ddp_args = dict(ddp_args or {})
        self._groups["optimizers"] = (opt_list, opt_shape)
        wrapped = self._wrap_models(model_list)
        self._groups["models"] = (wrapped, model_shape)
        self._groups["criterion"] = ([criterion], "single")
        returned = [reshape(wrapped, model_shape), reshape(opt_list, opt_shape)]
        if criterion is not None:
            returned.append(criterion)
        if schedulers is not None:
            sched_list, sched_shape = flatten(
                schedulers, lambda s: not isinstance(s, (list, tuple)), "schedulers"
            )
            self._groups["schedulers"] = (sched_list, sched_shape)
            returned.append(reshape(sched_list, sched_shape))
        return tuple(returned)

    def _wrap_models(self, models: list[nn.Module]) -> list[nn.Module]:
        """Wrap the models with the strategy (DDP by default), then compile them if asked to."""
        wrapped = list(models)
        if dist.is_available() and dist.is_initialized():
            if isinstance(self._strategy, DDPStrategy):
                wrapped = self._configure_ddp(
                    wrapped, self.device_ids, {**self._strategy.ddp_kwargs, **self._ddp_args}
                )
            else:
                optimizers = self._groups.get("optimizers", ([], None))[0]
                wrapped = self._strategy.wrap(wrapped, optimizers, self._wrap_context())
        self._uncompiled = {}
        if self._compile is not None:
            compiled = []
            for model in wrapped:
                fast = torch.compile(model, **self._compile)
                self._uncompiled[id(fast)] = model
                compiled.append(fast)
            wrapped = compiled
        return wrapped

    def _wrap_context(self, ddp_args: dict[str, Any] | None = None) -> WrapContext:
        return WrapContext(
            device=self.device,
            world_size=self._world_size,
            precision=self._precision,
            device_ids=self.device_ids,
            ddp_args=dict(self._ddp_args if ddp_args is None else ddp_args),
        )

    def _configure_ddp(
        self, models: list[nn.Module], device_ids: list[int] | None, ddp_args: dict[str, Any]
    ) -> list[nn.Module]:
        """Wrap models for data parallelism (strategy "ddp"); override to use another wrapper.

        A model without trainable parameters (a frozen feature extractor) has no gradients to
        synchronize, and DDP refuses it, so it stays unwrapped.
        """
        context = self._wrap_context(ddp_args)
        if device_ids != context.device_ids:
            context = WrapContext(**{**context.__dict__, "device_ids": device_ids})
        return DDPStrategy().wrap(models, [], context)

    def register_data(self, *, train_loader: Any = None, validation_loader: Any = None) -> None:
        """Register the training and validation data (DataLoaders or any iterables of batches).

        When distributed and ``add_dist_sampler`` is on, a plain map-style ``DataLoader`` is rebuilt
        with a ``DistributedSampler`` (shuffling only if the loader shuffled), keeping its other
        settings; a loader with the user's own sampler is left alone. On a CUDA device a DataLoader
        is switched to ``pin_memory=True`` so that batches reach the GPU without blocking the loop.
        """
        self._loader_sources = {"train": train_loader, "validation": validation_loader}
        self._loaders = {
            name: self._prepare_loader(loader, None)
            for name, loader in self._loader_sources.items()
        }

    def _prepare_loader(self, loader: Any, batch_size: int | None) -> Any:
        if loader is None:
            return None
        loader = _loaders.pin_for_device(loader, self.device)
        wants_sampler = self._options.add_dist_sampler and self._world_size > 1
        if not (wants_sampler or batch_size is not None) or not _loaders.can_rebuild(loader):
            return loader
        return _loaders.rebuild_loader(
            loader,
            world_size=self._world_size if self._options.add_dist_sampler else 1,
            rank=self._world_rank,
            batch_size=batch_size,
        )

    # -- resize ------------------------------------------------------------------------------
    def _rebind(
        self,
        *,
        world_rank: int,
        local_rank: int,
        world_size: int,
        config: dict[str, Any],
        datasets: dict[str, Any] | None = None,
    ) -> bool:
        """Re-wrap DDP and re-shard the loaders for a re-formed process group; False if impossible.

        ``datasets`` are this worker's shards of the new split (the old shards belong to a split
        over the old group and must not be read again)."""
        if "models" in self._groups and not self._strategy.rewrappable:
            return False  # e.g. sharded modules: the caller builds the operator again
        old_size, old_config = self._world_size, self._config
        new_bs = config.get(BATCH_SIZE)
        batch_changed = new_bs is not None and new_bs != old_config.get(BATCH_SIZE)
        sampler_changed = self._options.add_dist_sampler and world_size != old_size
        plans: dict[str, int | None] = {}
        shards = dict(datasets or {})
        for name, source in self._loader_sources.items():
            if source is None or name in shards:
                continue  # a loader that a dataset shard replaces is never read
            derived = batch_changed and getattr(source, "batch_size", None) == old_config.get(
                BATCH_SIZE
            )
            if (derived or sampler_changed) and not _loaders.can_rebuild(source):
                return False
            plans[name] = new_bs if derived else None
        self._world_rank, self._local_rank, self._world_size = world_rank, local_rank, world_size
        self._config = config
        self._dataset_shards = shards
        for name, batch_size in plans.items():
            self._loaders[name] = self._prepare_loader(self._loader_sources[name], batch_size)
        if "models" in self._groups:
            _, shape = self._groups["models"]
            self._groups["models"] = (self._wrap_models(self._original_models), shape)
        return True
