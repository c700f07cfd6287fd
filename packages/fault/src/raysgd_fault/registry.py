"""Choosing a failure policy: by instance, by registered name, or through an entry point.

Third-party packages publish policies in the entry-point group ``raysgd.fault``::

    [project.entry-points."raysgd.fault"]
    my_policy = "my_pkg.policies:MyPolicy"

The entry points are read lazily, only when a name is not registered in-process, so importing
`raysgd_fault` stays cheap. Names, registration and lookup follow `raysgd_base.Registry`.
"""

from __future__ import annotations

from typing import Any, Callable, Union

from raysgd_base import Registry, normalize_name
from raysgd_fault.policies import DefaultPolicy, ElasticPolicy, FailurePolicy, NeverRetryPolicy

__all__ = ["ENTRY_POINT_GROUP", "available_policies", "get_policy", "register_policy"]

ENTRY_POINT_GROUP = "raysgd.fault"

PolicyFactory = Callable[..., FailurePolicy]

_registry = Registry(
    "failure policy",
    ENTRY_POINT_GROUP,
    {"default": DefaultPolicy, "elastic": ElasticPolicy, "never": NeverRetryPolicy},
)


def register_policy(name: str, factory: PolicyFactory, *, overwrite: bool = False) -> None:
    """Register `factory` (a `FailurePolicy` subclass or a callable returning one) as `name`.

    Raises:
        ValueError: `name` is taken and `overwrite` is False.
        TypeError: `factory` is not callable.
    """
    _registry.register(name, factory, overwrite=overwrite)


def available_policies() -> list[str]:
    """Names `get_policy` accepts: the registered ones plus the installed entry points."""
    return _registry.names()


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
    key = normalize_name(policy)
    # Unknown keyword arguments reach the factory, which names them in its own TypeError.
    result = _registry.lookup(key)(**kwargs)
    if not isinstance(result, FailurePolicy):
        raise TypeError(
            f"failure policy {key!r} produced {type(result).__name__}, not a FailurePolicy"
        )
    return result
