"""The strategy interface: how one worker's models are spread over the process group.

A strategy wraps the registered models once the process group exists, and answers the few questions
the training loop has about that wrapping::

    models = strategy.wrap(models, optimizers, context)      # after precision.setup
    with strategy.no_sync(model):                            # accumulation batches: no gradient sync
        precision.backward(loss, optimizer)
    strategy.clip_grad_norm(params, 1.0, optimizer, precision)  # total norm over every worker's part

The base class is itself a complete strategy: no wrapping at all (each worker trains its own copy,
RaySGD's `wrap_ddp=False`). `ddp` replicates the model with DistributedDataParallel (the default);
`fsdp` shards parameters, gradients and optimizer state with FSDP2's `fully_shard`. Third-party
strategies subclass `ParallelStrategy` and register under the entry-point group `raysgd.strategy` (see
`raysgd_operator.parallel_strategies.registry`).

Strategies whose `sharded` is True hold only part of each tensor on a worker; the runner then keeps
its state in `torch.distributed.checkpoint` form (one part per worker) instead of one whole copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer

from raysgd_operator._internal.precision import Precision

__all__ = ["ParallelStrategy", "WrapContext"]


@dataclass(frozen=True)
class WrapContext:
    """What a strategy may need to know when it wraps a worker's models.

    Attributes:
        device: the device the models are on.
        world_size: number of workers in the process group (1 is legitimate).
        precision: the worker's precision backend (its `param_dtypes()` says how to cast).
        device_ids: `[device.index]` on a GPU, else None (what DDP wants).
        ddp_args: keyword arguments the operator gave `register(ddp_args=...)`.
        sync_initial_state: make every worker start from rank 0's parameters (a new group);
            False when the workers' state is restored right after wrapping (a recovery), so that
            wrapping must not overwrite the state a survivor holds.
        group: which process group this is (the same on every rank; another one after a
            resize). A strategy that builds a `DeviceMesh` names it by this: torch compares meshes
            by their shape and names only, and would reuse what it cached for an earlier group's
            mesh, in which this worker may have had another rank.
    """

    device: torch.device
    world_size: int
    precision: Precision
    device_ids: list[int] | None = None
    ddp_args: dict[str, Any] = field(default_factory=dict)
    sync_initial_state: bool = True
    group: int = 0


class ParallelStrategy:
    """A data-parallel strategy; the defaults implement `none` (no wrapping).

    Method contract (the operator and the runner rely on it):

    - `wrap(models, optimizers, context)` is called once the process group exists, after
      `precision.setup`. It returns the models to train with. A strategy that replaces parameters
      (sharding does) must update `optimizers`' parameter groups in place, in the same order.
    - `no_sync(model)` is entered around forward and backward of batches after which the
      optimizer does not step (gradient accumulation); gradients must then stay local.
    - `clip_grad_norm(...)` clips with the total norm over all workers' parameters.
    - `rewrappable`: whether `wrap` may be called again on the original modules after the process
      group was re-formed with another size. When False, `unwrapped_copy(model)` gives a copy of
      each module as it was before wrapping (on the meta device), which the runner wraps for the
      new group in its place, keeping the operator; a strategy that cannot give one (None) has
      the runner build a new operator instead.
    - `sharded`: whether each worker holds only a part of the parameters (checkpoints are then
      written per worker, in `torch.distributed.checkpoint` format).
    - `wraps_meta_models`: whether `wrap` takes models still on the meta device (each worker then
      gives memory to its own part only, after wrapping); otherwise a model built there gets its
      memory before `wrap`.
    - `whole_state(models, optimizers)` and `load_whole_state(...)`: the models' and optimizers'
      state dicts as one whole copy (what `StateIO.state_dict` holds), saved where every
      worker has all of it and loaded into any strategy's models.
    - `whole_model(model)` gives the user's whole module: the unwrapped model itself when every
      worker holds all of it; for a sharded strategy, a collective that returns a new module on
      the CPU, with every parameter gathered, on rank 0 (None on the others).
    """

    #: Short name used in logs, errors and checkpoints.
    name: str = "none"
    sharded: bool = False
    rewrappable: bool = True
    wraps_meta_models: bool = False

    def wrap(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer], context: WrapContext
    ) -> list[nn.Module]:
        """The models to train with (the base class leaves them as they are)."""
        return list(models)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside a wrapper (the model itself when not wrapped)."""
        return model

    def whole_state(
        self, models: Sequence[nn.Module], optimizers: Sequence[Optimizer]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The `state_dict()` of every model and optimizer, their live tensors (not copies).
        A sharded strategy raises: no worker has the whole state."""
        return [m.state_dict() for m in models], [o.state_dict() for o in optimizers]

    def load_whole_state(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Optimizer],
        model_states: Sequence[dict[str, Any]],
        optimizer_states: Sequence[dict[str, Any]],
    ) -> None:
        """Load whole state dicts (`whole_state` of a run with any strategy that has one) into
        this worker's models and optimizers."""
        for model, state in zip(models, model_states):
            model.load_state_dict(state)
        for optimizer, state in zip(optimizers, optimizer_states):
            optimizer.load_state_dict(state)

    def whole_model(self, model: nn.Module) -> nn.Module | None:
        """The user's whole module (see the class docstring); the base class unwraps it."""
        return self.unwrap(model)

    def unwrapped_copy(self, model: nn.Module) -> nn.Module | None:
        """For a strategy that is not `rewrappable`: a copy of the user's `model` as it was
        before `wrap`, its tensors on the meta device (no memory), to wrap for a new group in
        its place; None when the strategy keeps no such copy."""
        return None

    def whole_model_nbytes(self, model: nn.Module) -> int:
        """What `whole_model` brings into one process: every parameter and buffer, in bytes."""
        tensors = [*model.parameters(), *model.buffers()]
        return sum(_global_numel(t) * t.element_size() for t in tensors)

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """A context in which backward passes do not synchronize gradients across workers."""
        return contextlib.nullcontext()

    def clip_grad_norm(
        self,
        parameters: Iterable[torch.Tensor],
        max_norm: float,
        optimizer: Optimizer,
        precision: Precision,
        *,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale `optimizer`'s gradients and clip `parameters` to `max_norm` (total norm returned)."""
        return precision.clip_grad_norm(list(parameters), max_norm, optimizer, norm_type=norm_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _global_numel(tensor: torch.Tensor) -> int:
    """The number of elements of the whole tensor (a sharded DTensor's global shape)."""
    return int(torch.Size(tensor.shape).numel())
