"""`none`: every worker trains its own unwrapped copy (RaySGD's `wrap_ddp=False`)."""

from __future__ import annotations

from raysgd_operator.parallel_strategy import ParallelStrategy

__all__ = ["NoStrategy"]


class NoStrategy(ParallelStrategy):
    """No wrapping and no gradient synchronization; takes no arguments."""

    name = "none"
