"""`ddp`: replicate each model with `DistributedDataParallel` (the default strategy)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from raysgd_operator.parallel_strategy import ParallelStrategy, WrapContext

__all__ = ["DDPStrategy", "per_parameter_mean"]


class _HookKeeping(DistributedDataParallel):
    """DistributedDataParallel that tells its strategy of each communication hook registered on
    it (`register_comm_hook`), so that the DDP wrapping the same model in a re-formed group
    gets the hook again. It bears DDP's name: a wrapped model reads as users expect
    (``type(model).__name__``, its repr)."""

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        super().register_comm_hook(state, hook)
        on_hook = getattr(self, "raysgd_on_hook", None)
        if on_hook is not None:
            on_hook(state, hook)


_HookKeeping.__name__ = _HookKeeping.__qualname__ = DistributedDataParallel.__name__


class DDPStrategy(ParallelStrategy):
    """DistributedDataParallel; `ddp_kwargs` go to its constructor (`register(ddp_args=)` wins).

    A model without trainable parameters (a frozen feature extractor) has no gradients to
    synchronize, and DDP refuses it, so it stays unwrapped. With one worker nothing is wrapped.
    A communication hook registered on a model's DDP (`register_comm_hook`) is registered again
    on the DDP that wraps the model after the group is re-formed (a recovery, a move).
    """

    name = "ddp"

    def __init__(self, **ddp_kwargs: Any) -> None:
        for key in ("module", "device_ids"):
            if key in ddp_kwargs:
                raise ValueError(f"ddp strategy_args cannot set {key!r}: raysgd sets it per worker")
        self.ddp_kwargs = dict(ddp_kwargs)
        # id(model) -> the (state, hook) pairs registered on its DDP, in order.
        self._comm_hooks: dict[int, list[tuple[object, Callable[..., Any]]]] = {}

    def wrap(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer], context: WrapContext
    ) -> list[nn.Module]:
        if context.world_size <= 1:
            return list(models)
        kwargs = {**self.ddp_kwargs, **context.ddp_args}
        if not context.sync_initial_state:
            kwargs["init_sync"] = False  # the caller restores the state right after
        return [
            self._wrap_one(m, context, kwargs)
            if any(p.requires_grad for p in m.parameters())
            else m
            for m in models
        ]

    def _wrap_one(
        self, model: nn.Module, context: WrapContext, kwargs: dict[str, Any]
    ) -> DistributedDataParallel:
        wrapped = _HookKeeping(model, device_ids=context.device_ids, **kwargs)
        hooks = self._comm_hooks.setdefault(id(model), [])
        for state, hook in hooks:
            DistributedDataParallel.register_comm_hook(wrapped, state, hook)
        wrapped.raysgd_on_hook = lambda state, hook: hooks.append((state, hook))
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_sync(model)


def per_parameter_mean(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP communication hook whose sums do not depend on DDP's bucket layout: the mean of each
    parameter's gradient over the workers, one all-reduce per parameter tensor.

    DDP's first step in a group (a re-formed one too) has its own bucket layout, and gloo's ring
    sums each element in an order that depends on its place in the bucket, so with the default
    hook a recovery changes a few sums of that step by a unit in the last place of float32.
    Summed per parameter, the result after any recovery is the uninterrupted run's bit for bit,
    at the cost of one collective per parameter tensor instead of one per bucket (fine for a
    model of few large tensors; many small ones pay each collective's latency). Register it in
    `setup`: ``self.model.register_comm_hook(None, per_parameter_mean)``. No annotations: DDP
    refuses a hook whose bucket is annotated other than `dist.GradBucket`.
    """
    world = dist.get_world_size()
    for grad in bucket.gradients():  # views of the bucket's buffer
        grad.div_(world)
        dist.all_reduce(grad)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
