"""The checks of numeric arguments and of option names, with one message form for every raysgd
package.

check_int("num_workers", 0)     # ValueError: num_workers must be a positive int (>= 1), got 0
check_int("num_workers", "2")   # WrongTypeError: the same message, with '2'
check_int("spare_workers", -1, minimum=0)  # ValueError: spare_workers must be an int >= 0, got -1
check_number("timeout_s", 0, above=0)      # ValueError: timeout_s must be a number > 0, got 0
check_number("num_gpus_per_worker", 0.5)   # 0.5 (the default bound is >= 0)
check_number("max_norm", True)             # WrongTypeError: max_norm must be a number >= 0, got True
check_option_names("training", ["use_fp32"], ["use_fp16"])
# TypeError: unknown training option(s) use_fp32; the options are ['use_fp16']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

__all__ = ["WrongTypeError", "check_int", "check_number", "check_option_names"]


class WrongTypeError(TypeError, ValueError):
    """A numeric argument of the wrong type (a str, a bool, None, ...): a TypeError, as Python's
    own calls raise for a wrong type, and a ValueError, as every other bad value of an argument
    is, so that `except ValueError` catches any bad value."""


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return `value` when it is an int >= `minimum`.

    Raises:
        WrongTypeError: `value` is not an int, or is a bool (`True` workers is a bug in the
            caller, not a count).
        ValueError: `value` is below `minimum`.

    Both say "<name> must be a positive int (>= 1), got <value!r>" when `minimum` is 1, else
    "<name> must be an int >= <minimum>, got <value!r>".
    """
    expected = "a positive int (>= 1)" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongTypeError(f"{name} must be {expected}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def check_number(
    name: str, value: Any, *, minimum: float = 0, above: Optional[float] = None
) -> float:
    """Return `value` when it is a real number (int or float, not a bool) >= `minimum`, or, when
    `above` is given, > `above`.

    Raises:
        WrongTypeError: `value` is not a number.
        ValueError: `value` is out of range.

    Both say "<name> must be a number >= <minimum>, got <value!r>" (or "> <above>").
    """
    bound = f">= {minimum:g}" if above is None else f"> {above:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongTypeError(f"{name} must be a number {bound}, got {value!r}")
    # Written as `not (in range)` so that NaN, which compares False with everything, is refused.
    if not ((value >= minimum) if above is None else (value > above)):
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
    return value


def check_option_names(kind: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse option names that are not options, the rule of every options object's `build`.

    Raises:
        TypeError: some of `given` are not in `known` (an unknown keyword, as Python's own calls
            refuse one), saying "unknown <kind> option(s) <names>; the options are [<known>]".
    """
    options = list(known)
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise TypeError(f"unknown {kind} option(s) {', '.join(unknown)}; the options are {options}")
