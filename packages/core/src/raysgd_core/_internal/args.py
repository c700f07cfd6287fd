"""Checks of `WorkerGroup`'s arguments, made before anything starts (clear errors, no half-started group)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Union

from raysgd_base import check_int

__all__ = ["STRATEGIES", "check_group_args"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_group_args(
    num_workers: int,
    *,
    num_cpus_per_worker: float,
    num_gpus_per_worker: float,
    backend: str,
    timeout_s: Union[float, timedelta],
    placement_strategy: str,
    init_hook: Optional[Callable[[], Any]],
    placement_group: Any,
    start_timeout_s: float,
    spare_workers: int = 0,
    spare_imports: Union[list[str], tuple[str, ...]] = (),
) -> float:
    """Raise ValueError/TypeError naming the bad argument; return `timeout_s` in seconds."""
    check_int("num_workers", num_workers)
    for name, value in (
        ("num_cpus_per_worker", num_cpus_per_worker),
        ("num_gpus_per_worker", num_gpus_per_worker),
    ):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if placement_strategy not in STRATEGIES:
        raise ValueError(
            f"placement_strategy must be one of {STRATEGIES}, got {placement_strategy!r}"
        )
    check_int("spare_workers", spare_workers, minimum=0)
    if not isinstance(spare_imports, (list, tuple)) or not all(
        isinstance(name, str) and name for name in spare_imports
    ):
        raise TypeError(f"spare_imports must be a sequence of module names, got {spare_imports!r}")
    if isinstance(timeout_s, timedelta):  # as torch.distributed takes it
        timeout_s = timeout_s.total_seconds()
    if timeout_s <= 0 or start_timeout_s <= 0:
        raise ValueError("timeout_s and start_timeout_s must be > 0")
    if init_hook is not None and not callable(init_hook):
        raise TypeError(f"init_hook must be callable, got {type(init_hook).__name__}")
    if isinstance(placement_group, str) and placement_group != "auto":
        raise ValueError(
            f"placement_group must be 'auto', None or a PlacementGroup, got {placement_group!r}"
        )
    return float(timeout_s)
