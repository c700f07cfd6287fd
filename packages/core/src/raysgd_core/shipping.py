"""Ship the user's own code to the workers by value.

Ray workers unpickle functions and classes by importing their module by name. A worker's import path
is what a fresh interpreter has (stdlib, site-packages, `.pth` entries, `PYTHONPATH`) plus the
driver's working directory and script folder, which Ray adds. A module the driver loaded from
anywhere else (a test file loaded by path, a folder put on `sys.path` at run time, a notebook's
helper) would fail to import there; cloudpickle can embed such a module's code instead
(`register_pickle_by_value`).

The decision is whether a worker would find the module *by its name at the same file*, never where
the file lies: a package installed outside site-packages (a `--target` install on `PYTHONPATH`, a
Bazel tree, a shared filesystem) imports fine on the workers and must go by reference. Ray, torch and
raysgd itself always go by reference: shipping their code by value is never needed and breaks (deep
recursion, objects that only pickle by reference).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import sysconfig
import types
from collections.abc import Iterable
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any

__all__ = ["NEVER_SHIPPED", "ship_by_value", "shipped_by_value"]

logger = logging.getLogger("raysgd_core")

#: Top-level packages never shipped by value (a `raysgd*` prefix covers every raysgd package).
NEVER_SHIPPED: frozenset[str] = frozenset({"ray", "torch", "raysgd"})

_decided: dict[str, bool] = {}
_fresh_path: list[str] = []


def _interpreter_path() -> list[str]:
    """`sys.path` of a fresh interpreter like the workers' (same executable, same environment).

    Computed once: this is where the path entries a driver added at run time (`sys.path.insert`)
    are told apart from those every process of this Python has.
    """
    if not _fresh_path:
        try:
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import json, sys; print(json.dumps([p for p in sys.path if p]))",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
                cwd=os.path.dirname(sys.executable) or None,
            ).stdout
            _fresh_path.extend(json.loads(out.strip().splitlines()[-1]))
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            # Cannot tell: assume the workers see what the driver sees.
            _fresh_path.extend(p for p in sys.path if p)
    return _fresh_path


def _worker_path() -> list[str]:
    """The import path a worker has: the fresh interpreter's plus the driver's working directory
    and script folder (when the script folder is on the driver's path, as Ray requires)."""
    path = [os.getcwd()]
    script_dir = os.path.dirname(os.path.realpath(sys.argv[0])) if sys.argv and sys.argv[0] else ""
    if script_dir and script_dir in sys.path:
        path.append(script_dir)
    path.extend(_interpreter_path())
    return path


def _installed_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _found_by_worker(module: types.ModuleType, path: str) -> bool:
    """Whether an import of `module.__name__` by path search on a worker's import path reaches the
    same file. Each dotted component is looked up under the previous one's search locations, as a
    fresh import would; the driver's `sys.modules` is not consulted."""
    locations: list[str] | None = _worker_path()
    parts = module.__name__.split(".")
    spec: ModuleSpec | None = None
    for i in range(len(parts)):
        if locations is None:
            return False
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), locations)
        if spec is None:
            return False
        sub = spec.submodule_search_locations
        locations = list(sub) if sub is not None else None
    if spec is None or not spec.origin:
        return False
    return os.path.realpath(spec.origin) == os.path.realpath(path)


def shipped_by_value(module_name: str) -> bool:
    """Whether the module `module_name` (already imported here) is shipped to workers by value.

    True only when a worker could not import it by that name from the same file. Never true for
    `__main__` (cloudpickle ships it by value already), built-in or frozen modules, or the packages
    in `NEVER_SHIPPED` and `raysgd*`.
    """
    if module_name in _decided:
        return _decided[module_name]
    top = module_name.partition(".")[0]
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if (
        module is None
        or not path
        or module_name == "__main__"
        or top in NEVER_SHIPPED
        or top.startswith("raysgd")
    ):
        decision = False
    elif os.path.realpath(path).startswith(_installed_roots()):
        decision = False  # stdlib and site-packages: on every worker's path
    else:
        decision = not _found_by_worker(module, path)
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


def ship_by_value(*objs: Any) -> None:
    """Register, for by-value pickling, the modules that define `objs` (functions, classes,
    instances, bound methods, partials) and the items of lists, tuples, sets and dict values among
    them (two levels deep), when `shipped_by_value` says a worker could not import them."""
    import ray.cloudpickle as cloudpickle

    pending: list[tuple[Any, int]] = [(obj, 0) for obj in objs]
    while pending:
        obj, depth = pending.pop()
        if isinstance(obj, (list, tuple, set, frozenset, dict)):
            if depth < 2:
                items = obj.values() if isinstance(obj, dict) else obj
                pending.extend((item, depth + 1) for item in items)
            continue
        for name in _modules_of(obj):
            if name and shipped_by_value(name):
                try:
                    cloudpickle.register_pickle_by_value(sys.modules[name])
                    logger.debug("shipping module %s by value", name)
                except (ValueError, KeyError):  # not registrable by that name: pickled as is
                    _decided[name] = False
