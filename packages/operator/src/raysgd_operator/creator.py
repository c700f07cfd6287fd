"""``TrainingOperator.from_creators``: an operator class built from RaySGD creator functions."""

from __future__ import annotations

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


def _make_loss(loss_creator: Any, config: dict[str, Any]) -> Any:
    if loss_creator is None:
        return None
    if isinstance(loss_creator, type) and issubclass(loss_creator, nn.Module):
        return loss_creator()  # a loss class such as nn.MSELoss
    return loss_creator(config)


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
    models = creators.model(config)
    _check_all(models, nn.Module, "model_creator", "a torch.nn.Module")
    optimizers = creators.optimizer(models, config)
    _check_all(optimizers, torch.optim.Optimizer, "optimizer_creator", "a torch.optim.Optimizer")
    criterion = _make_loss(creators.loss, config)
    kwargs: dict[str, Any] = {"models": models, "optimizers": optimizers, "criterion": criterion}
    if creators.scheduler is not None:
        kwargs["schedulers"] = creators.scheduler(optimizers, config)
    self.register(**kwargs)
    if creators.data is None:
        return
    if creators.serialize_data_creation:
        with FileLock(os.path.join(tempfile.gettempdir(), DATA_LOCK_NAME)):
            result = creators.data(config)
    else:
        result = creators.data(config)
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
    validation)``; ``loss_creator`` is a loss class (``nn.MSELoss``) or ``fn(config)``;
    ``scheduler_creator(optimizers, config)`` a scheduler or a tuple. Called on a subclass with its
    own ``train_batch`` (a GAN operator), the loops of that subclass are kept.
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
