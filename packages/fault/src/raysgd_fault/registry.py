"""Choosing a failure policy: by instance, by registered name, or through an entry point.

Third-party packages publish policies in the entry-point group ``raysgd.fault``::

    [project.entry-points."raysgd.fault"]
    my_policy = "my_pkg.policies:MyPolicy"

The entry points are read lazily, only when a name is not registered in-process, so importing
`raysgd_fault` stays cheap.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Union

from raysgd_fault.policies import DefaultPolicy, ElasticPolicy, FailurePolicy, NeverRetryPolicy

__all__ = ["ENTRY_POINT_GROUP", "available_policies", "get_policy", "register_policy"]

ENTRY_POINT_GROUP = "raysgd.fault"

PolicyFactory = Callable[..., FailurePolicy]

_REGISTRY: dict[str, PolicyFactory] = {
    "default": DefaultPolicy,
    "elastic": ElasticPolicy,
    "never": NeverRetryPolicy,
}


def _normalize(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if not key:
        raise ValueError("name must be a non-empty str")
    return key


def register_policy(name: str, factory: PolicyFactory, *, overwrite: bool = False) -> None:
    """Register `factory` (a `FailurePolicy` subclass or a callable returning one) as `name`.

    Raises:
        ValueError: `name` is taken and `overwrite` is False.
        TypeError: `factory` is not callable.
    """
    key = _normalize(name)
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    if key in _REGISTRY and not overwrite:
        raise ValueError(
            f"a failure policy named {key!r} is already registered; pass overwrite=True to replace it"
        )
    _REGISTRY[key] = factory


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except TypeError:  # Python 3.9: entry_points() takes no arguments and returns a dict
        return list(importlib.metadata.entry_points().get(ENTRY_POINT_GROUP, []))  # type: ignore[attr-defined]


def available_policies() -> list[str]:
    """Names `get_policy` accepts: the registered ones plus the installed entry points."""
    names = set(_REGISTRY)
    names.update(_normalize(ep.name) for ep in _entry_points())
    return sorted(names)


def _lookup(key: str) -> PolicyFactory:
    if key in _REGISTRY:
        return _REGISTRY[key]
    for ep in _entry_points():
        if _normalize(ep.name) == key:
            factory = ep.load()
            if not callable(factory):
                raise TypeError(
                    f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r} ({ep.value}) must "
                    f"name a FailurePolicy class or factory, got {type(factory).__name__}"
                )
            # Cache it: loading an entry point imports the plugin, once is enough.
            _REGISTRY[key] = factory
            return factory
    raise ValueError(
        f"unknown failure policy {key!r}; known policies: {', '.join(available_policies())}"
    )


def get_policy(policy: Union[str, FailurePolicy, None] = None, **kwargs: Any) -> FailurePolicy:
    """Resolve `policy` to a `FailurePolicy` instance.

    Args:
        policy: None (the default policy), a `FailurePolicy` instance (returned as is), or a name:
            "default", "elastic", "never", one given to `register_policy`, or an entry point in
            group ``raysgd.fault``.
        **kwargs: Passed to the policy's factory, e.g. ``get_policy("elastic", min_workers=2)``.

    Raises:
        ValueError: Unknown name (the message lists the known ones).
        TypeError: `policy` has another type, kwargs were given with an instance, or the factory did
            not return a `FailurePolicy`.
    """
    if isinstance(policy, FailurePolicy):
        if kwargs:
            raise TypeError(
                f"keyword arguments {sorted(kwargs)} cannot be applied to a policy instance"
            )
        return policy
    if policy is None:
        policy = "default"
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a name, a FailurePolicy or None, got {type(policy).__name__}"
        )
    key = _normalize(policy)
    result = _lookup(key)(**kwargs)
    if not isinstance(result, FailurePolicy):
        raise TypeError(
            f"failure policy {key!r} produced {type(result).__name__}, not a FailurePolicy"
        )
    return result
