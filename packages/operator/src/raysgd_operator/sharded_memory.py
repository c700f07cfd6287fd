"""A host copy of a worker's part of a sharded state, kept as tensors: `torch.distributed.checkpoint`
(DCP) saving into memory and loading from it, and the same copy written as a DCP folder.

DCP plans a save as chunks (each rank's pieces of each tensor, with where they sit in the whole)
and a load as reads of slices of those chunks into each rank's own pieces: that is how it reshards
to another number of workers. `keep` saves through a writer that keeps every chunk as the tensor
it is handed: no serialisation and no file. `reader` serves a load from chunks that any ranks
kept. So an in-memory snapshot costs one copy into host memory (`stage`), its chunks can be sent
to a peer as they are, and a restore copies each slice it needs once, into the model.

Imported on first use only: it imports DCP, which takes most of a second.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raysgd_operator._internal.sharded import read_metadata, save_files

__all__ = ["Chunks", "keep", "one_buffer", "reader", "stage", "write_files"]

#: One rank's part of a state kept in memory: DCP's index of each chunk -> the chunk.
Chunks = dict[MetadataIndex, torch.Tensor]


def stage(tensors: dict[str, Any]) -> dict[str, Any]:
    """A copy of `tensors` (nested dicts of tensors and DTensors) in host memory, in their
    structure (DTensors stay DTensors, over the same mesh). Training may change the originals once
    it returns.

    Every tensor of the copy lives in one buffer (`one_buffer`), so that dropping the copy gives
    its memory back to the system at once (glibc maps a buffer above its mmap threshold on its
    own): copies made and dropped at every snapshot, tensor by tensor, would leave the heap
    holding their high-water mark.
    """
    from torch.distributed.tensor import DTensor

    leaves: list[tuple[list[str], torch.Tensor]] = []

    def walk(tree: dict[str, Any], path: list[str]) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, [*path, key])
            else:
                leaves.append(([*path, key], value))

    walk(tensors, [])
    with torch.no_grad():
        local = [t.to_local() if isinstance(t, DTensor) else t for _, t in leaves]
        copies = one_buffer([(tuple(t.shape), t.dtype) for t in local])
        for copy, source in zip(copies, local):
            copy.copy_(source)
    out: dict[str, Any] = {}
    for (path, original), copy in zip(leaves, copies):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _host_dtensor(original, copy) if isinstance(original, DTensor) else copy
    return out


def one_buffer(layout: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty host tensors of these shapes and dtypes, all in one buffer: one large allocation,
    which the allocator returns to the system whole once every tensor of it is dropped (many
    tensor-sized ones, made and dropped in turn as snapshots come and go, leave its heap
    fragmented and growing). Each starts at a multiple of 64 bytes."""
    offsets, total = [], 0
    for shape, dtype in layout:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8)
    return [
        buffer[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), start in zip(layout, offsets)
    ]


#: Where each tensor of `one_buffer` starts: a multiple of this (any dtype's size).
_ALIGN = 64


def _host_dtensor(like: Any, local: torch.Tensor) -> Any:
    """A DTensor laid out as `like` (same mesh, placements, global shape and stride) whose local
    part is `local`, a host tensor, whatever device `like`'s mesh is on.

    The one private use of DTensor here: `DTensor.from_local`, the public way, moves the local
    part onto the mesh's device (back onto the GPU), so the DTensor is made from `like`'s spec,
    as DCP's own staging does (test_sharded_memory checks it)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def keep(staged: dict[str, Any], group: Any) -> tuple[Optional[bytes], Chunks]:
    """Save `staged` (from `stage`) into memory: a collective over `group`, whose ranks number the
    parts. Returns (the metadata of every rank's chunks, pickled: on the group's rank 0 only, None
    elsewhere; this rank's chunks, sharing `staged`'s memory)."""
    writer = _MemoryWriter()
    dcp.save(staged, storage_writer=writer, process_group=group)
    metadata = pickle.dumps(writer.metadata) if writer.metadata is not None else None
    return metadata, writer.chunks


def reader(metadata: bytes, chunks: Mapping[MetadataIndex, torch.Tensor]) -> StorageReader:
    """A DCP storage reader that loads from `chunks` (at least every chunk the load reads, kept
    by any ranks) laid out as `metadata` (from `keep`) says."""
    return _MemoryReader(read_metadata(metadata), chunks)


def write_files(staged: dict[str, Any], directory: str, group: Any) -> None:
    """Write `staged` (from `stage`) as a DCP folder: this rank's data file under `directory`,
    and on rank 0 the metadata file (a collective over `group`)."""
    save_files(staged, directory, group)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class _MemoryWriter(StorageWriter):
    """Keeps the chunks this rank saves as they are; records which rank kept each chunk."""

    def __init__(self) -> None:
        self.chunks: Chunks = {}
        self.metadata: Optional[Metadata] = None
        self._rank = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.chunks, self.metadata = {}, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                kept = data.detach()
                size = kept.numel() * kept.element_size()
            else:  # a non-tensor entry, which the planner serialised
                raw = data.getvalue()
                kept = torch.tensor(list(raw), dtype=torch.uint8)
                size = len(raw)
            self.chunks[item.index] = kept
            results.append(
                WriteResult(index=item.index, size_in_bytes=size, storage_data=self._rank)
            )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The storage data of a chunk is the rank that kept it: the part a load fetches it from.
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class _MemoryReader(StorageReader):
    """Serves a load from chunks in memory: each read is a slice of a chunk, copied once."""

    def __init__(self, metadata: Metadata, chunks: Mapping[MetadataIndex, torch.Tensor]) -> None:
        self._metadata, self._chunks = metadata, chunks

    def reset(self, checkpoint_id: Any = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in plan.items:
            index = item.storage_index
            stored = self._chunks.get(index)
            if stored is None:
                raise ValueError(
                    f"the chunk of {index.fqn!r} at offset {tuple(index.offset or ())} is not "
                    "among the parts handed to this worker"
                )
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(stored.tolist())))
                continue
            piece = stored
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                piece = piece.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != piece.size():
                raise ValueError(
                    f"the chunk of {index.fqn!r} gives {tuple(piece.size())} where "
                    f"{tuple(target.size())} is loaded"
                )
            target.copy_(piece)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
