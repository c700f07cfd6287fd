"""How a worker turns its dataset shard into batches: `DatasetOptions`.

A dataset shard is anything with ``iter_torch_batches(**kwargs)`` (a Ray Data ``DataIterator`` from
``Dataset.streaming_split``): this package never imports Ray, so the shard is duck-typed. The trainer
splits the datasets on the driver and hands every worker its shard; the worker's runner asks the shard
for batches of the worker's ``config[BATCH_SIZE]`` on the worker's device, with these options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from raysgd_base import check_int

__all__ = ["DatasetOptions"]


def _check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is not None:
        check_int(f"DatasetOptions.{name}", value, minimum=minimum)


@dataclass(frozen=True)
class DatasetOptions:
    """Options of the batches a worker draws from its dataset shard (``iter_torch_batches``).

    A shard yields dicts of tensors keyed by column. The default ``train_batch`` and
    ``validate_batch`` unpack a batch as ``(*features, target)``: ``columns`` names the columns, in
    that order, that make this tuple (``columns=("x", "y")`` gives ``(batch["x"], batch["y"])``).
    Without ``columns`` the dict itself reaches ``train_batch`` (override it to read the columns).

    Args:
        columns: Columns turned into the batch tuple, in order (the target last).
        dtypes: A torch dtype for every column, or a dict column -> dtype (Ray casts on the worker).
        collate_fn: Ray Data's collate hook, called on each batch before it reaches the loop (a
            function of a dict of numpy arrays, or a Ray ``*BatchCollateFn``); what it returns is the
            batch. Excludes ``dtypes`` (Ray's rule) and ``columns`` (the function shapes the batch).
        drop_last: Drop each worker's last, smaller batch of an epoch.
        local_shuffle_buffer_size: Rows buffered per worker for a local shuffle (None: no shuffle).
        local_shuffle_seed: Seed of that local shuffle.
        prefetch_batches: Batches fetched ahead on the worker.
    """

    columns: Optional[tuple[str, ...]] = None
    dtypes: Optional[Union[torch.dtype, Mapping[str, torch.dtype]]] = None
    collate_fn: Optional[Callable[[Any], Any]] = None
    drop_last: bool = False
    local_shuffle_buffer_size: Optional[int] = None
    local_shuffle_seed: Optional[int] = None
    prefetch_batches: int = 1

    def __post_init__(self) -> None:
        columns = self.columns
        if columns is not None:
            if isinstance(columns, str) or not isinstance(columns, Sequence):
                raise TypeError(
                    "DatasetOptions.columns must be a sequence of column names such as "
                    f"('x', 'y'), got {columns!r}"
                )
            if not columns or not all(isinstance(c, str) for c in columns):
                raise ValueError(
                    f"DatasetOptions.columns must name at least one column, got {columns!r}"
                )
            object.__setattr__(self, "columns", tuple(columns))
        dtypes = self.dtypes
        if dtypes is not None and not isinstance(dtypes, torch.dtype):
            if not isinstance(dtypes, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.dtype) for k, v in dtypes.items()
            ):
                raise TypeError(
                    "DatasetOptions.dtypes must be a torch.dtype or a dict of column -> torch.dtype, "
                    f"got {dtypes!r}"
                )
            object.__setattr__(self, "dtypes", dict(dtypes))
        if self.collate_fn is not None:
            if not callable(self.collate_fn):
                raise TypeError(
                    f"DatasetOptions.collate_fn must be callable, got {self.collate_fn!r}"
                )
            if self.dtypes is not None or self.columns is not None:
                raise ValueError(
                    "DatasetOptions.collate_fn excludes dtypes and columns: the collate function "
                    "builds the batch (cast and select the columns inside it)"
                )
        if not isinstance(self.drop_last, bool):
            raise TypeError(f"DatasetOptions.drop_last must be a bool, got {self.drop_last!r}")
        _check_optional_int("local_shuffle_buffer_size", self.local_shuffle_buffer_size, 1)
        _check_optional_int("local_shuffle_seed", self.local_shuffle_seed, 0)
        check_int("DatasetOptions.prefetch_batches", self.prefetch_batches, minimum=0)

    def iter_kwargs(self, batch_size: int, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of ``shard.iter_torch_batches`` for one worker."""
        kwargs: dict[str, Any] = {
            "batch_size": batch_size,
            "device": device,
            "drop_last": self.drop_last,
            "prefetch_batches": self.prefetch_batches,
        }
        if self.dtypes is not None:
            kwargs["dtypes"] = self.dtypes
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        if self.local_shuffle_buffer_size is not None:
            kwargs["local_shuffle_buffer_size"] = self.local_shuffle_buffer_size
            if self.local_shuffle_seed is not None:
                kwargs["local_shuffle_seed"] = self.local_shuffle_seed
        return kwargs
