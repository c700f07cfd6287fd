"""Names from the earliest RaySGD releases (`PyTorchTrainer`, `PyTorchTrainable`), kept working."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raysgd._internal.legacy.trainer import PyTorchTrainer

if TYPE_CHECKING:  # at run time resolved lazily by __getattr__ (Tune is optional)
    from raysgd._internal.legacy.trainable import PyTorchTrainable

__all__ = ["PyTorchTrainable", "PyTorchTrainer"]


def __getattr__(name: str) -> Any:
    # The Tune trainable needs Ray Tune, an optional extra: resolve it only when asked for.
    if name == "PyTorchTrainable":
        try:
            import raysgd_tune  # noqa: F401  (only to tell a missing extra from other errors)
        except ImportError as exc:
            raise ImportError(
                "PyTorchTrainable needs raysgd-tune: pip install 'raysgd[tune]'"
            ) from exc
        from raysgd._internal.legacy.trainable import PyTorchTrainable

        return PyTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
