"""The global batch size key and its split over workers (RaySGD's ``BATCH_SIZE``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raysgd_base import check_int

__all__ = ["BATCH_SIZE", "BatchSplit"]

#: Config key holding the *global* batch size; every worker's config gets its share of it.
BATCH_SIZE = "*batch_size"


def _checked(config: Mapping[str, Any], num_workers: int) -> int | None:
    """``config[BATCH_SIZE]`` checked for ``num_workers`` workers (``None`` when absent)."""
    check_int("num_workers", num_workers)
    if BATCH_SIZE not in config:
        return None
    total = check_int("config[BATCH_SIZE]", config[BATCH_SIZE])
    if total < num_workers:
        raise ValueError(
            f"config[BATCH_SIZE]={total} is smaller than num_workers={num_workers}: "
            "every worker needs at least one sample per batch"
        )
    return total


@dataclass(frozen=True)
class BatchSplit:
    """``config[BATCH_SIZE]`` (the global batch) split over a group of ``num_workers``.

    Made with `of`, which validates. The driver makes one per group size and hands each worker
    the config of `worker_config`; every resize to a new size makes the one of that size.

    Attributes:
        asked: The global batch the config asked for; ``None`` without the key (nothing to split).
        num_workers: The size of the group.
    """

    asked: int | None
    num_workers: int

    @classmethod
    def of(cls, config: Mapping[str, Any], num_workers: int) -> BatchSplit:
        """The split of ``config`` over ``num_workers``: a `TypeError` or `ValueError` when
        ``config[BATCH_SIZE]`` is not an int, is below 1 or is smaller than ``num_workers`` (a
        worker would get an empty batch)."""
        return cls(_checked(config, num_workers), num_workers)

    @property
    def share(self) -> int | None:
        """Each worker's batch: ``asked // num_workers``."""
        return None if self.asked is None else self.asked // self.num_workers

    @property
    def global_size(self) -> int | None:
        """The global batch actually trained with: ``share * num_workers`` (smaller than asked
        when it does not divide)."""
        share = self.share
        return None if share is None else share * self.num_workers

    @property
    def uneven(self) -> bool:
        """Whether the asked batch does not divide over the group (some samples are dropped)."""
        return self.asked is not None and self.global_size != self.asked

    def worker_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``config`` whose ``BATCH_SIZE`` is the worker's share (unchanged without it)."""
        worker_config = dict(config)
        if self.share is not None:
            worker_config[BATCH_SIZE] = self.share
        return worker_config

    def warn_if_uneven(self, stacklevel: int = 2) -> None:
        """Warn (a `UserWarning`) when the batch does not divide, naming what is used instead."""
        if self.uneven:
            # One channel only: a log line as well would show the same advice twice (Python
            # prints unhandled warning-level log records to stderr even without logging set up).
            warnings.warn(
                f"config[BATCH_SIZE]={self.asked} does not divide over {self.num_workers} "
                f"workers; using {self.share} per worker, a global batch of {self.global_size}",
                stacklevel=stacklevel + 1,
            )
