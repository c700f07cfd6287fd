"""Models built on the meta device: memory on the worker's device, then their first values.

A model too large for one device is built without memory (``with torch.device("meta"):``), so that
each worker materialises only what it holds: its shards under a sharded strategy (sharded first,
then given memory), the whole model otherwise. `materialize` gives a model's tensors memory on the
device (uninitialised: `Module.to_empty`) and has the operator's `init_weights` fill them.

`to_empty` makes new parameter objects, so optimizers built over the meta parameters are pointed
at the new ones (`repoint_optimizers`, which sharding needs too).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["materialize", "on_meta", "repoint_optimizers", "reset_parameters"]


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (has no memory)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize(
    model: nn.Module,
    device: torch.device,
    init_weights: Callable[[nn.Module], None],
    optimizers: Sequence[Optimizer],
) -> None:
    """Give `model`'s tensors memory on `device` and fill them with `init_weights(model)`; point
    `optimizers` at the new parameters."""
    before = {id(p): name for name, p in model.named_parameters()}
    model.to_empty(device=device)
    after = dict(model.named_parameters())
    repoint_optimizers(optimizers, {pid: after[name] for pid, name in before.items()})
    with torch.no_grad(), warnings.catch_warnings():
        # Sharded over a CPU mesh, each worker fills its shards from its own generator (the
        # values are not those the whole model would get from the same seed; on a GPU mesh
        # they are): torch warns about it at every random fill.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
        init_weights(model)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"init_weights left tensors on the meta device: {left[:5]}")


def reset_parameters(model: nn.Module) -> None:
    """The default `init_weights`: every submodule's own ``reset_parameters()`` (torch's layers
    define one; `nn.MultiheadAttention` calls it ``_reset_parameters``).

    Raises ValueError naming the modules whose parameters nothing would fill: a custom module
    without ``reset_parameters`` needs one, or an overridden `TrainingOperator.init_weights`.
    """
    missing = []
    # Innermost first: a module's own reset_parameters may set its children's values its way
    # (a scaled initialisation), and must not be overwritten by theirs.
    for name, module in reversed(list(model.named_modules())):
        reset = getattr(module, "reset_parameters", None) or getattr(
            module, "_reset_parameters", None
        )
        if callable(reset):
            reset()
        elif any(True for _ in module.parameters(recurse=False)):
            missing.append(name or type(module).__name__)
    if missing:
        raise ValueError(
            f"the model was built on the meta device, and its module(s) {missing[:5]} have "
            "parameters but no reset_parameters() to fill them: give them one, or override "
            "TrainingOperator.init_weights(model)"
        )


def repoint_optimizers(optimizers: Sequence[Optimizer], replaced: dict[int, nn.Parameter]) -> None:
    """Make optimizers built over parameters that were since replaced (by `id`: sharding, memory
    given to meta tensors) step the new ones.

    Users build their optimizer before registering, so its groups still hold the old objects.
    Optimizer state keyed by the old objects would be silently orphaned, so a non-empty state is
    an error.
    """
    for optimizer in optimizers:
        if not any(id(p) in replaced for g in optimizer.param_groups for p in g["params"]):
            continue
        if len(optimizer.state):
            raise ValueError(
                "the model's parameters were replaced (sharded, or given memory on the device) "
                "after its optimizer stepped: register optimizers right after creating them"
            )
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
