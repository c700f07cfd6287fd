"""Sending one worker's training state to others over the process group, tensor by tensor.

After a loss, the survivor that got furthest gives its state to the workers that need it (the
replacements, survivors a step behind). The state never leaves the workers: its structure (a small
pickle in which every tensor is replaced by its shape and dtype) goes first, then the tensors
themselves with ``broadcast``, straight from the source's live tensors on its device, batched into
buckets so that a model of many small tensors does not pay one collective per tensor. Only the
source and the receivers take part: the whole group when that is everyone, else a subgroup, which
the other workers just create and drop, as `torch.distributed.new_group` asks of every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from raysgd_core import get_context

__all__ = ["BUCKET_BYTES", "broadcast_state", "flatten", "unflatten"]

#: Tensors smaller than this travel together in one flat buffer per dtype (one collective each).
BUCKET_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class _Spec:
    """Where a tensor was in the state, and what it looks like."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(the structure with every tensor replaced by a `_Spec`, the tensors in order)."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node.detach())
            return _Spec(len(tensors) - 1, tuple(node.shape), node.dtype, node.device.type)
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(tree), tensors


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of `flatten`."""
    if isinstance(skeleton, _Spec):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, unflatten(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(unflatten(v, tensors) for v in skeleton)
    return skeleton


def _specs(skeleton: Any) -> Iterator[_Spec]:
    if isinstance(skeleton, _Spec):
        yield skeleton
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            yield from _specs(value)
    elif isinstance(skeleton, (list, tuple)):
        for value in skeleton:
            yield from _specs(value)


def _buckets(specs: list[_Spec]) -> list[list[_Spec]]:
    """Consecutive small tensors of one dtype together; each large one alone."""
    buckets: list[list[_Spec]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[_Spec], int]] = {}
    for spec in specs:
        size = _nbytes(spec)
        if size >= BUCKET_BYTES:
            buckets.append([spec])
            continue
        bucket, used = open_by_dtype.get(spec.dtype, ([], 0))
        if used + size > BUCKET_BYTES and bucket:
            bucket, used = [], 0
        if not bucket:
            buckets.append(bucket)
        bucket.append(spec)
        open_by_dtype[spec.dtype] = (bucket, used + size)
    return buckets


def _nbytes(spec: _Spec) -> int:
    count = 1
    for dim in spec.shape:
        count *= dim
    return count * torch.empty((), dtype=spec.dtype).element_size()


def broadcast_state(
    state: Optional[Any], *, source: int, receivers: Sequence[int], device: torch.device
) -> Optional[Any]:
    """Send `state` (given on `source` only) to every rank in `receivers`; every rank of the
    process group calls this. Returns the state on the receivers (tensors on their devices: the
    spec's device type, `device` for CUDA), `state` itself on the source, None elsewhere.

    `device` is where collectives run: the worker's GPU with NCCL, the CPU with gloo.
    """
    members = sorted({source, *receivers})
    # A subgroup costs a rendezvous of its own (tens of milliseconds with gloo): only when some
    # ranks stay out, so that they are not sent a state they already hold. Its rendezvous waits
    # no longer than the group's own collectives: torch's default for a new group is 30 minutes,
    # and a receiver lost before it joins (a replacement that died setting up) would hold the
    # source that long, while the ranks outside wait out their bound and report it silent.
    group = None
    if len(members) < dist.get_world_size():
        timeout = timedelta(seconds=get_context().timeout_s)
        group = dist.new_group(ranks=members, timeout=timeout)
    rank = dist.get_rank()
    try:
        if rank not in members or len(members) == 1:
            return state if rank == source else None
        comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        if rank == source:
            skeleton, tensors = flatten(state)
        else:
            skeleton, tensors = None, []
        holder = [skeleton]
        dist.broadcast_object_list(holder, src=source, group=group, device=comm)
        skeleton = holder[0]
        specs = list(_specs(skeleton))
        received: dict[int, torch.Tensor] = {}
        for bucket in _buckets(specs):
            flat = _flat(bucket, tensors, comm) if rank == source else _empty(bucket, comm)
            dist.broadcast(flat, src=source, group=group)
            if rank != source:
                offset = 0
                for spec in bucket:
                    count = _nbytes(spec) // flat.element_size()
                    piece = flat[offset : offset + count].view(spec.shape)
                    offset += count
                    target = device if spec.device_type == "cuda" else torch.device("cpu")
                    received[spec.index] = piece.to(
                        target, copy=len(bucket) > 1 or piece.device != target
                    )
        if rank == source:
            return state
        return unflatten(skeleton, [received[i] for i in range(len(specs))])
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _flat(bucket: list[_Spec], tensors: list[torch.Tensor], comm: torch.device) -> torch.Tensor:
    if len(bucket) == 1:
        tensor = tensors[bucket[0].index]
        if tensor.device == comm and tensor.is_contiguous():
            return tensor.reshape(-1)  # sent as it is: no copy of a large tensor
    return torch.cat([tensors[spec.index].reshape(-1).to(comm) for spec in bucket])


def _empty(bucket: list[_Spec], comm: torch.device) -> torch.Tensor:
    count = (
        sum(_nbytes(spec) for spec in bucket)
        // torch.empty((), dtype=bucket[0].dtype).element_size()
    )
    return torch.empty(count, dtype=bucket[0].dtype, device=comm)
