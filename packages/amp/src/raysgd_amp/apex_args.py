"""The check of `apex_args`, the keyword arguments of Apex's `amp.initialize`.

Its own module: the registry checks `apex_args` when a backend is chosen, without importing the
Apex backend, which checks them again when it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ApexArgsError", "check_apex_args"]


class ApexArgsError(TypeError, ValueError):
    """`apex_args` is not a dict.

    A TypeError (the value has the wrong type) that is also a ValueError, because
    `TrainingOperator.register(apex_args=...)` raised ValueError for it before the check moved here.
    """


def check_apex_args(apex_args: Any) -> None:
    """The one check of `apex_args` (None or a mapping of `amp.initialize` keyword arguments)."""
    if apex_args is not None and not isinstance(apex_args, Mapping):
        raise ApexArgsError(f"apex_args must be a dict, got {type(apex_args).__name__}")
