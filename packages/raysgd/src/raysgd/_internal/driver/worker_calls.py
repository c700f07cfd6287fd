"""The trainer's workers as one part: the group, how their runners are built, and the calls.

`WorkerCalls` starts the `WorkerGroup` and builds one runner per worker from a `RunnerRecipe`
(the operator class, shipped once; the options; the user's config and the datasets split over the
live size), and stops them. It makes plain calls:
repairing the group after a failed call and giving user errors their one form is the recovery
loop's (`guard.CallGuard.guarded`), which wraps the trainer's calls from above.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray

from raysgd._internal.driver.datasets import DatasetSplitter
from raysgd._internal.protocol import RunnerArgs
from raysgd._internal.worker import calls as worker
from raysgd_core import WorkerGroup
from raysgd_operator import BATCH_SIZE, BatchSplit, TrainingOptions

__all__ = ["RunnerRecipe", "WorkerCalls"]

logger = logging.getLogger("raysgd")


@dataclass
class RunnerRecipe:
    """How the runners are built, whatever the group's size.

    Attributes:
        operator_ref: The operator class in the object store, pickled once at construction: every
            start and restart reuses this copy (pickling it again later would take its closure
            cells as they are then).
        options: The workers' `TrainingOptions`.
        user_config: The config as the user gave it.
        datasets: Splits `datasets=` over the group (a split belongs to the group it was made for).
        state_class: The workers' half of the kind of state (`StateKind.worker_class`).
    """

    operator_ref: Any
    options: TrainingOptions
    user_config: dict[str, Any]
    datasets: DatasetSplitter
    state_class: type
    #: The batch split of each group size met so far: computed (and warned about, when it does
    #: not divide) once per size, whether a start, a resize or `TorchTrainer.config` asks.
    splits: dict[int, BatchSplit] = field(default_factory=dict)

    def split(self, size: int) -> BatchSplit:
        """`config[BATCH_SIZE]` over a group of `size`."""
        if size not in self.splits:
            split = BatchSplit.of(self.user_config, size)
            split.warn_if_uneven(stacklevel=2)
            self.splits[size] = split
        return self.splits[size]

    def args(self, size: int) -> RunnerArgs:
        """The runners' arguments for a group of `size`."""
        worker_config = self.split(size).worker_config(self.user_config)
        return RunnerArgs(
            self.operator_ref,
            worker_config,
            self.options,
            self.datasets.split(size),
            self.state_class,
        )

    def config_for(self, size: int) -> dict[str, Any]:
        """The trainer's config for a group of `size` (`TorchTrainer.config`): `config[BATCH_SIZE]`
        is the global batch that group trains with, a multiple of `size`."""
        config = dict(self.user_config)
        if size > 0 and BATCH_SIZE in config:
            config[BATCH_SIZE] = self.split(size).global_size
        return config


class WorkerCalls:
    """The trainer's workers: start, plain calls, stop.

    Args:
        group: The group, built (not started).
        recipe: How the runners are built.
    """

    def __init__(self, group: WorkerGroup, recipe: RunnerRecipe) -> None:
        self.group = group
        self.recipe = recipe

    @property
    def world_size(self) -> int:
        """Workers in the group now."""
        return int(self.group.world_size)

    @property
    def use_local(self) -> bool:
        """Whether rank 0 runs in this process."""
        return bool(self.group.use_local)

    def runner_args(self) -> RunnerArgs:
        """The runners' arguments for the group as it is now (after a resize: its new size)."""
        return self.recipe.args(self.world_size)

    def all_on_this_node(self) -> bool:
        """Whether every worker runs on this process's node (they see its local disk)."""
        here = ray.get_runtime_context().get_node_id()
        return all(info.node_id == here for info in self.group.workers)

    # ------------------------------------------------------------------------ start and stop
    def start(self, copy_limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        """Start the group and build every worker's runner; returns rank 0's answer (see
        `worker.create_runner`: the state for the driver's copy, when it fits `copy_limit_bytes`).
        The caller releases the group when this raises."""
        started = time.monotonic()
        self.group.start()
        group_ready = time.monotonic()
        first = self.group.execute(worker.create_runner, *self.runner_args(), copy_limit_bytes)[0]
        done = time.monotonic()
        logger.debug(
            "trainer ready in %.2fs (workers %.2fs, operator set-up %.2fs)",
            done - started,
            group_ready - started,
            done - group_ready,
        )
        return first

    def stop(self, force: bool) -> None:
        """Drop every runner (gracefully unless `force`), then release the workers."""
        try:
            if self.group.needs_recovery:
                pass  # a broken group takes no calls; killing the workers releases everything
            elif not force:
                self.group.execute(worker.drop_runner, True)
            elif self.use_local:
                # Killing actors does not reach rank 0 in this process: drop its runner here.
                self.group.execute_single(0, worker.drop_runner, False)
        except Exception as exc:  # a dead worker must not stop the rest from being released
            logger.warning("graceful worker shutdown failed (%s); killing the workers", exc)
        finally:
            self.group.shutdown()

    # --------------------------------------------------------------------------------- files
    def writer_rank(self, directory: str) -> Optional[int]:
        """A rank that can write a file into `directory` which this process sees: one on this
        process's node (rank 0 first), else rank 0 when `directory` is on a file system both
        share (it writes a probe file there that this process then looks for); None if none can."""
        here = ray.get_runtime_context().get_node_id()
        for info in self.group.workers:
            if info.node_id == here:
                return info.rank
        # The directory is made here (where the file goes in any case), so that a worker that
        # shares this disk finds it, and one that does not creates nothing on its own node.
        os.makedirs(directory, exist_ok=True)
        probe = self.group.execute_single(0, worker.write_probe, directory)
        if probe is None:
            return None
        try:
            os.remove(probe)
            return 0
        except FileNotFoundError:  # written on the worker's own disk: not seen from here
            self.group.execute_single(0, worker.remove_file, probe)
            return None
