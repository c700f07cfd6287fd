"""Rebuilding a user's DataLoader so that it reads this worker's rows of every epoch (and maybe in
another batch size): see `epoch_plan` for how the rows are split."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from raysgd_operator._internal.epoch_plan import EpochSampler, PlannedBatchSampler

__all__ = [
    "can_rebuild",
    "pin_for_device",
    "planned_sampler",
    "present_as",
    "rebuild_loader",
    "resplit",
    "should_pin",
    "was_shuffled",
]

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


def planned_sampler(loader: Any) -> EpochSampler | None:
    """The `EpochSampler` of a loader that `rebuild_loader` split, else None."""
    batches = getattr(loader, "batch_sampler", None)
    return batches.sampler if isinstance(batches, PlannedBatchSampler) else None


def present_as(loader: DataLoader, *, sampler: Any, batch_size: int, drop_last: bool) -> DataLoader:
    """Make `loader`, which reads a batch sampler, answer ``sampler``, ``batch_size`` and
    ``drop_last`` like the loader it replaces (code written for RaySGD reads them).

    DataLoader takes a batch sampler instead of these three and forbids setting them afterwards,
    although it no longer reads them for a map-style data set: it batches with the batch sampler,
    and ``drop_last`` only matters to iterable data sets. They are set past that guard here, the
    one place raysgd does so; `tests/operator/test_epoch_plan.py` checks that such a loader still
    reads its batch sampler's batches, so a DataLoader that starts to read them fails there.
    """
    for name, value in (("sampler", sampler), ("batch_size", batch_size), ("drop_last", drop_last)):
        object.__setattr__(loader, name, value)
    return loader


def resplit(
    loader: DataLoader, *, world_size: int, rank: int, batch_size: int | None = None
) -> None:
    """Point a loader that `rebuild_loader` split at another group (and batch size) in place; the
    next pass reads from the sampler's `start` on, split the new way."""
    sampler = planned_sampler(loader)
    if sampler is None:
        raise ValueError("resplit needs a loader made by rebuild_loader(split=True)")
    sampler.num_replicas, sampler.rank = int(world_size), int(rank)
    if batch_size is not None:
        sampler.batch_size = int(batch_size)
        present_as(loader, sampler=sampler, batch_size=int(batch_size), drop_last=loader.drop_last)


def rebuild_loader(
    loader: DataLoader,
    *,
    world_size: int,
    rank: int,
    batch_size: int | None = None,
    split: bool = True,
    pad: bool = True,
) -> DataLoader:
    """A copy of ``loader`` that reads the rows `rank` of `world_size` reads in every epoch.

    With `split`, its batches come from an `EpochSampler` (every row once per epoch over the
    workers, resumable from any row; the loader's ``sampler``); without, it is the same loader in
    another `batch_size`. `pad`: see `EpochSampler` (True for training, False for validation).

    Every other setting the user chose is kept: workers, collate_fn, pin_memory, drop_last, timeout,
    worker_init_fn, generator, multiprocessing context and, with worker processes, prefetch_factor
    and persistent_workers.
    """
    shuffle = was_shuffled(loader)
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if loader.num_workers > 0:
        # These two are only accepted by DataLoader when worker processes are used.
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["persistent_workers"] = loader.persistent_workers
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    batch_size = batch_size if batch_size is not None else loader.batch_size
    if not split:
        return DataLoader(
            loader.dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=loader.drop_last,
            **kwargs,
        )
    sampler = EpochSampler(
        loader.dataset,
        num_replicas=world_size,
        rank=rank,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=SAMPLER_SEED,
        drop_last=loader.drop_last,
        pad=pad,
    )
    split_loader = DataLoader(loader.dataset, batch_sampler=PlannedBatchSampler(sampler), **kwargs)
    return present_as(
        split_loader, sampler=sampler, batch_size=batch_size, drop_last=loader.drop_last
    )
