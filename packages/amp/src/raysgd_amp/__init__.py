"""Swappable mixed-precision backends (full, native torch.amp fp16/bf16, NVIDIA Apex).

`get_precision(use_fp16)` turns RaySGD's `use_fp16` argument into a `Precision`, the one interface a
training loop talks to. Imports torch only; Apex is imported only when its backend is built.
"""

from .apex_args import ApexArgsError, check_apex_args
from .full import FullPrecision
from .native import NativePrecision
from .precision import Precision, StepOutcome
from .registry import (
    ENTRY_POINT_GROUP,
    available_precisions,
    check_precision,
    get_precision,
    register_precision,
)

__version__ = "0.1.0"
__all__ = [
    "ENTRY_POINT_GROUP",
    "ApexArgsError",
    "ApexNotAvailableError",
    "ApexPrecision",
    "FullPrecision",
    "NativePrecision",
    "Precision",
    "StepOutcome",
    "available_precisions",
    "check_apex_args",
    "check_precision",
    "get_precision",
    "register_precision",
]


def __getattr__(name: str) -> object:
    # The Apex backend module is cheap, but keep `import raysgd_amp` free of it all the same.
    if name in ("ApexPrecision", "ApexNotAvailableError"):
        from . import apex

        return getattr(apex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
