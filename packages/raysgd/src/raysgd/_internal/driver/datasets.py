"""Ray Data input on the driver: checking `datasets=` and splitting the datasets over the workers.

Every dataset is split with ``Dataset.streaming_split(n, equal=True)`` into one ``DataIterator`` per
worker. Equal shards matter: a worker that ran out of batches before the others would leave them
blocked in a collective. A split belongs to one group of workers (its coordinator waits for all ``n``
readers at the start of each epoch), so every resize or recovery makes a new split over the new
group; the old one is dropped with the shards the workers held, and its coordinator actor with it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any, Optional, Union

from raysgd_operator import BATCH_SIZE, DatasetOptions

__all__ = [
    "INSTALL_HINT",
    "DatasetSplitter",
    "check_datasets",
    "require_ray_data",
    "warn_if_no_room_for_data",
]

logger = logging.getLogger("raysgd")

INSTALL_HINT = 'pip install "raysgd[data]"  (or: pip install "ray[data]")'

# Ray Data's own dependencies (the `ray[data]` extra): importing `ray.data` works without them, but
# reading or converting any data fails later, on a worker.
_RAY_DATA_MODULES = ("pyarrow", "pandas", "ray.data")


def require_ray_data() -> Any:
    """The `ray.data` module, or an ImportError that says how to install Ray Data."""
    for name in _RAY_DATA_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            raise ImportError(
                f"TorchTrainer(datasets=...) needs Ray Data, but {name} cannot be imported "
                f"({err}); install it with: {INSTALL_HINT}"
            ) from err
    return module


def check_datasets(
    datasets: Optional[Mapping[str, Any]],
    dataset_options: Union[DatasetOptions, Mapping[str, Any], None],
    config: Mapping[str, Any],
) -> tuple[dict[str, Any], Optional[DatasetOptions]]:
    """Validate the trainer's `datasets` and `dataset_options` before any worker starts.

    Returns the datasets as a plain dict (empty when none) and the options as a `DatasetOptions`
    (a dict of its fields is accepted).
    """
    if datasets is None:
        if dataset_options is not None:
            raise ValueError("dataset_options has no effect without datasets=")
        return {}, None
    if not isinstance(datasets, Mapping):
        raise TypeError(
            f'datasets must be a dict such as {{"train": ds}}, got {type(datasets).__name__}'
        )
    if not datasets:
        raise ValueError('datasets is empty: give at least {"train": ds}, or leave it out')
    ray_data = require_ray_data()
    for name, ds in datasets.items():
        if not isinstance(name, str):
            raise TypeError(f"dataset names must be strings, got {name!r}")
        if not isinstance(ds, ray_data.Dataset):
            raise TypeError(
                f"datasets[{name!r}] must be a ray.data.Dataset, got {type(ds).__name__} (torch "
                "DataLoaders go through register_data in the operator's setup, or data_creator)"
            )
    if BATCH_SIZE not in config:
        raise ValueError(
            "datasets= needs the global batch size in config[BATCH_SIZE] (from raysgd.utils): "
            "each worker draws batches of its share"
        )
    if isinstance(dataset_options, Mapping):
        dataset_options = DatasetOptions(**dataset_options)
    elif dataset_options is not None and not isinstance(dataset_options, DatasetOptions):
        raise TypeError(
            "dataset_options must be a raysgd.DatasetOptions or a dict of its fields, "
            f"got {type(dataset_options).__name__}"
        )
    return dict(datasets), dataset_options


def warn_if_no_room_for_data(num_workers: int, num_cpus_per_worker: float) -> None:
    """Warn when the workers would take every CPU of the cluster: Ray Data's read and map tasks
    need CPUs of their own, and without one they wait forever (and training with them)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0.0)
    if total - num_workers * num_cpus_per_worker < 1:
        logger.warning(
            "datasets=: the %d worker(s) take %.4g of the cluster's %.4g CPUs, leaving none for "
            "Ray Data's tasks, which would then wait forever; use fewer workers or "
            "num_cpus_per_worker, or a bigger cluster",
            num_workers,
            num_workers * num_cpus_per_worker,
            total,
        )


class DatasetSplitter:
    """Splits the trainer's datasets over a group of workers (nothing to split when empty)."""

    def __init__(self, datasets: Mapping[str, Any]) -> None:
        self.datasets = dict(datasets)
        self.splits = 0  # how many splits were made (one per group the datasets were split over)

    def __bool__(self) -> bool:
        return bool(self.datasets)

    def split(self, num_workers: int) -> list[dict[str, Any]]:
        """Each rank's shards, ``[{name: DataIterator}, ...]`` in rank order (empty dicts when there
        are no datasets). The caller hands them to the workers and keeps no reference, so that the
        split ends with the group that reads it."""
        if not self.datasets:
            return [{} for _ in range(num_workers)]
        per_name = {
            name: ds.streaming_split(num_workers, equal=True) for name, ds in self.datasets.items()
        }
        self.splits += 1
        return [
            {name: shards[rank] for name, shards in per_name.items()} for rank in range(num_workers)
        ]
