"""The global batch size key and its split over workers (RaySGD's ``BATCH_SIZE``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from raysgd_base import check_int

__all__ = ["BATCH_SIZE", "check_batch_size", "split_batch_size"]

#: Config key holding the *global* batch size; every worker's config gets its share of it.
BATCH_SIZE = "*batch_size"


def check_batch_size(config: Mapping[str, Any], num_workers: int) -> int | None:
    """Validate ``config[BATCH_SIZE]`` for ``num_workers`` workers; return it (``None`` if absent).

    Raises ``TypeError`` when it is not an int, ``ValueError`` when it is below 1 or smaller than
    ``num_workers`` (a worker would get an empty batch). Cheap and silent: the driver calls it before starting workers.
    """
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


def split_batch_size(config: dict[str, Any], num_workers: int) -> tuple[dict[str, Any], int | None]:
    """Split ``config[BATCH_SIZE]`` over ``num_workers``.

    Returns ``(worker_config, global_batch_size)``: a copy of ``config`` whose ``BATCH_SIZE`` is the
    per-worker share ``global // num_workers``, and the global size actually trained with
    (``share * num_workers``; smaller than asked when it does not divide, which is warned about).
    Without the key the config is returned (copied) unchanged and the global size is ``None``.
    Errors as in `check_batch_size`.
    """
    total = check_batch_size(config, num_workers)
    worker_config = dict(config)
    if total is None:
        return worker_config, None
    share = total // num_workers
    if share * num_workers != total:
        # One channel only: a log line as well would show the same advice twice (Python prints
        # unhandled warning-level log records to stderr even without logging configured).
        warnings.warn(
            f"config[BATCH_SIZE]={total} does not divide over {num_workers} workers; "
            f"using {share} per worker, a global batch of {share * num_workers}",
            stacklevel=2,
        )
    worker_config[BATCH_SIZE] = share
    return worker_config, share * num_workers
