"""Make user code travel to Tune's trial actors by value.

Tune pickles a trainable (and everything it closes over) once on the driver and unpickles it in each
trial actor. cloudpickle stores functions and classes of importable modules by reference, but a trial
actor can only import site-packages, the driver script's folder and the working directory; an operator
or creator defined in another local module (a test file, a sibling script) would fail to unpickle there.
Registering such modules "by value" makes cloudpickle embed their code instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

from ray import cloudpickle

__all__ = ["ship_by_value"]


def _module_of(obj: Any) -> types.ModuleType | None:
    name = getattr(obj, "__module__", None)
    if name is None and hasattr(obj, "func"):  # functools.partial
        return _module_of(obj.func)
    if not name or name == "__main__":  # __main__ is already pickled by value
        return None
    return sys.modules.get(name)


def _importable_elsewhere(module: types.ModuleType) -> bool:
    """True when a fresh process finds `module` under its own name at the same file: installed and
    editable packages. Modules loaded by file path (pytest's importlib mode, runpy) are not."""
    path = getattr(module, "__file__", None)
    if not path:
        return True  # builtins and namespace packages: nothing to ship
    try:
        spec = importlib.util.find_spec(module.__name__)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    return os.path.realpath(spec.origin) == os.path.realpath(path)


def ship_by_value(objs: Iterable[Any]) -> None:
    """Register the local modules that define `objs` (and any classes/functions nested one level
    inside lists, tuples and dict values) to be pickled by value."""
    stack = list(objs)
    seen: set[str] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if not (callable(obj) or isinstance(obj, type)):
            continue
        module = _module_of(obj)
        if module is None or module.__name__ in seen or _importable_elsewhere(module):
            continue
        seen.add(module.__name__)
        try:
            cloudpickle.register_pickle_by_value(module)
        except (ValueError, TypeError):
            # Not registrable (e.g. a module missing from sys.modules): leave it by reference.
            continue
