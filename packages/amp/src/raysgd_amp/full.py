"""Full precision (fp32): the base `Precision` under its own name, chosen by `use_fp16=False`."""

from __future__ import annotations

from .precision import Precision

__all__ = ["FullPrecision"]


class FullPrecision(Precision):
    """Plain fp32 training: no autocast, no loss scaling, nothing to checkpoint.

    The base class already behaves this way; this named subclass exists so that `repr`, logs and
    `isinstance` checks say "full" rather than the abstract-sounding interface name.
    """

    name = "full"
