"""Rebuilding a user's DataLoader with a DistributedSampler (and maybe another batch size)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

__all__ = ["can_rebuild", "pin_for_device", "rebuild_loader", "should_pin", "was_shuffled"]

# The sampler seed is fixed so that every worker, and a redone epoch, sees the same order.
SAMPLER_SEED = 0


def can_rebuild(loader: Any) -> bool:
    """Whether ``loader`` is a plain map-style DataLoader whose sampler we may replace.

    Only the default samplers qualify: a user's own sampler or batch sampler (their own
    DistributedSampler included) is respected, since replacing it would change what they asked for.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return False
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return False
    return type(loader.sampler) in (RandomSampler, SequentialSampler)


def should_pin(loader: Any, device: torch.device) -> bool:
    """Whether ``loader`` should put its batches in page-locked memory for ``device``.

    Only a CUDA device gains from it: a copy from pinned memory is asynchronous
    (``non_blocking=True``), from pageable memory it blocks the training loop for the whole copy.
    """
    return device.type == "cuda" and isinstance(loader, DataLoader) and not loader.pin_memory


def pin_for_device(loader: Any, device: torch.device) -> Any:
    """``loader``, told to pin its batches when `should_pin` says so (the loader itself is updated:
    DataLoader reads ``pin_memory`` each time an iterator starts)."""
    if should_pin(loader, device):
        loader.pin_memory = True
    return loader


def was_shuffled(loader: DataLoader) -> bool:
    """Whether the loader draws in random order (as Ray Train's ``prepare_data_loader`` decides)."""
    return isinstance(loader.sampler, RandomSampler)


def rebuild_loader(
    loader: DataLoader, *, world_size: int, rank: int, batch_size: int | None = None
) -> DataLoader:
    """A copy of ``loader`` sharded for ``rank`` of ``world_size`` (unsharded when 1).

    Every other setting the user chose is kept: workers, collate_fn, pin_memory, drop_last, timeout,
    worker_init_fn, generator, multiprocessing context and, with worker processes, prefetch_factor
    and persistent_workers.
    """
    shuffle = was_shuffled(loader)
    kwargs: dict[str, Any] = {
        "batch_size": batch_size if batch_size is not None else loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if loader.num_workers > 0:
        # These two are only accepted by DataLoader when worker processes are used.
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["persistent_workers"] = loader.persistent_workers
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    if world_size > 1:
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=SAMPLER_SEED,
        )
        return DataLoader(loader.dataset, sampler=sampler, shuffle=False, **kwargs)
    return DataLoader(loader.dataset, shuffle=shuffle, **kwargs)
