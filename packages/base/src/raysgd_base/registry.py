"""One registry for raysgd's swappable parts: precision backends, failure policies, parallel
strategies and experiment loggers.

Each package keeps its own public functions (`register_precision`, `get_policy`, ...) and builds them
on one `Registry`, so that every swappable part follows the same rules:

- names are case-insensitive and stripped ("  DDP " is "ddp");
- `register(name, factory, overwrite=False)` refuses to replace a name silently;
- a lookup tries the in-process registrations first, then the entry points of the registry's group
  in the installed distributions::

      [project.entry-points."raysgd.strategy"]
      my_tp = "my_package.strategy:TensorParallelStrategy"

  Entry points are read only when a name is not registered (so importing a package stays cheap),
  and a plugin's module is imported once, on its first lookup (Python's module cache keeps it);
- an unknown name is a ValueError that names it and lists the available ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Callable, Optional

__all__ = [
    "Registry",
    "accepted_keywords",
    "call_with_accepted",
    "entry_points",
    "normalize_name",
]


def normalize_name(name: object) -> str:
    """The registry key of `name`: stripped and lower-case.

    Raises:
        TypeError: `name` is not a str.
        ValueError: `name` is empty or blank.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if not key:
        raise ValueError("name must be a non-empty str")
    return key


def entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points of `group` in the installed distributions (read anew on every call, so
    that a distribution installed while the process runs is seen)."""
    found = metadata.entry_points()
    if hasattr(found, "select"):  # Python >= 3.10
        return list(found.select(group=group))
    return list(found.get(group, []))  # type: ignore[attr-defined]  # Python 3.9: a dict of groups


def accepted_keywords(factory: Callable[..., Any]) -> Optional[tuple[str, ...]]:
    """The keyword arguments `factory` accepts, with "**kwargs" last when it takes any; None when
    it has no signature to read (some builtins and C callables)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        names.append("**kwargs")
    return tuple(names)


def call_with_accepted(factory: Callable[..., Any], offered: Mapping[str, Any]) -> Any:
    """`factory(**kwargs)` with those of `offered` that its signature accepts (all of them when it
    takes `**kwargs`, none when it has no readable signature).

    Lets a registry offer context (a device, a directory) to every factory while a plain class
    whose `__init__` takes no arguments still works as it is.
    """
    accepted = accepted_keywords(factory) or ()
    if "**kwargs" in accepted:
        return factory(**offered)
    return factory(**{key: value for key, value in offered.items() if key in accepted})


class Registry:
    """Named factories of one kind of swappable part, plus the entry points of one group.

    Args:
        kind: What the factories build, for messages ("precision backend", "failure policy").
        group: The entry-point group third-party packages publish in ("raysgd.amp").
        builtins: Names and factories registered from the start.
        instance_type: When given, an entry point may also name a ready instance of this type
            (returned as is by `lookup`); otherwise it must name a callable.
    """

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: Optional[Mapping[str, Callable[..., Any]]] = None,
        *,
        instance_type: Optional[type] = None,
    ) -> None:
        self.kind = kind
        self.group = group
        self.instance_type = instance_type
        self._factories: dict[str, Any] = {}
        for name, factory in (builtins or {}).items():
            self.register(name, factory)

    def register(self, name: str, factory: Callable[..., Any], *, overwrite: bool = False) -> None:
        """Register `factory` (a class or a callable building the part) as `name`.

        Raises:
            ValueError: `name` is empty, or taken and `overwrite` is False.
            TypeError: `name` is not a str or `factory` is not callable.
        """
        key = normalize_name(name)
        if not callable(factory):
            raise TypeError(
                f"factory must be a {self.kind} class or a callable, got {type(factory).__name__}"
            )
        if key in self._factories and not overwrite:
            raise ValueError(
                f"a {self.kind} named {key!r} is already registered; pass overwrite=True to "
                "replace it"
            )
        self._factories[key] = factory

    def registered(self) -> list[str]:
        """The names registered in this process (built-ins included), without the entry points."""
        return sorted(self._factories)

    def names(self) -> list[str]:
        """Every name `lookup` accepts: registered ones and installed entry points, sorted."""
        found = {ep.name.strip().lower() for ep in entry_points(self.group)}
        return sorted(set(self._factories) | {name for name in found if name})

    def __contains__(self, name: object) -> bool:
        """Whether `name` is registered or installed as an entry point (nothing is imported)."""
        try:
            key = normalize_name(name)
        except (TypeError, ValueError):
            return False
        return key in self._factories or any(
            ep.name.strip().lower() == key for ep in entry_points(self.group)
        )

    def lookup(self, name: str) -> Any:
        """The factory (or, for an entry point, possibly a ready instance) registered as `name`.

        Raises:
            ValueError: No such name (the message lists the available ones).
            ImportError: The entry point's module failed to import (the message names it).
            TypeError: The entry point names neither a callable nor an `instance_type` instance.
        """
        key = normalize_name(name)
        if key in self._factories:
            return self._factories[key]
        for ep in entry_points(self.group):
            if ep.name.strip().lower() == key:
                return self._load(key, ep)
        raise self.unknown(key)

    def unknown(self, name: str) -> ValueError:
        """The error for a name nobody registered: it names it and lists the available ones."""
        return ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")

    def copy(self) -> Registry:
        """An independent registry with the same registrations (tests use it to keep theirs
        from leaking into the next test)."""
        twin = Registry(self.kind, self.group, instance_type=self.instance_type)
        twin._factories = dict(self._factories)
        return twin

    def _load(self, key: str, ep: metadata.EntryPoint) -> Any:
        # Not cached here: `ep.load()` imports the plugin's module once (sys.modules keeps it),
        # and reading the entry points anew on each lookup sees what is installed now.
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken plugin must say which one it is
            raise ImportError(
                f"{self.kind} {key!r} (entry point {ep.value!r} in group {self.group!r}) failed "
                f"to load: {exc}"
            ) from exc
        is_instance = self.instance_type is not None and isinstance(loaded, self.instance_type)
        if not (is_instance or callable(loaded)):
            raise TypeError(
                f"entry point {ep.name!r} in group {self.group!r} ({ep.value}) must name a "
                f"{self.kind} class or factory, got {type(loaded).__name__}"
            )
        return loaded

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.group!r}, registered={self.registered()})"
