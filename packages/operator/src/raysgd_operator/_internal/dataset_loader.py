"""A dataset shard seen as a loader: every ``iter()`` is one pass (one epoch) over the shard."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from raysgd_operator.dataset_options import DatasetOptions

__all__ = ["DatasetLoader"]


class DatasetLoader:
    """Batches of one worker's shard of a dataset (anything with ``iter_torch_batches``).

    Its length is unknown (a streamed shard does not know its row count before the pass ends), so
    the runner learns the end of a pass by drawing past it.

    The shards are split with ``equal=True``: every worker reads the same number of rows, so the
    workers' batches have the same sizes step by step, and a step of the group reads `group_size`
    times this worker's batch (`group_rows`).
    """

    def __init__(
        self,
        shard: Any,
        *,
        name: str,
        batch_size: int,
        device: torch.device,
        options: DatasetOptions,
        group_size: int = 1,
    ) -> None:
        if not callable(getattr(shard, "iter_torch_batches", None)):
            raise TypeError(
                f"the shard of dataset {name!r} has no iter_torch_batches(): expected a Ray Data "
                f"DataIterator, got {type(shard).__name__}"
            )
        self.shard, self.name = shard, name
        self.batch_size = batch_size
        self.group_size = group_size
        self._columns = options.columns
        # A collate_fn gives batches of the user's own form, whose row count raysgd cannot tell.
        self._countable = options.collate_fn is None
        self._kwargs = options.iter_kwargs(batch_size, device)

    def __iter__(self) -> Iterator[Any]:
        batches = self.shard.iter_torch_batches(**self._kwargs)
        if self._columns is None:
            return iter(batches)
        return (self._select(batch) for batch in batches)

    def group_rows(self, batch: Any) -> int | None:
        """Rows the whole group reads in the step of `batch` (one of this loader's), or None where
        a `collate_fn` made its form the user's."""
        if not self._countable:
            return None
        first = next(iter(batch.values()), None) if isinstance(batch, Mapping) else batch[0]
        return None if first is None else len(first) * self.group_size

    def _select(self, batch: Any) -> tuple[Any, ...]:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"dataset {self.name!r}: DatasetOptions.columns needs dict batches, got "
                f"{type(batch).__name__}"
            )
        try:
            return tuple(batch[c] for c in self._columns or ())
        except KeyError as err:
            raise KeyError(
                f"dataset {self.name!r} has no column {err.args[0]!r} (DatasetOptions.columns); "
                f"its batches have {sorted(batch)}"
            ) from None
