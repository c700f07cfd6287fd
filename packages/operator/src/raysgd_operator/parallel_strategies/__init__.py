"""Built-in strategies (`none`, `ddp`, `fsdp`) and the registry that picks one by name."""

from raysgd_operator.parallel_strategies.ddp import DDPStrategy, per_parameter_mean
from raysgd_operator.parallel_strategies.fsdp import FSDPStrategy
from raysgd_operator.parallel_strategies.none import NoStrategy
from raysgd_operator.parallel_strategies.registry import (
    ENTRY_POINT_GROUP,
    available_strategies,
    get_strategy,
    register_strategy,
    resolve_strategy,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "DDPStrategy",
    "FSDPStrategy",
    "NoStrategy",
    "available_strategies",
    "get_strategy",
    "per_parameter_mean",
    "register_strategy",
    "resolve_strategy",
]
