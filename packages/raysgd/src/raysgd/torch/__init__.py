"""RaySGD's ``ray.util.sgd.torch`` names.

`TorchTrainer`, `TrainingOperator` and `PyTorchTrainer` are plain imports; the Tune names
(`BaseTorchTrainable`, `PyTorchTrainable`, `is_distributed_trainable`, `distributed_checkpoint_dir`)
import `raysgd_tune` (and with it Ray Tune) only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raysgd.compat import PyTorchTrainer
from raysgd.trainer import TorchTrainer
from raysgd_operator import TrainingOperator

if TYPE_CHECKING:  # at run time resolved lazily by __getattr__ (Tune is optional)
    from raysgd.compat import PyTorchTrainable
    from raysgd_tune import BaseTorchTrainable, distributed_checkpoint_dir, is_distributed_trainable

__all__ = [
    "BaseTorchTrainable",
    "PyTorchTrainable",
    "PyTorchTrainer",
    "TorchTrainer",
    "TrainingOperator",
    "distributed_checkpoint_dir",
    "is_distributed_trainable",
]

_TUNE_NAMES = ("BaseTorchTrainable", "is_distributed_trainable", "distributed_checkpoint_dir")


def __getattr__(name: str) -> Any:
    if name in _TUNE_NAMES:
        try:
            import raysgd_tune
        except ImportError as exc:
            raise ImportError(
                f"raysgd.torch.{name} needs raysgd-tune: pip install 'raysgd[tune]'"
            ) from exc
        return getattr(raysgd_tune, name)
    if name == "PyTorchTrainable":
        from raysgd import compat

        return compat.PyTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
