"""Choosing loggers: instances, built-in names and the `raysgd.logger` entry points.

    TorchTrainer(..., loggers=["csv", MLflowLogger(tracking_uri="http://mlflow:5000")])

A name builds that logger with its default arguments; `get_logger(name, **kwargs)` builds one with
arguments. Third-party loggers are published in the entry-point group ``raysgd.logger``::

    [project.entry-points."raysgd.logger"]
    neptune = "my_package.loggers:NeptuneLogger"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

from raysgd.loggers.csv_logger import CSVLogger
from raysgd.loggers.logger import Logger
from raysgd.loggers.mlflow_logger import MLflowLogger
from raysgd.loggers.tensorboard_logger import TensorBoardLogger
from raysgd.loggers.wandb_logger import WandbLogger
from raysgd_base import Registry, normalize_name

__all__ = [
    "ENTRY_POINT_GROUP",
    "LoggerFactory",
    "available_loggers",
    "get_logger",
    "register_logger",
    "resolve_loggers",
]

ENTRY_POINT_GROUP = "raysgd.logger"

#: Builds a logger from keyword arguments.
LoggerFactory = Callable[..., Logger]

_registry = Registry(
    "experiment logger",
    ENTRY_POINT_GROUP,
    {
        "csv": CSVLogger,
        "mlflow": MLflowLogger,
        "tensorboard": TensorBoardLogger,
        "wandb": WandbLogger,
    },
    instance_type=Logger,  # an entry point may name a ready instance
)


def register_logger(name: str, factory: LoggerFactory, *, overwrite: bool = False) -> None:
    """Make `get_logger(name)` (and ``loggers=[name]``) build a logger with `factory` (a `Logger`
    subclass or a callable returning one). Names are case-insensitive; a taken name raises
    ValueError unless `overwrite`."""
    _registry.register(name, factory, overwrite=overwrite)


def available_loggers() -> list[str]:
    """Every name `get_logger` accepts: built-in, registered and entry-point loggers."""
    return _registry.names()


def get_logger(logger: Union[str, Logger], **kwargs: Any) -> Logger:
    """A `Logger` from an instance (returned as is) or a name (built with `kwargs`).

    Raises:
        ValueError: Unknown name (the message lists the available ones).
        TypeError: `logger` is neither, kwargs were given with an instance, or the factory did
            not build a `Logger`.
        ImportError: The logger's library is not installed (the message says how to install it).
    """
    if isinstance(logger, Logger):
        if kwargs:
            raise TypeError(f"keyword arguments {sorted(kwargs)} cannot be applied to {logger!r}")
        return logger
    if not isinstance(logger, str):
        raise TypeError(
            f"a logger must be a name or a raysgd.loggers.Logger, got {type(logger).__name__}"
        )
    key = normalize_name(logger)
    factory = _registry.lookup(key)
    built = factory if isinstance(factory, Logger) else factory(**kwargs)
    if not isinstance(built, Logger):
        raise TypeError(f"experiment logger {key!r} built {type(built).__name__}, not a Logger")
    return built


def resolve_loggers(
    loggers: Optional[Sequence[Union[str, Logger]]], *, logdir: Optional[str] = None
) -> list[Logger]:
    """The trainer's `loggers=` (instances or names) plus, for `logdir=`, a `TensorBoardLogger`
    of that directory (unless a TensorBoardLogger of that directory is already given)."""
    if loggers is None:
        loggers = []
    if isinstance(loggers, (str, Logger)) or not isinstance(loggers, Sequence):
        raise TypeError(
            f"loggers must be a list of logger names or raysgd.loggers.Logger instances, "
            f"got {loggers!r}"
        )
    resolved = [get_logger(item) for item in loggers]
    if len({id(item) for item in resolved}) != len(resolved):
        raise ValueError("the same logger instance is given twice: each records one run")
    if logdir:
        given = [item.logdir for item in resolved if isinstance(item, TensorBoardLogger)]
        if str(logdir) not in given:
            resolved.append(TensorBoardLogger(logdir))
    return resolved
