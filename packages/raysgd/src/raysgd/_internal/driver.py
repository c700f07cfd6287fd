"""The driver side of a `TorchTrainer`: its workers, their runners, and recovery's seam.

`TorchTrainer` inherits from `TrainerDriver`, which keeps the plumbing out of the public class: starting
the group and the per-worker runners, calling functions on the workers with typed errors, the
seam the recovery loop uses after a resize, and checkpoint files. The training state stays on the
workers (see `raysgd._internal.worker`); the driver only keeps a bounded copy of a small
replicated one (`DriverCopy`) and the path of the last checkpoint, as fallbacks for the day every
worker is lost at once. Attributes are set by `TorchTrainer.__init__` (see there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional, TypeVar, Union

import ray

from raysgd._internal import worker
from raysgd._internal.checkpoint import read_file, state_from_bytes, write_file
from raysgd._internal.datasets import DatasetSplitter
from raysgd._internal.driver_copy import DriverCopy
from raysgd._internal.restore_plan import RestoreOutcome, StateLostError, plan_restore
from raysgd._internal.run_loggers import RunLoggers
from raysgd._internal.sharded_state import ShardedState
from raysgd_core import WorkerDiedError, WorkerError, WorkerGroup, draining_nodes
from raysgd_operator import (
    BATCH_SIZE,
    NUM_SAMPLES,
    TrainingOptions,
    reduce_worker_results,
    split_batch_size,
)

__all__ = ["AUTO_CHECKPOINT_NAME", "TrainerDriver"]

logger = logging.getLogger("raysgd")

T = TypeVar("T")

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
    _loggers: RunLoggers
    _recovery: Any
    _preemption: Any  # `raysgd._internal.preemption.Preemption`
    # With a sharded strategy (fsdp) the state lives on the workers; this is the driver's view.
    _sharded: Optional[ShardedState] = None
    # The bounded copy of a replicated state (see `DriverCopy`).
    _copy: DriverCopy
    # The last checkpoint file written or loaded, and the step it holds: a restore's fallback.
    _last_checkpoint: Optional[tuple[str, int]] = None
    # The step the workers finished last (from the last train() results).
    _step: int = 0
    # Names each train() call, so that a call a failure interrupted is continued, not started again.
    _call_id: int = 0
    _shut_down: bool = False

    # ----------------------------------------------------------------------------------- set-up
    def _start_workers(self) -> None:
        """Start the group and build every worker's runner; on any error release everything."""
        started = time.monotonic()
        try:
            self._group.start()
            group_ready = time.monotonic()
            worker_config = self._split_config(self._world_size())
            first = self._group.execute(
                worker.create_runner,
                self._operator_ref,
                worker_config,
                self._options,
                self._copy.limit_bytes if self._copy_wanted() else 0,
                self._datasets.split(self._world_size()),
            )[0]
            if self._sharded is not None:
                self._sharded.start(self._group)
        except BaseException as exc:
            self._group.shutdown()
            self._shut_down = True
            self._loggers.finish()
            if isinstance(exc, WorkerError) and isinstance(exc.__cause__, (ValueError, TypeError)):
                # A bad creator or operator set-up is the user's input error: raise it as its own
                # type, chained to the WorkerError that holds the worker's traceback (the cause's
                # own frames do not survive the trip back from the worker).
                raise exc.__cause__ from exc
            raise
        if first is not None and self._copy_wanted():
            data, size = first
            self._copy.offer(data, size, step=0)
        done = time.monotonic()
        logger.debug(
            "trainer ready in %.2fs (workers %.2fs, operator set-up %.2fs)",
            done - started,
            group_ready - started,
            done - group_ready,
        )

    def _copy_wanted(self) -> bool:
        # With use_local rank 0 lives in this process: losing every worker means losing the
        # driver too, so a copy here could never be used. A sharded state is never copied.
        return self._copy.enabled and self._sharded is None and not self._use_local

    def _split_config(self, size: int) -> dict[str, Any]:
        """Each worker's config for a group of `size`; updates `config[BATCH_SIZE]` (rounded)."""
        worker_config, global_batch = split_batch_size(self._user_config, size)
        if global_batch is not None:
            self._config[BATCH_SIZE] = global_batch
        return worker_config

    def _world_size(self) -> int:
        return int(self._group.world_size)

    def _restore_after_resize(self, report: Any = None) -> RestoreOutcome:
        """Seam for the recovery loop: make every worker of the re-formed group ready to train.

        Every worker says how far it got; the clean one furthest along sends its state to the
        others that need it (replacements, workers behind it), everyone takes its place in the
        epoch (re-split over the new group) and the call it was in. Only when no worker holds a
        usable state does the state come from the driver's copy or the last checkpoint
        (`StateLostError` when there is neither).
        """
        if self._sharded is not None:
            return self._restore_sharded()
        progress = self._group.execute(worker.report_progress)
        plan = plan_restore(progress)
        fallback = None
        if plan.source is None:
            data, step, what = self._fallback_state(self._step)
            fallback = ray.put(data)
            outcome = RestoreOutcome(what, step, max(0, self._step - step) + 1)
            logger.warning(
                "no worker holds the training state any more: restoring %s; the steps since "
                "(about %d) are done again",
                what,
                outcome.steps_redone,
            )
        else:
            outcome = RestoreOutcome(
                f"rank {plan.source} at step {plan.step}", plan.step, plan.steps_redone
            )
        self._group.execute(
            worker.restore_runner,
            self._operator_ref,
            self._split_config(self._world_size()),
            self._options,
            plan,
            fallback,
            # A split belongs to the group it was made for: the new group reads a new one.
            self._datasets.split(self._world_size()),
        )
        self._step = outcome.step
        return outcome

    def _fallback_state(self, lost_at: int) -> tuple[bytes, int, str]:
        """(state bytes, step, description) of the newest of the driver's copy and the last
        checkpoint; `StateLostError` when there is neither."""
        self._copy.wait()
        options: list[tuple[int, str, Callable[[], bytes]]] = []
        copy = self._copy.latest()
        if copy is not None:
            data, step = copy
            options.append((step, f"the driver's copy at step {step}", lambda: data))
        if self._last_checkpoint is not None and os.path.exists(self._last_checkpoint[0]):
            path, step = self._last_checkpoint
            options.append((step, f"checkpoint {path} at step {step}", lambda: read_file(path)[0]))
        if not options:
            limit_mb = self._copy.limit_bytes / 2**20
            raise StateLostError(
                f"every worker holding the training state (at step {lost_at}) was lost at once, "
                "and there is nothing to restore it from: the driver keeps a copy only of states "
                f"up to state_copy_limit_mb={limit_mb:g} MB (and not with use_local=True or a "
                "sharded strategy), and no checkpoint was written. Write one regularly "
                "(train(checkpoint='auto') or save()), or raise state_copy_limit_mb."
            )
        step, what, read = max(options, key=lambda option: option[0])
        return read(), step, what

    def _restore_sharded(self) -> RestoreOutcome:
        """`_restore_after_resize` for sharded strategies: every runner is rebuilt from the newest
        snapshot whose parts survived (the survivors' own and their peers' copies), resharded to
        the new size; the steps since that snapshot are done again."""
        assert self._sharded is not None
        step, reached, what = self._sharded.restore(
            self._group,
            self._operator_ref,
            self._split_config(self._world_size()),
            self._options,
            self._datasets.split(self._world_size()),
        )
        self._step = step
        return RestoreOutcome(what, step, reached - step)

    def _move_off_draining(self, max_retries: int) -> None:
        """Act on preemption notices for the group's nodes (see `Preemption`). A move that fails
        (the node went first) leaves the group to the recovery loop, as after any loss."""
        try:
            self._preemption.handle(max_retries=max_retries)
        except StateLostError:
            raise
        except Exception:
            logger.warning(
                "moving off a draining node failed; its loss is recovered like any other",
                exc_info=True,
            )
            # Not again for these nodes in this run: the next attempt must not stop for them.
            self._preemption.unmovable |= set(draining_nodes())

    def _prepare_leaving(self, leaving: list[int]) -> None:
        """Before workers leave on purpose: a sharded state gives their parts to workers that
        stay (a replicated one needs nothing: the others hold it whole)."""
        if self._sharded is not None:
            self._sharded.hand_over(self._group, leaving)

    def _checkpoint_at_notice(self) -> Optional[str]:
        """A checkpoint written now, when rank 0 cannot leave a draining node (use_local)."""
        if self._checkpoint_dir is None:
            return None
        return self._write_checkpoint("auto")

    def _sharded_view(self) -> ShardedState:
        # A ddp/none trainer loads sharded checkpoints too, through a throw-away view.
        return self._sharded if self._sharded is not None else ShardedState()

    def _load_sharded(self, load: Callable[[], None]) -> None:
        with self._repairing():
            if self._sharded is not None:
                # A load that fails leaves the group to be repaired from a snapshot: this one,
                # so that the trainer goes on from its state now, not from an older snapshot.
                self._sharded.capture(self._group)
            load()
            if self._sharded is not None:
                self._sharded.capture(self._group)

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
            self._loggers.finish(self._recovery.events)

    # ------------------------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("This TorchTrainer has been shut down; create a new one.")

    def _call(self, fn: Callable[..., Any], *args: Any, rank: Optional[int] = None) -> Any:
        """`fn(*args)` on every worker (or on `rank`); a user exception comes back as its own type.

        A worker lost meanwhile is replaced (the group re-formed at its size, the state restored
        from the survivors) and the error raised; `_read` retries reads instead.
        """
        with self._repairing():
            if rank is None:
                return self._group.execute(fn, *args)
            return self._group.execute_single(rank, fn, *args)

    def _read(self, fn: Callable[..., T], *args: Any, rank: int = 0) -> T:
        """`fn(*args)` on `rank` for something the user asked to read (the state, the model): a
        worker lost since the last call is replaced first, and the read done again once."""
        try:
            return self._call(fn, *args, rank=rank)
        except WorkerDiedError:
            return self._call(fn, *args, rank=rank)

    @contextlib.contextmanager
    def _repairing(self) -> Iterator[None]:
        """Worker calls inside: on a failure the group is repaired (at its size, the state taken
        from the survivors) and the user's own exception is raised rather than its `WorkerError`
        wrapper."""
        if self._group.needs_recovery:
            self._repair()
        try:
            yield
        except (WorkerError, WorkerDiedError) as exc:
            self._repair()
            if isinstance(exc, WorkerError) and isinstance(exc.__cause__, Exception):
                raise exc.__cause__ from exc
            raise

    def _repair(self) -> None:
        """After a failed non-train call: re-form the group at its size and restore the state."""
        if not self._group.needs_recovery:
            return
        try:
            report = self._group.recover(max(1, self._world_size()))
            self._restore_after_resize(report)
        except StateLostError:
            raise
        except Exception:  # the original error matters more; the next train() recovers again
            logger.warning("could not repair the worker group after a failed call", exc_info=True)

    def _writer_rank(self) -> Optional[int]:
        """A rank on this process's node, which can write a file the driver sees (rank 0 first)."""
        here = ray.get_runtime_context().get_node_id()
        for info in self._group.workers:
            if info.node_id == here:
                return info.rank
        return None

    def _write_state(self, path: Union[str, os.PathLike]) -> str:
        """Write the replicated state to `path`: by a worker on this node (the state does not pass
        through the driver), else through the driver."""
        path = os.path.abspath(os.fspath(path))
        rank = self._writer_rank()
        if rank is not None:
            written = self._read(worker.write_checkpoint, path, rank=rank)
        else:
            written = write_file(path, self._read(worker.state_bytes))
        self._last_checkpoint = (written, self._step)
        return written

    def _load_bytes(self, data: bytes, path: Optional[str] = None) -> None:
        # One object-store copy for all workers instead of one serialisation per worker.
        self._call(worker.load_state, ray.put(data))
        state = state_from_bytes(data)
        self._step = int(state.get("step", 0))
        if self._sharded is not None:
            self._sharded.capture(self._group)
        elif self._copy_wanted():
            size = len(data)
            self._copy.offer(data if size <= self._copy.limit_bytes else None, size, self._step)
        if path is not None:
            self._last_checkpoint = (os.path.abspath(path), self._step)

    def _save_to(self, path: Union[str, os.PathLike]) -> str:
        """Write the current state to `path` (a file, or a directory for a sharded state)."""
        if self._sharded is not None:
            with self._repairing():
                self._sharded.capture(self._group)
                return self._sharded.write(self._group, os.fspath(path))
        return self._write_state(path)

    def _write_checkpoint(self, checkpoint: Union[str, os.PathLike]) -> str:
        """Write the current state to `checkpoint` or the auto path."""
        if checkpoint == "auto":
            if self._checkpoint_dir is None:
                self._checkpoint_dir = tempfile.mkdtemp(prefix="raysgd-checkpoints-")
                logger.info("checkpoint='auto' writes to %s", self._checkpoint_dir)
            name = AUTO_CHECKPOINT_NAME if self._sharded is None else AUTO_SHARDED_CHECKPOINT_NAME
            checkpoint = os.path.join(self._checkpoint_dir, name)
        return self._save_to(checkpoint)

    def _train_results(self, returned: list[tuple[dict, int, Optional[int], bool]]) -> list[dict]:
        """The metrics of `worker.train_epoch`'s answers; notes the step the workers reached."""
        self._step = max(answer[1] for answer in returned)
        return [answer[0] for answer in returned]

    def _results(
        self, kind: str, results: list[dict], reduce_results: bool, call_rows: Optional[int] = None
    ) -> Any:
        reduced = reduce_worker_results(results) if reduce_results or self._loggers else None
        if reduced is not None and call_rows is not None:
            # A call that went on after a recovery knows the rows the whole group trained in it,
            # those of workers lost meanwhile included: that is the call's num_samples.
            reduced[NUM_SAMPLES] = call_rows
        if self._loggers:
            self._loggers.log(
                kind, reduced, num_workers=self._world_size(), events=self._recovery.events
            )
        return reduced if reduce_results else results
