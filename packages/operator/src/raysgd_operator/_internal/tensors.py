"""Small tensor helpers for the runner: where a model lives, and plain CPU snapshots of state."""

from __future__ import annotations

import copy
import itertools
import mmap
from typing import Any

import torch
from torch import nn

__all__ = ["cpu_copy", "host_like", "on_device", "same_device_copy"]


def on_device(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or buffer anywhere but on the CPU."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return any(t.device.type != "cpu" for t in tensors)


def cpu_copy(obj: Any, into: Any = None) -> Any:
    """Detached CPU copies of every tensor, so the state is a snapshot (training goes on) and plain.

    With `into`, an earlier copy of the same structure that nothing reads any more, each tensor is
    copied into its counterpart there where both have the same shape and dtype: a copy into memory
    already in use takes a fraction of the time of one into new memory, which the system must
    first map and zero page by page.
    """
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(into, torch.Tensor)
            and into.device.type == "cpu"
            and (into.shape, into.dtype) == (obj.shape, obj.dtype)
            and into.data_ptr() != obj.data_ptr()
        ):
            return into.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        earlier = into if isinstance(into, dict) else {}
        return {k: cpu_copy(v, earlier.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        earlier = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else ()
        return type(obj)(cpu_copy(v, e) for v, e in itertools.zip_longest(obj, earlier))
    return copy.deepcopy(obj)


def same_device_copy(obj: Any) -> Any:
    """A copy of `obj` whose tensors are detached clones where they are (no wait for a device,
    no host memory): a snapshot that later in-place changes of the original do not reach."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: same_device_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(same_device_copy(v) for v in obj)
    return copy.deepcopy(obj)


def host_like(obj: Any) -> Any:
    """Uninitialised CPU tensors shaped like every dense tensor of `obj`, in its structure (other
    values as they are), for `cpu_copy(..., into=)`. One byte of every page is written, so the
    system maps and zeroes the pages now instead of during that copy. Reads only the shapes and
    dtypes of `obj`'s tensors: safe beside a training loop that updates them."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return None  # cpu_copy allocates these itself
        buffer = torch.empty(obj.shape, dtype=obj.dtype)
        if buffer.numel():
            buffer.view(-1).view(torch.uint8)[:: mmap.PAGESIZE].zero_()
        return buffer
    if isinstance(obj, dict):
        return {k: host_like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_like(v) for v in obj)
    return obj
