"""Names from the earliest RaySGD releases (`PyTorchTrainer`, `PyTorchTrainable`), kept working."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from raysgd.trainer import TorchTrainer
from raysgd_operator import BATCH_SIZE

if TYPE_CHECKING:  # at run time resolved lazily by __getattr__ (Tune is optional)
    from raysgd._internal.legacy_trainable import PyTorchTrainable

__all__ = ["PyTorchTrainable", "PyTorchTrainer"]


class PyTorchTrainer(TorchTrainer):
    """`TorchTrainer` under its 0.8-era name.

    Also accepts that era's arguments: `num_replicas` (the number of workers) and `batch_size` (the
    global batch, i.e. `config[BATCH_SIZE]`). Everything else is `TorchTrainer`'s.
    """

    def __init__(
        self,
        *,
        num_replicas: Optional[int] = None,
        batch_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        if num_replicas is not None:
            if "num_workers" in kwargs:
                raise ValueError("pass num_workers or num_replicas, not both")
            kwargs["num_workers"] = num_replicas
        if batch_size is not None:
            config = dict(kwargs.get("config") or {})
            if BATCH_SIZE in config and config[BATCH_SIZE] != batch_size:
                raise ValueError("batch_size and config[BATCH_SIZE] disagree; pass one of them")
            config[BATCH_SIZE] = batch_size
            kwargs["config"] = config
        super().__init__(**kwargs)


def __getattr__(name: str) -> Any:
    # The Tune trainable needs Ray Tune, an optional extra: resolve it only when asked for.
    if name == "PyTorchTrainable":
        try:
            import raysgd_tune  # noqa: F401  (only to tell a missing extra from other errors)
        except ImportError as exc:
            raise ImportError(
                "PyTorchTrainable needs raysgd-tune: pip install 'raysgd[tune]'"
            ) from exc
        from raysgd._internal.legacy_trainable import PyTorchTrainable

        return PyTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
