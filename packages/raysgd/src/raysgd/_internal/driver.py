"""The driver side of a `TorchTrainer`: its workers, their runners and the last good state.

`TorchTrainer` inherits from `TrainerDriver`, which keeps the plumbing out of the public class: starting
the group and the per-worker runners, calling functions on the workers with typed errors, keeping
`_last_state` (rank 0's state as bytes) current, and the seam the recovery loop uses after a resize.
Attributes are set by `TorchTrainer.__init__` (see there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import ray

from raysgd._internal import worker
from raysgd._internal.checkpoint import write_file
from raysgd._internal.datasets import DatasetSplitter
from raysgd._internal.sharded_state import ShardedState
from raysgd._internal.tensorboard import ScalarLogger
from raysgd_core import WorkerDiedError, WorkerError, WorkerGroup
from raysgd_operator import (
    BATCH_SIZE,
    TrainingOptions,
    reduce_worker_results,
    split_batch_size,
)

__all__ = ["AUTO_CHECKPOINT_NAME", "TrainerDriver"]

logger = logging.getLogger("raysgd")

#: File name of the `checkpoint="auto"` state inside `checkpoint_dir`.
AUTO_CHECKPOINT_NAME = "raysgd_checkpoint.pt"
#: Directory name of the `checkpoint="auto"` state with a sharded strategy.
AUTO_SHARDED_CHECKPOINT_NAME = "raysgd_checkpoint"


class TrainerDriver:
    """Driver-side plumbing shared by `TorchTrainer`'s methods (private)."""

    _group: WorkerGroup
    _num_workers: int
    _operator_cls: type
    _operator_ref: Any  # `_operator_cls` in the object store, pickled once (see TorchTrainer)
    _options: TrainingOptions
    _datasets: DatasetSplitter
    _user_config: dict[str, Any]
    _config: dict[str, Any]
    _use_local: bool
    _checkpoint_dir: Optional[str]
    _tensorboard: Optional[ScalarLogger]
    _recovery: Any
    # The last good state (bytes of rank 0's state dict) and whether it matches the workers now.
    _last_state: bytes = b""
    # With a sharded strategy (fsdp) the state lives on the workers; this is the driver's view.
    _sharded: Optional[ShardedState] = None
    _state_fresh: bool = False
    # The rank that keeps a copy of `_last_state` (rank 0 after every call that sets it; None when
    # unknown): a restore broadcasts from there instead of shipping the state from the driver.
    _state_rank: Optional[int] = None
    _shut_down: bool = False

    # ----------------------------------------------------------------------------------- set-up
    def _start_workers(self) -> None:
        """Start the group and build every worker's runner; on any error release everything."""
        started = time.monotonic()
        try:
            self._group.start()
            group_ready = time.monotonic()
            worker_config = self._split_config(self._world_size())
            states = self._group.execute(
                worker.create_runner,
                self._operator_ref,
                worker_config,
                self._options,
                self._sharded is None,
                self._datasets.split(self._world_size()),
            )
            if self._sharded is not None:
                self._sharded.capture(self._group)
        except BaseException as exc:
            self._group.shutdown()
            self._shut_down = True
            if self._tensorboard is not None:
                self._tensorboard.close()
            if isinstance(exc, WorkerError) and isinstance(exc.__cause__, (ValueError, TypeError)):
                # A bad creator or operator set-up is the user's input error: raise it as its own
                # type, chained to the WorkerError that holds the worker's traceback (the cause's
                # own frames do not survive the trip back from the worker).
                raise exc.__cause__ from exc
            raise
        self._last_state, self._state_fresh = states[0] or b"", True
        self._state_rank = 0 if states[0] else None
        done = time.monotonic()
        logger.debug(
            "trainer ready in %.2fs (workers %.2fs, operator set-up %.2fs)",
            done - started,
            group_ready - started,
            done - group_ready,
        )

    def _split_config(self, size: int) -> dict[str, Any]:
        """Each worker's config for a group of `size`; updates `config[BATCH_SIZE]` (rounded)."""
        worker_config, global_batch = split_batch_size(self._user_config, size)
        if global_batch is not None:
            self._config[BATCH_SIZE] = global_batch
        return worker_config

    def _world_size(self) -> int:
        return int(self._group.world_size)

    def _restore_after_resize(self, report: Any = None) -> None:
        """Seam for the recovery loop: make every worker of the re-formed group ready to train.

        Kept workers re-bind their runner to the new ranks and size (rebuilt when that is not
        possible), new workers build one, the global batch and the datasets are re-split, and all
        load `_last_state`.
        When `_last_state` is not current (train() skipped the snapshot, e.g. max_retries=0), it is
        first read from rank 0, a survivor of the old group when there is one.
        """
        if self._sharded is not None:
            self._restore_sharded()
            return
        kept = dict(getattr(report, "kept", None) or {})
        source = kept.get(self._state_rank) if self._state_rank is not None else None
        if not self._state_fresh:
            if kept:
                self._last_state = self._group.execute_single(0, worker.state_bytes)
                source = 0  # which now keeps it
            else:
                logger.warning("no worker survived: restoring the last state the driver holds")
            self._state_fresh = True
        worker_config = self._split_config(self._world_size())
        # A survivor that kept the last good state broadcasts it over the new process group; the
        # driver ships it (one object-store copy for all) only when none did.
        state = None if source is not None else ray.put(self._last_state)
        logger.debug(
            "restoring the last good state from %s",
            f"rank {source}" if state is None else "the driver",
        )
        self._state_rank = None  # until every rank has loaded it
        self._group.execute(
            worker.restore_runner,
            self._operator_ref,
            worker_config,
            self._options,
            state,
            # A split belongs to the group it was made for: the new group reads a new one.
            self._datasets.split(self._world_size()),
            source,
        )
        self._state_rank = 0

    def _restore_sharded(self) -> None:
        """`_restore_after_resize` for sharded strategies: every runner is rebuilt from the last
        snapshot's parts (survivors' own and their replicas), resharded to the new size, and a new
        snapshot is taken at once so that every part has a replica again."""
        assert self._sharded is not None
        if not self._state_fresh:
            logger.warning(
                "restoring the last sharded snapshot: the work done after it will be redone"
            )
        self._sharded.restore(
            self._group,
            self._operator_ref,
            self._split_config(self._world_size()),
            self._options,
            self._datasets.split(self._world_size()),
        )
        self._sharded.capture(self._group)
        self._state_fresh = True

    def _sharded_view(self) -> ShardedState:
        # A ddp/none trainer loads sharded checkpoints too, through a throw-away view.
        return self._sharded if self._sharded is not None else ShardedState()

    def _load_sharded(self, load: Callable[[], None]) -> None:
        self._capture_state()  # so that a failed load can be rolled back
        with self._repairing():
            load()
        self._state_fresh = False
        self._capture_state()

    def _stop_workers(self, force: bool) -> None:
        """Drop every runner (gracefully unless `force`), then release the workers and logs."""
        try:
            if self._group.needs_recovery:
                pass  # a broken group takes no calls; killing the workers releases everything
            elif not force:
                self._group.execute(worker.drop_runner, True)
            elif self._use_local:
                # Killing actors does not reach rank 0 in this process: drop its runner here.
                self._group.execute_single(0, worker.drop_runner, False)
        except Exception as exc:  # a dead worker must not stop the rest from being released
            logger.warning("graceful worker shutdown failed (%s); killing the workers", exc)
        finally:
            self._group.shutdown()
            if self._tensorboard is not None:
                self._tensorboard.close()

    # ------------------------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("This TorchTrainer has been shut down; create a new one.")

    def _call(self, fn: Callable[..., Any], *args: Any, rank: Optional[int] = None) -> Any:
        """`fn(*args)` on every worker (or on `rank`); a user exception comes back as its own type.

        The last good state is made current first, so that a call failing part-way (one rank
        loaded a state, another raised) can be undone: the group is repaired and rolled back to it.
        """
        self._capture_state()
        with self._repairing():
            if rank is None:
                return self._group.execute(fn, *args)
            return self._group.execute_single(rank, fn, *args)

    @contextlib.contextmanager
    def _repairing(self) -> Iterator[None]:
        """Worker calls inside: on a failure the group is repaired (at its size, back to the last
        state) and the user's own exception is raised rather than its `WorkerError` wrapper."""
        try:
            yield
        except (WorkerError, WorkerDiedError) as exc:
            self._repair()
            if isinstance(exc, WorkerError) and isinstance(exc.__cause__, Exception):
                raise exc.__cause__ from exc
            raise

    def _repair(self) -> None:
        """After a failed non-train call: re-form the group at its size and restore the last state."""
        if not self._group.needs_recovery:
            return
        try:
            report = self._group.recover(max(1, self._world_size()))
            self._restore_after_resize(report)
        except Exception:  # the original error matters more; the next train() recovers again
            logger.warning("could not repair the worker group after a failed call", exc_info=True)

    def _capture_state(self) -> None:
        """Make `_last_state` current: rank 0's state, unless nothing changed since the last read."""
        if self._state_fresh:
            return
        try:
            if self._sharded is not None:
                self._sharded.capture(self._group)
            else:
                self._last_state = self._group.execute_single(0, worker.state_bytes)
                self._state_rank = 0
        except WorkerDiedError:
            self._recover_between_calls()
        self._state_fresh = True

    def _recover_between_calls(self) -> None:
        """Rank 0 was lost since the last call, with the state it held. Survivors hold the same
        state (DDP keeps replicas equal): re-form the group around them, read it from the new
        rank 0 (a survivor), then bring every worker to it."""
        self._restore_after_resize(self._group.recover(max(1, self._world_size())))

    def _load_bytes(self, data: bytes) -> None:
        # One object-store copy for all workers instead of one serialisation per worker.
        self._state_rank = None  # until every rank has loaded it
        self._call(worker.load_state, ray.put(data))
        if self._sharded is not None:
            self._state_fresh = False  # each worker kept only its part: snapshot again
            self._capture_state()
        else:
            # No rank kept `data` (a sharded run would not want it kept whole): a restore before
            # the next snapshot ships it from here.
            self._last_state, self._state_fresh = data, True

    def _write_checkpoint(self, checkpoint: Union[str, os.PathLike]) -> str:
        """Write the current state (captured by the caller) to `checkpoint` or the auto path."""
        if checkpoint == "auto":
            if self._checkpoint_dir is None:
                self._checkpoint_dir = tempfile.mkdtemp(prefix="raysgd-checkpoints-")
                logger.info("checkpoint='auto' writes to %s", self._checkpoint_dir)
            name = AUTO_CHECKPOINT_NAME if self._sharded is None else AUTO_SHARDED_CHECKPOINT_NAME
            checkpoint = os.path.join(self._checkpoint_dir, name)
        if self._sharded is not None:
            return self._sharded.write(self._group, os.fspath(checkpoint))
        return write_file(checkpoint, self._last_state)

    def _results(self, kind: str, results: list[dict], reduce_results: bool) -> Any:
        reduced = reduce_worker_results(results) if reduce_results or self._tensorboard else None
        if self._tensorboard is not None:
            self._tensorboard.log(kind, reduced)
        return reduced if reduce_results else results
