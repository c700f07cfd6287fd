"""Choosing a strategy: `get_strategy(strategy, strategy_args)`, names and `raysgd.strategy` entry points.

Resolution order: a `ParallelStrategy` instance is used as given; a `ParallelStrategy` subclass is built with
`strategy_args`; a name is looked up among built-ins (`ddp`, `fsdp`, `none`), `register_strategy`
registrations, then, lazily, the entry points of group `raysgd.strategy`::

    [project.entry-points."raysgd.strategy"]
    my_tp = "my_package.strategy:TensorParallelStrategy"

Each strategy validates its own arguments: a factory is called as `factory(**strategy_args)` and an
unknown argument is a ValueError naming the strategy and what it accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

from raysgd_base import Registry, accepted_keywords, normalize_name
from raysgd_operator.parallel_strategies.ddp import DDPStrategy
from raysgd_operator.parallel_strategies.fsdp import FSDPStrategy
from raysgd_operator.parallel_strategies.none import NoStrategy
from raysgd_operator.parallel_strategy import ParallelStrategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "ParallelStrategyFactory",
    "available_strategies",
    "get_strategy",
    "register_strategy",
    "resolve_strategy",
]

ENTRY_POINT_GROUP = "raysgd.strategy"

#: Builds a strategy from its keyword arguments.
ParallelStrategyFactory = Callable[..., ParallelStrategy]

_registry = Registry(
    "strategy",
    ENTRY_POINT_GROUP,
    {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "none": NoStrategy},
    instance_type=ParallelStrategy,  # an entry point may name a ready instance
)


def register_strategy(
    name: str,
    factory: ParallelStrategyFactory,
    *,
    overwrite: bool = False,
) -> None:
    """Make `get_strategy(name)` build a strategy with `factory` (a `ParallelStrategy` subclass or callable).

    Names are case-insensitive; registering a name that exists raises ValueError unless
    `overwrite` (the keyword every raysgd registry uses).
    """
    _registry.register(name, factory, overwrite=overwrite)


def available_strategies() -> list[str]:
    """Every name `get_strategy` accepts: built-in, registered and entry-point strategies."""
    return _registry.names()


def _build(name: str, factory: Any, args: Mapping[str, Any]) -> ParallelStrategy:
    if isinstance(factory, ParallelStrategy):  # an entry point may name a ready instance
        if args:
            raise ValueError(f"strategy {name!r} is a ready instance: it takes no strategy_args")
        return factory
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise ValueError(
            f"bad strategy_args for strategy {name!r}: {exc}; it accepts {_accepted(factory)}"
        ) from None
    except ValueError:  # no signature to check: let the call itself decide
        pass
    built = factory(**args)
    if not isinstance(built, ParallelStrategy):
        raise TypeError(f"strategy {name!r} built {type(built).__name__}, not a ParallelStrategy")
    return built


def _accepted(factory: Any) -> str:
    names = accepted_keywords(factory)
    if names is None:
        return "unknown arguments"
    return "(" + ", ".join(names) + ")" if names else "no arguments"


def get_strategy(
    strategy: Union[str, ParallelStrategy, type, None] = "ddp",
    strategy_args: Optional[Mapping[str, Any]] = None,
) -> ParallelStrategy:
    """Map the trainer's `strategy` (and `strategy_args`) to a `ParallelStrategy`.

    - "ddp" (default, also for None): DistributedDataParallel; args go to its constructor.
    - "fsdp": FSDP2 (`shard_modules`, `reshard_after_forward`, `cpu_offload`).
    - "none": no wrapping.
    - a `ParallelStrategy` instance (no args) or subclass (built with the args); any other name:
      `register_strategy` or the `raysgd.strategy` entry points.

    Unknown names and arguments raise ValueError listing the choices.
    """
    if strategy_args is not None and not isinstance(strategy_args, Mapping):
        raise TypeError(f"strategy_args must be a dict, got {type(strategy_args).__name__}")
    args = dict(strategy_args or {})
    if isinstance(strategy, ParallelStrategy):
        if args:
            raise ValueError("strategy_args cannot be combined with a ParallelStrategy instance")
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, ParallelStrategy):
        return _build(strategy.__name__, strategy, args)
    if strategy is None:
        strategy = "ddp"
    if not isinstance(strategy, str):
        raise ValueError(
            f"strategy must be a name, a ParallelStrategy instance or subclass; got {strategy!r} "
            f"(names: {available_strategies()})"
        )
    key = normalize_name(strategy)
    return _build(key, _registry.lookup(key), args)


def resolve_strategy(
    strategy: Union[str, ParallelStrategy, type, None],
    strategy_args: Optional[Mapping[str, Any]] = None,
    *,
    wrap_ddp: bool = True,
) -> ParallelStrategy:
    """`get_strategy`, honouring RaySGD's `wrap_ddp=False` (train unwrapped: strategy "none").

    `wrap_ddp=False` together with a strategy other than ddp/none is contradictory: ValueError.
    """
    chosen = get_strategy(strategy, strategy_args)
    if wrap_ddp:
        return chosen
    if isinstance(chosen, (DDPStrategy, NoStrategy)) and not strategy_args:
        return NoStrategy()
    raise ValueError(
        f"wrap_ddp=False means no wrapping, which contradicts strategy={chosen.name!r} "
        "(drop wrap_ddp=False, or use strategy='none')"
    )
