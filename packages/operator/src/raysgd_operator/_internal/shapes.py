"""Keeping the container shape (one object, tuple or list) a user registered things in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

__all__ = ["Shape", "flatten", "reshape", "same_objects"]

# "single" for a bare object, else the sequence type to rebuild.
Shape = Any


def flatten(obj: Any, is_single: Callable[[Any], bool], what: str) -> tuple[list[Any], Shape]:
    """``obj`` as a list plus the shape to rebuild it with.

    ``is_single`` decides first, so that an iterable object that is one thing (an ``nn.Sequential``,
    an optimizer defining ``__iter__``) is not mistaken for several.
    """
    if is_single(obj):
        return [obj], "single"
    if isinstance(obj, (list, tuple)):
        return list(obj), type(obj) if type(obj) in (list, tuple) else tuple
    try:
        return list(obj), list
    except TypeError:
        raise TypeError(
            f"{what} must be one object or a sequence of them, got {type(obj).__name__}"
        ) from None


def reshape(items: Sequence[Any], shape: Shape) -> Any:
    """Rebuild what `flatten` took apart (with possibly replaced items)."""
    if shape == "single":
        return items[0]
    return shape(items)


def same_objects(value: Any, items: Sequence[Any]) -> bool:
    """Whether ``value`` is exactly the registered object(s), by identity."""
    if len(items) == 1 and value is items[0]:
        return True
    if isinstance(value, (list, tuple)) and len(value) == len(items):
        return all(a is b for a, b in zip(value, items))
    return False
