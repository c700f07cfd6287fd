"""`PyTorchTrainer`: `TorchTrainer` under the name of the earliest RaySGD releases.

Public as `raysgd.compat.PyTorchTrainer`; it lives here so that `raysgd.compat` and the legacy Tune
trainable (`legacy.trainable`) both import it without importing each other.
"""

from __future__ import annotations

from typing import Any, Optional

from raysgd.trainer import TorchTrainer
from raysgd_operator import BATCH_SIZE

__all__ = ["PyTorchTrainer"]


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
