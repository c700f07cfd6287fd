"""Small tensor helpers for the runner: where a model lives, and plain CPU snapshots of state."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["cpu_copy", "on_device"]


def on_device(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or buffer anywhere but on the CPU."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return any(t.device.type != "cpu" for t in tensors)


def cpu_copy(obj: Any) -> Any:
    """Detached CPU copies of every tensor, so the state is a snapshot (training goes on) and plain."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)
