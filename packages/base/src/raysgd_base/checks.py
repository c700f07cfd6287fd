"""The one check of an integer argument, with one message form for every raysgd package.

check_int("num_workers", 0)           # ValueError: num_workers must be an int >= 1, got 0
check_int("num_workers", "2")         # TypeError:  num_workers must be an int >= 1, got '2'
check_int("spare_workers", 0, minimum=0)  # 0
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return `value` when it is an int >= `minimum`.

    Raises:
        TypeError: `value` is not an int, or is a bool (`True` workers is a bug in the caller, not
            a count).
        ValueError: `value` is below `minimum`.

    Both say "<name> must be an int >= <minimum>, got <value!r>".
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
