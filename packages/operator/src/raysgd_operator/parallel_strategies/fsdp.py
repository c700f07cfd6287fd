"""`fsdp`: shard parameters, gradients and optimizer state over the workers with FSDP2.

Each worker holds 1/N of every sharded parameter (dim-0 chunks, as `torch.distributed.fsdp.
fully_shard` lays them out) and of the optimizer state built over them; full parameters exist only
transiently, per sharded submodule, during its forward and backward. Which submodules become their
own unit is `shard_modules`; the root model is always sharded last, so nothing stays replicated.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, ContextManager, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from raysgd_base import check_number
from raysgd_operator._internal.meta_init import repoint_optimizers
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
    # fully_shard takes a module on the meta device: each worker then allocates its shards only.
    wraps_meta_models = True

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
        # Each sharded model's structure as it was before sharding, with its tensors on the meta
        # device (no memory): what `whole_model` fills with the gathered parameters.
        self._skeletons: weakref.WeakKeyDictionary[nn.Module, nn.Module] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, Any]:
        # The skeletons belong to this process's modules; a copy of the strategy (shipped to a
        # worker with the options) starts without any.
        state = dict(self.__dict__)
        state["_skeletons"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._skeletons = weakref.WeakKeyDictionary()

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

        # Named by the group (see `WrapContext.group`): a survivor of a resize gets a new rank.
        mesh = init_device_mesh(
            context.device.type,
            (context.world_size,),
            mesh_dim_names=(f"raysgd_group_{context.group}",),
        )
        kwargs = self._policies(context.precision)
        replaced: dict[int, nn.Parameter] = {}
        for model in models:
            if not any(p.requires_grad for p in model.parameters()):
                continue  # nothing to train, nothing to shard (as DDP leaves it alone)
            before = {id(p): name for name, p in model.named_parameters()}
            self._skeletons[model] = _meta_copy(model)
            if self._select is not None:
                # Innermost first: a unit must not contain an already-sharded unit's parameters
                # twice, and fully_shard expects children to be sharded before their parents.
                for sub in reversed(list(model.modules())):
                    if sub is not model and self._select(sub):
                        fully_shard(sub, mesh=mesh, **kwargs)
            fully_shard(model, mesh=mesh, **kwargs)
            after = dict(model.named_parameters())
            replaced.update({pid: after[name] for pid, name in before.items() if name in after})
        repoint_optimizers(optimizers, replaced)
        return list(models)

    def whole_state(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        raise RuntimeError(
            f"strategy {self.name!r} shards the model: no worker has its whole state (use "
            "save_sharded)"
        )

    def load_whole_state(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Optimizer],
        model_states: Sequence[dict[str, Any]],
        optimizer_states: Sequence[dict[str, Any]],
    ) -> None:
        """Load a whole state (of a `ddp` or `none` run) into the sharded models: each worker
        keeps its own part of every tensor."""
        # Imported on first use, as the runner imports it: DCP is slow to import.
        from raysgd_operator._internal.sharded import load_full

        load_full(models, optimizers, model_states, optimizer_states)

    def whole_model(self, model: nn.Module) -> Optional[nn.Module]:
        """Gather every parameter and buffer of `model` (DCP's full state dict, offloaded to the
        CPU: one whole copy, on rank 0 only) into a new, unsharded module of the same structure on
        the CPU. A collective; None on every rank but 0, and for a model that was not sharded."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        skeleton = self._skeletons.get(model)
        if skeleton is None:
            return self.unwrap(model)
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        whole = copy.deepcopy(skeleton).to_empty(device="cpu")
        whole.load_state_dict(state)
        return whole

    def unwrapped_copy(self, model: nn.Module) -> Optional[nn.Module]:
        """A copy of the skeleton kept when `model` was sharded: its structure and attributes as
        they were, every tensor on the meta device."""
        skeleton = self._skeletons.get(model)
        return None if skeleton is None else copy.deepcopy(skeleton)

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


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device: its structure and
    shapes, without copying (or allocating) its data."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
