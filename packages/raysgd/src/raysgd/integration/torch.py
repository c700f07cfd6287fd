"""``ray.tune.integration.torch`` as RaySGD users knew it, served by `raysgd_tune` (loaded on use).

`DistributedTrainableCreator`, `distributed_checkpoint_dir` and `is_distributed_trainable` need
Ray Tune, an optional extra (`pip install 'raysgd[tune]'`), so they are resolved on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and linters; at run time they come from __getattr__
    from raysgd_tune import (
        DistributedTrainableCreator,
        distributed_checkpoint_dir,
        is_distributed_trainable,
    )

__all__ = ["DistributedTrainableCreator", "distributed_checkpoint_dir", "is_distributed_trainable"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            import raysgd_tune
        except ImportError as exc:
            raise ImportError(
                f"raysgd.integration.torch.{name} needs raysgd-tune: pip install 'raysgd[tune]'"
            ) from exc
        return getattr(raysgd_tune, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
