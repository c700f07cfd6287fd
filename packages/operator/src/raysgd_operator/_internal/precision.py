"""The single place raysgd_operator reaches raysgd_amp from."""

from __future__ import annotations

from raysgd_amp import Precision, check_apex_args, check_precision, get_precision

__all__ = ["Precision", "check_apex_args", "check_precision", "get_precision"]
