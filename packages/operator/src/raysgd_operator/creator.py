"""``TrainingOperator.from_creators``: an operator class built from RaySGD creator functions."""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch
from filelock import FileLock
from torch import nn

__all__ = ["DATA_LOCK_NAME", "from_creators"]

#: Lock file, in the temp dir, serializing ``data_creator`` among workers of one node so that
#: they do not all download the same data set at once.
DATA_LOCK_NAME = ".raysgd_data.lock"


@dataclass(frozen=True)
class _Creators:
    model: Callable[[dict[str, Any]], Any]
    optimizer: Callable[[Any, dict[str, Any]], Any]
    data: Callable[[dict[str, Any]], Any] | None
    loss: Any
    scheduler: Callable[[Any, dict[str, Any]], Any] | None
    serialize_data_creation: bool


def _check_all(value: Any, kind: type, creator: str, what: str) -> None:
    items = [value] if isinstance(value, kind) else value
    if isinstance(items, (list, tuple)) and items and all(isinstance(v, kind) for v in items):
        return
    raise TypeError(f"{creator} must return {what} or a tuple of them, got {type(value).__name__}")


#: What each creator is called with, for error messages and the driver-side signature check.
_SIGNATURES = {
    "model_creator": "(config)",
    "optimizer_creator": "(models, config)",
    "data_creator": "(config)",
    "loss_creator": "(config)",
    "scheduler_creator": "(optimizers, config)",
}


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def _check_signature(name: str, fn: Any) -> None:
    """Fail on the driver, naming the creator, when `fn` cannot take the arguments it will get."""
    expected = _SIGNATURES[name]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C callables: nothing to check
        return
    dummies = [object()] * (expected.count(",") + 1)
    try:
        signature.bind(*dummies)
    except TypeError as exc:
        raise TypeError(
            f"{name} is called as {name}{expected}, but {_describe(fn)} cannot take "
            f"{len(dummies)} positional argument(s): {exc}"
        ) from None


def _call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call creator `fn`; an error raised inside it says which creator it came from."""
    try:
        return fn(*args)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"raised in {name}{_SIGNATURES[name]}: {_describe(fn)}")
        raise


def _make_loss(loss_creator: Any, config: dict[str, Any]) -> Any:
    if loss_creator is None:
        return None
    if isinstance(loss_creator, nn.Module):
        return loss_creator  # a loss instance such as nn.MSELoss(): the criterion itself
    if isinstance(loss_creator, type) and issubclass(loss_creator, nn.Module):
        return loss_creator()  # a loss class such as nn.MSELoss
    return _call("loss_creator", loss_creator, config)


def _split_loaders(result: Any) -> tuple[Any, Any]:
    loaders = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(loaders) > 2:
        raise ValueError(
            f"data_creator must return a train loader or (train_loader, validation_loader); "
            f"got {len(loaders)} loaders"
        )
    loaders += [None] * (2 - len(loaders))
    for loader in loaders:
        if loader is not None and not isinstance(loader, Iterable):
            raise TypeError(
                f"data_creator must return DataLoaders or iterables of batches, got {type(loader).__name__}"
            )
    return loaders[0], loaders[1]


def _creator_setup(self: Any, config: dict[str, Any]) -> None:
    """``setup`` of a creator-built operator: call each creator, then register the results."""
    creators: _Creators = type(self)._creators
    models = _call("model_creator", creators.model, config)
    _check_all(models, nn.Module, "model_creator", "a torch.nn.Module")
    optimizers = _call("optimizer_creator", creators.optimizer, models, config)
    _check_all(optimizers, torch.optim.Optimizer, "optimizer_creator", "a torch.optim.Optimizer")
    criterion = _make_loss(creators.loss, config)
    kwargs: dict[str, Any] = {"models": models, "optimizers": optimizers, "criterion": criterion}
    if creators.scheduler is not None:
        kwargs["schedulers"] = _call("scheduler_creator", creators.scheduler, optimizers, config)
    self.register(**kwargs)
    if creators.data is None:
        return
    if creators.serialize_data_creation:
        with FileLock(os.path.join(tempfile.gettempdir(), DATA_LOCK_NAME)):
            result = _call("data_creator", creators.data, config)
    else:
        result = _call("data_creator", creators.data, config)
    train_loader, validation_loader = _split_loaders(result)
    self.register_data(train_loader=train_loader, validation_loader=validation_loader)


def from_creators(
    cls: type,
    model_creator: Callable[[dict[str, Any]], Any],
    optimizer_creator: Callable[[Any, dict[str, Any]], Any],
    data_creator: Callable[[dict[str, Any]], Any] | None = None,
    loss_creator: Any = None,
    scheduler_creator: Callable[[Any, dict[str, Any]], Any] | None = None,
    serialize_data_creation: bool = True,
) -> type:
    """A subclass of ``cls`` whose ``setup`` builds everything from creator functions.

    ``model_creator(config)`` returns a model or a tuple of models; ``optimizer_creator(models,
    config)`` an optimizer or a tuple; ``data_creator(config)`` a train loader or ``(train,
    validation)``; ``loss_creator`` is a loss class (``nn.MSELoss``), a loss instance
    (``nn.MSELoss()``) or ``fn(config)``;
    ``scheduler_creator(optimizers, config)`` a scheduler or a tuple. Called on a subclass with its
    own ``train_batch`` (a GAN operator), the loops of that subclass are kept.

    Raises ``TypeError`` here, before any worker starts, when a creator is not callable or cannot
    take the arguments it will be called with; the message names the creator.
    """
    for name, fn in (("model_creator", model_creator), ("optimizer_creator", optimizer_creator)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    for name, fn in (
        ("data_creator", data_creator),
        ("loss_creator", loss_creator),
        ("scheduler_creator", scheduler_creator),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    for name, fn in (
        ("model_creator", model_creator),
        ("optimizer_creator", optimizer_creator),
        ("data_creator", data_creator),
        ("loss_creator", loss_creator),
        ("scheduler_creator", scheduler_creator),
    ):
        if fn is not None and not isinstance(fn, (type, nn.Module)):
            _check_signature(name, fn)
    creators = _Creators(
        model_creator,
        optimizer_creator,
        data_creator,
        loss_creator,
        scheduler_creator,
        bool(serialize_data_creation),
    )
    return type(
        f"Creator{cls.__name__}",
        (cls,),
        {"setup": _creator_setup, "_creators": creators, "__module__": cls.__module__},
    )
