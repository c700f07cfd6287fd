"""`ddp`: replicate each model with `DistributedDataParallel` (the default strategy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from raysgd_operator.parallel_strategy import ParallelStrategy, WrapContext

__all__ = ["DDPStrategy"]


class DDPStrategy(ParallelStrategy):
    """DistributedDataParallel; `ddp_kwargs` go to its constructor (`register(ddp_args=)` wins).

    A model without trainable parameters (a frozen feature extractor) has no gradients to
    synchronize, and DDP refuses it, so it stays unwrapped. With one worker nothing is wrapped.
    """

    name = "ddp"

    def __init__(self, **ddp_kwargs: Any) -> None:
        for key in ("module", "device_ids"):
            if key in ddp_kwargs:
                raise ValueError(f"ddp strategy_args cannot set {key!r}: raysgd sets it per worker")
        self.ddp_kwargs = dict(ddp_kwargs)

    def wrap(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer], context: WrapContext
    ) -> list[nn.Module]:
        if context.world_size <= 1:
            return list(models)
        kwargs = {**self.ddp_kwargs, **context.ddp_args}
        if not context.sync_initial_state:
            kwargs["init_sync"] = False  # the caller restores the state right after
        return [
            DistributedDataParallel(m, device_ids=context.device_ids, **kwargs)
            if any(p.requires_grad for p in m.parameters())
            else m
            for m in models
        ]

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_sync(model)
