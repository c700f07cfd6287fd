"""Registration and the registered attributes (the non-loop half of `TrainingOperator`).

What is registered lives in the runner's `Components`; the operator only forwards `register` and
`register_data` to it and offers RaySGD's attributes (``self.model``, ``self.optimizer``, ...) over
it, so that a re-wrap after a resize is seen through them.
"""

from __future__ import annotations

from typing import Any

from raysgd_operator._internal import meta_init as _meta_init
from raysgd_operator._internal.shapes import reshape, same_objects
from raysgd_operator.components import Components

__all__ = ["OperatorBase"]

# The registered group each attribute reads: (what `Components` holds, its shape attribute).
_GROUPS = {
    "models": ("wrapped", "model_shape"),
    "optimizers": ("optimizers", "optimizer_shape"),
    "schedulers": ("schedulers", "scheduler_shape"),
    "criterion": ("criterion", None),
}


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

    def _items(self, obj: Any) -> tuple[list[Any], Any]:
        components: Components = obj._components
        items_attr, shape_attr = _GROUPS[self.group]
        if self.group == "criterion":
            return [components.criterion], "single"
        return list(getattr(components, items_attr)), getattr(components, shape_attr)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.name in obj._assigned:
            return obj._assigned[self.name]
        registered = obj._components.registered and (
            self.group != "schedulers" or obj._components.scheduler_shape is not None
        )
        if not registered:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name}: nothing registered yet; call "
                f"self.register(...) in setup()"
            )
        items, shape = self._items(obj)
        if self.first:
            if not items:
                raise AttributeError(f"{type(obj).__name__}.{self.name}: none registered")
            return items[0]
        return reshape(items, shape)

    def __set__(self, obj: Any, value: Any) -> None:
        items = self._items(obj)[0] if obj._components.registered else []
        if items and (same_objects(value, items) or (self.first and value is items[0])):
            obj._assigned.pop(self.name, None)
        else:
            obj._assigned[self.name] = value


class OperatorBase:
    """Registration shared by every `TrainingOperator`; see that class for the API."""

    model = _Registered(
        "models", True, "The first registered model (DDP-wrapped when distributed)."
    )
    models = _Registered("models", False, "The registered model(s), in the shape registered.")
    optimizer = _Registered("optimizers", True, "The first registered optimizer.")
    optimizers = _Registered("optimizers", False, "The registered optimizer(s).")
    criterion = _Registered("criterion", True, "The registered loss (None when none was given).")
    scheduler = _Registered("schedulers", True, "The first registered scheduler.")
    schedulers = _Registered("schedulers", False, "The registered scheduler(s).")

    _components: Components

    def _init_registration(self, components: Components) -> None:
        self._components = components
        # The user's own values for the attributes above (see `_Registered`).
        self._assigned: dict[str, Any] = {}
        # The user's own values for `train_loader` / `validation_loader` (see TrainingOperator).
        self._own_loaders: dict[str, Any] = {}

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
        precision backend, and wrapped by the strategy (``DistributedDataParallel(**ddp_args)``
        by default) when distributed. A model built on the meta device (``with
        torch.device("meta"):``) gets memory on ``self.device`` and its first values from
        ``init_weights(model)``: after sharding under ``fsdp`` (each worker then holds only its
        shards), before wrapping otherwise (``ddp`` then gives every worker rank 0's values).
        Returns ``(models, optimizers[, criterion][, schedulers])``, each in the shape given (one
        object, tuple or list), the models being the wrapped ones.
        """
        # The keywords are named in the signature above because it is the user's typed API; they
        # are forwarded whole, so that `Components.register` alone says what each one does.
        keywords = {name: value for name, value in locals().items() if name != "self"}
        returned = self._components.register(**keywords, init_weights=self.init_weights)
        given = [models, optimizers, criterion]
        # ``self.model = Net()`` before register must not hide the registered model afterwards.
        # (Precision backends such as Apex may have replaced the objects: those count too.)
        registered = (self._components.models, self._components.optimizers)
        ids = {id(x) for value in (*given, *returned, *registered) for x in _as_list(value)}
        for name, value in list(self._assigned.items()):
            values = _as_list(value)
            if values and all(id(v) in ids for v in values):
                del self._assigned[name]
        return returned

    def init_weights(self, model: Any) -> None:
        """Fill the parameters and buffers of `model`, a model built on the meta device, once
        they have memory on this worker's device (under ``fsdp``: this worker's shards, as
        DTensors). Runs under ``torch.no_grad()``.

        The default calls every submodule's ``reset_parameters()``, innermost first (torch's
        layers have one), and raises ValueError naming a module with parameters but none.
        Override it for another initialisation, and to recompute buffers that a module fills in
        its ``__init__`` (a rotary embedding's frequencies, say): ``to_empty`` leaves them
        uninitialised.
        """
        _meta_init.reset_parameters(model)

    def register_data(self, *, train_loader: Any = None, validation_loader: Any = None) -> None:
        """Register the training and validation data (DataLoaders or any iterables of batches).

        When distributed and ``add_dist_sampler`` is on, a plain map-style ``DataLoader`` is rebuilt
        with a sampler that splits its rows over the workers (shuffling only if the loader
        shuffled), keeping its other settings; a loader with the user's own sampler is left alone.
        On a CUDA device a DataLoader is switched to ``pin_memory=True`` so that batches reach the
        GPU without blocking the loop.
        """
        self._components.register_data(
            train_loader=train_loader, validation_loader=validation_loader
        )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
