"""Ship the user's own code by value.

Ray workers import pickled functions and classes by module name, and they only have site-packages,
the script's folder and the working directory on their path: a function from a test module or a
local helper module would fail to unpickle there. cloudpickle can embed such modules' code instead
(`register_pickle_by_value`); this does it for every module that is not installed.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

__all__ = ["ship_by_value"]

logger = logging.getLogger("raysgd_core")

_decided: dict[str, bool] = {}


def _installed_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _needs_value(module_name: str) -> bool:
    if module_name in _decided:
        return _decided[module_name]
    top = module_name.split(".")[0]
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None or module_name == "__main__" or top.startswith("raysgd"):
        # __main__ is pickled by value by cloudpickle already; raysgd's own packages are installed
        # wherever raysgd runs; builtins have no file.
        decision = False
    else:
        real = os.path.realpath(path)
        decision = not (
            real.startswith(_installed_roots())
            or "site-packages" in real
            or "dist-packages" in real
        )
    _decided[module_name] = decision
    return decision


def _modules_of(obj: Any) -> Iterable[str]:
    if isinstance(obj, (types.FunctionType, type)):
        yield getattr(obj, "__module__", None) or ""
    elif isinstance(obj, types.MethodType):
        yield from _modules_of(obj.__func__)
        yield type(obj.__self__).__module__
    elif hasattr(obj, "func") and callable(obj.func):  # functools.partial and the like
        yield from _modules_of(obj.func)
    else:
        yield type(obj).__module__


def ship_by_value(fn: Any, args: tuple = (), kwargs: Any = None) -> None:
    """Register the modules of `fn`, and of the args and kwargs (one level deep), for by-value
    pickling when they are not installed packages."""
    import ray.cloudpickle as cloudpickle

    objs: list[Any] = [fn, *args, *(kwargs or {}).values()]
    for obj in list(objs):
        if isinstance(obj, (list, tuple, set)):
            objs.extend(obj)
        elif isinstance(obj, dict):
            objs.extend(obj.values())
    for obj in objs:
        for name in _modules_of(obj):
            if name and _needs_value(name):
                try:
                    cloudpickle.register_pickle_by_value(sys.modules[name])
                    logger.debug("shipping module %s by value", name)
                except (ValueError, KeyError):  # not importable by that name: pickled as is
                    _decided[name] = False
