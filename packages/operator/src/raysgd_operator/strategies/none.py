"""`none`: every worker trains its own unwrapped copy (RaySGD's `wrap_ddp=False`)."""

from __future__ import annotations

from raysgd_operator.strategy import Strategy

__all__ = ["NoStrategy"]


class NoStrategy(Strategy):
    """No wrapping and no gradient synchronization; takes no arguments."""

    name = "none"
