"""The single place raysgd_operator reaches raysgd_amp from."""

from __future__ import annotations

from raysgd_amp import Precision, get_precision

__all__ = ["Precision", "get_precision"]
