"""The trainer's workers as one part: the group, how their runners are built, and the calls.

`WorkerCalls` is the part of `TorchTrainer` that talks to the workers. It starts the
`WorkerGroup` and builds one runner per worker from a `RunnerRecipe` (the operator class, shipped
once; the options; the user's config and the datasets split over the group's size), runs the
trainer's calls on them and stops them. Every call goes one of two ways:

- `run`: a `train()` attempt inside the recovery loop (`Recovery.run`), which recovers from lost
  workers as the failure policy decides;
- `call` / `read` / `guarded`: any other call. A group found broken is repaired first, and a call
  that fails leaves the group to `Recovery.repair` (the same loop's resize, timeout and log) before
  the error is raised; `read` does a read again once after a lost worker.

Either way a user's exception reaches the caller in one form (`in_one_form`): an instance of both
`raysgd_core.WorkerError` (the worker's traceback in its message) and the user's exception class.
What the training state is, and where it is restored from, is `trainer_state`'s business.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, TypeVar

import ray

from raysgd._internal import worker
from raysgd._internal.datasets import DatasetSplitter
from raysgd._internal.recovery import Recovery
from raysgd_core import WorkerDiedError, WorkerError, WorkerGroup
from raysgd_operator import BATCH_SIZE, TrainingOptions, split_batch_size

__all__ = ["RunnerArgs", "RunnerRecipe", "WorkerCalls", "in_one_form"]

logger = logging.getLogger("raysgd")

T = TypeVar("T")


def in_one_form(error: WorkerError) -> WorkerError:
    """The form every user exception takes when it leaves the trainer: `error` as an instance of
    both `WorkerError` and its cause's class (`WorkerError.as_instance_of_cause`), keeping the
    traceback of where the group raised it."""
    return error.as_instance_of_cause().with_traceback(error.__traceback__)


class RunnerArgs(NamedTuple):
    """What `worker.create_runner` / `worker.restore_runner` build a runner from, for one size."""

    operator_ref: Any  # the operator class in the object store (a top-level ref, resolved there)
    config: dict[str, Any]  # each worker's config (its share of the global batch)
    options: TrainingOptions
    dataset_splits: Sequence[Mapping[str, Any]]  # every rank's split of the datasets, rank order


@dataclass
class RunnerRecipe:
    """How the runners are built, whatever the group's size.

    Attributes:
        operator_ref: The operator class in the object store, pickled once at construction: every
            start and restart reuses this copy (pickling it again later would take its closure
            cells as they are then).
        options: The workers' `TrainingOptions`.
        user_config: The config as the user gave it.
        config: The trainer's config (`TorchTrainer.config`): `config[BATCH_SIZE]` is the global
            batch actually used, rounded to a multiple of the live size.
        datasets: Splits `datasets=` over the group (a split belongs to the group it was made for).
    """

    operator_ref: Any
    options: TrainingOptions
    user_config: dict[str, Any]
    config: dict[str, Any]
    datasets: DatasetSplitter

    def args(self, size: int) -> RunnerArgs:
        """The runners' arguments for a group of `size`; updates `config[BATCH_SIZE]`."""
        worker_config, global_batch = split_batch_size(self.user_config, size)
        if global_batch is not None:
            self.config[BATCH_SIZE] = global_batch
        return RunnerArgs(self.operator_ref, worker_config, self.options, self.datasets.split(size))


class WorkerCalls:
    """The trainer's workers: start, calls with repair and one error form, stop.

    Args:
        group: The group, built (not started).
        recipe: How the runners are built.
        recovery: The recovery loop over `group`; every repair goes through it.
    """

    def __init__(self, group: WorkerGroup, recipe: RunnerRecipe, recovery: Recovery) -> None:
        self.group = group
        self.recipe = recipe
        self._recovery = recovery
        self._guarding = False

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

    # ------------------------------------------------------------------------ start and stop
    def start(self, copy_limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        """Start the group and build every worker's runner; returns rank 0's answer (see
        `worker.create_runner`: the state for the driver's copy, when it fits `copy_limit_bytes`).
        The caller releases the group when this raises."""
        started = time.monotonic()
        self.group.start()
        group_ready = time.monotonic()
        operator_ref, config, options, dataset_splits = self.runner_args()
        first = self.group.execute(
            worker.create_runner, operator_ref, config, options, copy_limit_bytes, dataset_splits
        )[0]
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

    # --------------------------------------------------------------------------------- calls
    def run(self, attempt: Callable[[], T], *, max_retries: int) -> T:
        """`attempt()` (a `train()` call on every worker) inside the recovery loop."""
        try:
            return self._recovery.run(attempt, max_retries=max_retries)
        except WorkerError as exc:
            raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception already)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Worker calls inside are made on a usable group and fail in one form: a group left
        broken is repaired first; a user error or a lost worker inside is handed to the recovery
        loop (`Recovery.repair`: logged, a loss counted, the group re-formed at its size with the
        state of the survivors) and then raised, a user error in its one form (`in_one_form`).
        Nested blocks are part of the outermost one."""
        if self._guarding:
            yield
            return
        self._guarding = True
        try:
            if self.group.needs_recovery:
                self._recovery.repair()
            try:
                yield
            except (WorkerError, WorkerDiedError) as exc:
                self._recovery.repair(exc)
                if isinstance(exc, WorkerError):
                    raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception)
                raise
        finally:
            self._guarding = False

    def call(self, fn: Callable[..., Any], *args: Any, rank: Optional[int] = None) -> Any:
        """`fn(*args)` on every worker (or on `rank`), guarded (see `guarded`)."""
        with self.guarded():
            if rank is None:
                return self.group.execute(fn, *args)
            return self.group.execute_single(rank, fn, *args)

    def read(self, fn: Callable[..., T], *args: Any, rank: int = 0) -> T:
        """`fn(*args)` on `rank` for something the user asked to read (the state, the model): a
        worker lost meanwhile is replaced (see `guarded`) and the read done again once."""
        try:
            return self.call(fn, *args, rank=rank)
        except WorkerDiedError:
            return self.call(fn, *args, rank=rank)

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
        probe = self.read(worker.write_probe, directory)
        if probe is None:
            return None
        try:
            os.remove(probe)
            return 0
        except FileNotFoundError:  # written on the worker's own disk: not seen from here
            self.call(worker.remove_file, probe, rank=0)
            return None
