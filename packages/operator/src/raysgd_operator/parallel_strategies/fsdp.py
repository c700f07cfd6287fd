"""`fsdp`: shard parameters, gradients and optimizer state over the workers with FSDP2.

Each worker holds 1/N of every sharded parameter (dim-0 chunks, as `torch.distributed.fsdp.
fully_shard` lays them out) and of the optimizer state built over them; full parameters exist only
transiently, per sharded submodule, during its forward and backward. Which submodules become their
own unit is `shard_modules`; the root model is always sharded last, so nothing stays replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, ContextManager, Union

import torch
from torch import nn
from torch.optim import Optimizer

from raysgd_base import check_number
from raysgd_operator._internal.precision import Precision
from raysgd_operator.parallel_strategy import ParallelStrategy, WrapContext

__all__ = ["FSDPStrategy", "ShardModules"]

#: Which submodules get their own FSDP unit: a class, a tuple of classes, or `fn(module) -> bool`.
ShardModules = Union[type, tuple[type, ...], Callable[[nn.Module], bool], None]


def _check_shard_modules(value: Any) -> Callable[[nn.Module], bool] | None:
    if value is None:
        return None
    if isinstance(value, type):
        value = (value,)
    if isinstance(value, (tuple, list)):
        classes = tuple(value)
        if not classes or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in classes
        ):
            raise ValueError(
                "fsdp strategy_args['shard_modules'] must be an nn.Module class, a tuple of them or "
                f"a callable taking a module; got {value!r}"
            )
        return lambda module: isinstance(module, classes)
    if callable(value):
        return value
    raise ValueError(
        "fsdp strategy_args['shard_modules'] must be an nn.Module class, a tuple of them or a "
        f"callable taking a module; got {value!r}"
    )


class FSDPStrategy(ParallelStrategy):
    """FSDP2 (`fully_shard`) on every model with trainable parameters.

    Args:
        shard_modules: submodules that become their own FSDP unit (gathered and freed one at a
            time), e.g. `nn.TransformerEncoderLayer`; None shards each model as one unit.
        reshard_after_forward: free gathered parameters after forward (less memory, one more
            all-gather in backward); False keeps them until after backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU (FSDP2's
            `CPUOffloadPolicy`); only meaningful when training on a GPU.

    Mixed precision follows the trainer's `use_fp16`: the precision backend's `param_dtypes()`
    (owned by `raysgd_amp`) becomes FSDP2's `MixedPrecisionPolicy`.
    """

    name = "fsdp"
    sharded = True
    # A sharded module is bound to the process group it was sharded over: after a resize the
    # runner builds the model again and loads the state resharded for the new size.
    rewrappable = False

    def __init__(
        self,
        *,
        shard_modules: ShardModules = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        self._select = _check_shard_modules(shard_modules)
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "fsdp strategy_args['reshard_after_forward'] must be True or False, got "
                f"{reshard_after_forward!r}"
            )
        if not isinstance(cpu_offload, bool):
            raise ValueError(
                f"fsdp strategy_args['cpu_offload'] must be True or False, got {cpu_offload!r}"
            )
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def _policies(self, precision: Precision) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        # A duck-typed backend without `param_dtypes` runs in full precision inside FSDP.
        dtypes = getattr(precision, "param_dtypes", None)
        param_dtype, reduce_dtype = dtypes() if callable(dtypes) else (None, None)
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        }
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs

    def wrap(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer], context: WrapContext
    ) -> list[nn.Module]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(context.device.type, (context.world_size,))
        kwargs = self._policies(context.precision)
        replaced: dict[int, nn.Parameter] = {}
        for model in models:
            if not any(p.requires_grad for p in model.parameters()):
                continue  # nothing to train, nothing to shard (as DDP leaves it alone)
            before = {id(p): name for name, p in model.named_parameters()}
            if self._select is not None:
                # Innermost first: a unit must not contain an already-sharded unit's parameters
                # twice, and fully_shard expects children to be sharded before their parents.
                for sub in reversed(list(model.modules())):
                    if sub is not model and self._select(sub):
                        fully_shard(sub, mesh=mesh, **kwargs)
            fully_shard(model, mesh=mesh, **kwargs)
            after = dict(model.named_parameters())
            replaced.update({pid: after[name] for pid, name in before.items() if name in after})
        _repoint_optimizers(optimizers, replaced)
        return list(models)

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return _gradient_sync_off(model)
        return super().no_sync(model)

    def clip_grad_norm(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        optimizer: Optimizer,
        precision: Precision,
        *,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        check_number("max_norm", max_norm, above=0)
        params = list(parameters)
        precision.unscale(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # Each worker sees only its shards' gradients: the norm over them is a partial result
        # that full_tensor() reduces over the mesh into the norm of the whole gradient.
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _repoint_optimizers(optimizers: Sequence[Optimizer], replaced: dict[int, nn.Parameter]) -> None:
    """Make optimizers built over the unsharded parameters step the sharded ones instead.

    `fully_shard` replaces each parameter with a new (DTensor) one of the same name; users build
    their optimizer before registering, so its groups still hold the old objects. Optimizer state
    keyed by the old objects would be silently orphaned, so a non-empty state is an error.
    """
    for optimizer in optimizers:
        if not any(id(p) in replaced for g in optimizer.param_groups for p in g["params"]):
            continue
        if len(optimizer.state):
            raise ValueError(
                "strategy 'fsdp' needs optimizers that have not stepped yet: register them right "
                "after creating them"
            )
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
