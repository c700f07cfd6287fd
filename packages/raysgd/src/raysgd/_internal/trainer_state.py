"""The training state as the driver handles it: one interface, a replicated and a sharded kind.

The state lives on the workers (`worker`, `worker_sharded`). What the driver keeps of it, how it
brings every worker back to it after a resize, how it writes and reads checkpoints and what it falls
back on when the workers holding it are lost depends on how the strategy spreads it, and that is
decided once, at construction (`training_state`):

- `ReplicatedState` (``ddp``, ``none``): every worker holds the whole state. After a resize
  `plan_restore` picks the clean worker furthest along, which sends its state to the others over
  the process group. When no worker holds one, the newest of the driver's bounded copy
  (`DriverCopy`, refreshed after `train()` calls) and the last checkpoint file written or loaded.
  A checkpoint is one file, written by a worker on the driver's node.
- `ShardedState` (``fsdp``): each worker holds its part. The workers snapshot their parts with a
  copy on a peer (`worker_sharded`); a restore takes the newest snapshot whose every part
  survived, else the last checkpoint directory (`sharded_state.ShardedSnapshots`). A checkpoint is
  a directory, one file per worker; `state_dict()` gathers it into the driver.

Either kind loads either kind of checkpoint: a file (or a `state_dict()` of a replicated trainer)
is loaded whole into every worker, which shards it when its strategy does; a directory (or a
gathered sharded `state_dict()`) is resharded to the group's size. The trainer calls these methods
and never asks which kind it has; every worker call goes through `WorkerCalls` (repaired through
the recovery loop, user errors in one form), except inside `restore` and `prepare_leaving`,
which run within the recovery loop itself.
"""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Optional, Union

import ray

from raysgd._internal import worker
from raysgd._internal.checkpoint import read_file, state_from_bytes, state_to_bytes, write_file
from raysgd._internal.driver import WorkerCalls
from raysgd._internal.driver_copy import DriverCopy
from raysgd._internal.restore_plan import RestoreOutcome, StateLostError, plan_restore
from raysgd._internal.sharded_state import (
    GATHERED_FORMAT,
    ShardedSnapshots,
    is_sharded_checkpoint,
)
from raysgd_core import WorkerError

__all__ = [
    "AUTO_CHECKPOINT_NAME",
    "AUTO_SHARDED_CHECKPOINT_NAME",
    "ReplicatedState",
    "ShardedState",
    "TrainingState",
    "training_state",
]

logger = logging.getLogger("raysgd")

PathLike = Union[str, "os.PathLike[str]"]

#: File name of the `checkpoint="auto"` state inside `checkpoint_dir`.
AUTO_CHECKPOINT_NAME = "raysgd_checkpoint.pt"
#: Directory name of the `checkpoint="auto"` state with a sharded strategy.
AUTO_SHARDED_CHECKPOINT_NAME = "raysgd_checkpoint"


class TrainingState(abc.ABC):
    """The driver's handling of the training state (see the module docstring).

    Attributes:
        step: The step the workers finished last, as far as the driver knows (from the last
            `train()` results, restore or load).
    """

    #: Name of the `train(checkpoint="auto")` checkpoint inside `checkpoint_dir`.
    checkpoint_name: ClassVar[str]

    def __init__(self) -> None:
        self.step = 0

    @property
    def copy_limit_bytes(self) -> int:
        """The largest state the workers offer the driver a copy of (0: no copy is kept)."""
        return 0

    @abc.abstractmethod
    def started(self, workers: WorkerCalls, first: Optional[tuple[Optional[bytes], int]]) -> None:
        """Every runner was just built; `first` is rank 0's answer to `worker.create_runner`."""

    @abc.abstractmethod
    def restore(self, workers: WorkerCalls) -> RestoreOutcome:
        """After a resize (the recovery loop's restore seam): bring every worker of the
        re-formed group to the newest state some worker (or, failing that, a fallback) holds,
        at the position and in the call it belongs to. `StateLostError` when there is none."""

    @abc.abstractmethod
    def save(self, workers: WorkerCalls, path: PathLike) -> str:
        """Write the current state to `path`; returns the absolute path."""

    @abc.abstractmethod
    def state_dict(self, workers: WorkerCalls) -> dict[str, Any]:
        """The whole state in this process."""

    def load(self, workers: WorkerCalls, path: PathLike) -> None:
        """Load a checkpoint file or directory into every worker. A file that is not a
        checkpoint raises ValueError before any worker is touched."""
        path = os.fspath(path)
        if is_sharded_checkpoint(path):
            try:
                self._load_sharded(workers, lambda view: view.load(workers.group, path))
            except WorkerError as exc:
                if isinstance(exc.__cause__, ValueError):
                    # A data file the workers found bad is the input's fault, as a bad file
                    # found here is: its one line, chained to the workers' report.
                    raise exc.__cause__ from exc
                raise
            return
        data, state = read_file(path)
        self._load_bytes(workers, data, state, path)

    def load_state_dict(self, workers: WorkerCalls, state: dict[str, Any]) -> None:
        """Load what `state_dict()` returned (of either kind) into every worker."""
        if state.get("format") == GATHERED_FORMAT:
            self._load_sharded(workers, lambda view: view.load_gathered(workers.group, state))
            return
        self._load_bytes(workers, state_to_bytes(state), state, None)

    @abc.abstractmethod
    def prepare_leaving(self, workers: WorkerCalls, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose (a preemption notice), with every
        worker at the same step boundary: the state of this boundary must then be restorable
        without them (by the workers that stay, or, when all leave, by replacements that join
        before they go)."""

    def after_train(self, workers: WorkerCalls, step: int) -> None:
        """A `train()` call finished with the workers at `step`."""
        self.step = step

    @abc.abstractmethod
    def require_whole_model(self) -> None:
        """Raise when no worker holds the whole model (`get_model()` cannot be answered)."""

    def _load_bytes(
        self,
        workers: WorkerCalls,
        data: bytes,
        state: dict[str, Any],
        path: Optional[str],
    ) -> None:
        """Load one serialised state into every worker (`path`: the file it came from)."""
        # One object-store copy for all workers instead of one serialisation per worker.
        workers.call(worker.load_state, ray.put(data))
        self.step = int(state.get("step", 0))
        self._loaded(workers, data, path)

    @abc.abstractmethod
    def _loaded(self, workers: WorkerCalls, data: bytes, path: Optional[str]) -> None:
        """After `_load_bytes`: what this kind keeps of the state just loaded."""

    @abc.abstractmethod
    def _load_sharded(self, workers: WorkerCalls, load: Callable[[ShardedSnapshots], None]) -> None:
        """Run `load` (a checkpoint directory or a gathered state into every worker, resharded)
        with the `ShardedSnapshots` this kind uses for it."""


class ReplicatedState(TrainingState):
    """Every worker holds the whole state (``ddp``, ``none``).

    Args:
        copy: The driver's bounded copy (its limit 0: none is kept).
        use_local: Whether rank 0 runs in this process: then no copy is kept, since losing every
            worker means losing the driver too.
    """

    checkpoint_name = AUTO_CHECKPOINT_NAME

    def __init__(self, copy: DriverCopy, *, use_local: bool) -> None:
        super().__init__()
        self.copy = copy
        self._copy_wanted = copy.enabled and not use_local
        #: The last checkpoint file written or loaded, and the step it holds: a restore's fallback.
        self.last_checkpoint: Optional[tuple[str, int]] = None

    @property
    def copy_limit_bytes(self) -> int:
        return self.copy.limit_bytes if self._copy_wanted else 0

    def started(self, workers: WorkerCalls, first: Optional[tuple[Optional[bytes], int]]) -> None:
        if first is not None and self._copy_wanted:
            data, size = first
            self.copy.offer(data, size, step=0)

    def restore(self, workers: WorkerCalls) -> RestoreOutcome:
        """Every worker says how far it got; the clean one furthest along sends its state to
        the others that need it (replacements, workers behind it), everyone takes its place in the
        epoch (re-split over the new group) and the call it was in. Only when no worker holds a
        usable state does it come from the driver's copy or the last checkpoint."""
        group = workers.group
        plan = plan_restore(group.execute(worker.report_progress))
        fallback = None
        if plan.source is None:
            data, step, what = self._fallback(self.step)
            fallback = ray.put(data)
            # A lower bound: the steps the driver knows were finished since, plus the one in
            # flight; how far the interrupted call got died with its workers.
            outcome = RestoreOutcome(what, step, max(0, self.step - step) + 1)
            logger.warning(
                "no worker holds the training state any more: restoring %s; the interrupted "
                "call starts again from there (at least %d step(s) are done again)",
                what,
                outcome.steps_redone,
            )
        else:
            outcome = RestoreOutcome(
                f"rank {plan.source} at step {plan.step}", plan.step, plan.steps_redone
            )
        operator_ref, config, options, dataset_splits = workers.runner_args()
        group.execute(
            worker.restore_runner, operator_ref, config, options, plan, fallback, dataset_splits
        )
        self.step = outcome.step
        return outcome

    def _fallback(self, lost_at: int) -> tuple[bytes, int, str]:
        """(state bytes, step, description) of the newest of the driver's copy and the last
        checkpoint; `StateLostError` when there is neither."""
        self.copy.wait()
        options: list[tuple[int, str, Callable[[], bytes]]] = []
        copy = self.copy.latest()
        if copy is not None:
            data, step = copy
            options.append((step, f"the driver's copy at step {step}", lambda: data))
        if self.last_checkpoint is not None and os.path.exists(self.last_checkpoint[0]):
            path, step = self.last_checkpoint
            options.append((step, f"checkpoint {path} at step {step}", lambda: read_file(path)[0]))
        if not options:
            limit_mb = self.copy.limit_bytes / 2**20
            raise StateLostError(
                f"every worker holding the training state (at step {lost_at} or later) was "
                "lost at once, "
                "and there is nothing to restore it from: the driver keeps a copy only of states "
                f"up to state_copy_limit_mb={limit_mb:g} MB (and not with use_local=True or a "
                "sharded strategy), and no checkpoint was written. Write one regularly "
                "(train(checkpoint='auto') or save()), or raise state_copy_limit_mb."
            )
        step, what, read = max(options, key=lambda option: option[0])
        return read(), step, what

    def save(self, workers: WorkerCalls, path: PathLike) -> str:
        """One file, written by a worker that shares the file system of `path` with this process
        (on its node, or on a shared disk: the state does not pass through the driver), else
        through the driver."""
        path = os.path.abspath(os.fspath(path))
        rank = workers.writer_rank(os.path.dirname(path))
        if rank is not None:
            written = workers.read(worker.write_checkpoint, path, rank=rank)
            logger.debug("checkpoint %s written by rank %d", written, rank)
        else:
            written = write_file(path, workers.read(worker.state_bytes))
            logger.debug(
                "checkpoint %s written through the driver (no worker shares its disk)", written
            )
        self.last_checkpoint = (written, self.step)
        return written

    def state_dict(self, workers: WorkerCalls) -> dict[str, Any]:
        return state_from_bytes(workers.read(worker.state_bytes))

    def prepare_leaving(self, workers: WorkerCalls, leaving: Sequence[int]) -> None:
        """Nothing to hand over: the workers that stay hold the state whole."""

    def require_whole_model(self) -> None:
        """Every worker holds the whole model."""

    def after_train(self, workers: WorkerCalls, step: int) -> None:
        """Refresh the driver's copy when it is due (asynchronously: see `DriverCopy`)."""
        super().after_train(workers, step)
        if self._copy_wanted and self.copy.due():
            self.copy.refresh(
                workers.group.execute_single_async(0, worker.state_copy, self.copy.limit_bytes)
            )

    def _loaded(self, workers: WorkerCalls, data: bytes, path: Optional[str]) -> None:
        if self._copy_wanted:
            size = len(data)
            self.copy.offer(data if size <= self.copy.limit_bytes else None, size, self.step)
        if path is not None:
            self.last_checkpoint = (os.path.abspath(path), self.step)

    def _load_sharded(self, workers: WorkerCalls, load: Callable[[ShardedSnapshots], None]) -> None:
        # Through a view of its own: a replicated state keeps no snapshots.
        with workers.guarded():
            load(ShardedSnapshots())


class ShardedState(TrainingState):
    """Each worker holds its part of the state (``fsdp``); the driver keeps no copy."""

    checkpoint_name = AUTO_SHARDED_CHECKPOINT_NAME

    def __init__(self) -> None:
        super().__init__()
        self.snapshots = ShardedSnapshots()

    def started(self, workers: WorkerCalls, first: Optional[tuple[Optional[bytes], int]]) -> None:
        """Every worker keeps snapshots from now on; the first is taken at once."""
        self.snapshots.start(workers.group)

    def restore(self, workers: WorkerCalls) -> RestoreOutcome:
        """Every runner is rebuilt from the newest snapshot whose parts survived (the survivors'
        own and their peers' copies), resharded to the new size, else from the last checkpoint
        directory; the steps since are done again."""
        operator_ref, config, options, dataset_splits = workers.runner_args()
        step, reached, what = self.snapshots.restore(
            workers.group, operator_ref, config, options, dataset_splits
        )
        self.step = step
        return RestoreOutcome(what, step, reached - step)

    def save(self, workers: WorkerCalls, path: PathLike) -> str:
        """A checkpoint directory of a snapshot taken now (each worker writes its part)."""
        with workers.guarded():
            self.snapshots.capture(workers.group)
            return self.snapshots.write(workers.group, os.fspath(path))

    def state_dict(self, workers: WorkerCalls) -> dict[str, Any]:
        """Every worker's part comes to this process: what asking for the whole state means."""
        with workers.guarded():
            self.snapshots.capture(workers.group)
            return self.snapshots.gather(workers.group)

    def prepare_leaving(self, workers: WorkerCalls, leaving: Sequence[int]) -> None:
        """The leaving workers' parts go to workers that stay."""
        self.snapshots.hand_over(workers.group, leaving)

    def require_whole_model(self) -> None:
        raise NotImplementedError(
            "get_model() with a sharded strategy: no worker holds the whole model. save() a "
            "checkpoint and load it into a TorchTrainer(strategy='none'), or use "
            "apply_all_operators"
        )

    def _loaded(self, workers: WorkerCalls, data: bytes, path: Optional[str]) -> None:
        # The loaded state is the newest snapshot from now on (with its copies on the peers).
        with workers.guarded():
            self.snapshots.capture(workers.group)

    def _load_sharded(self, workers: WorkerCalls, load: Callable[[ShardedSnapshots], None]) -> None:
        with workers.guarded():
            # A load that fails leaves the group to be repaired from a snapshot: this one, so
            # that the trainer goes on from its state now, not from an older snapshot.
            self.snapshots.capture(workers.group)
            load(self.snapshots)
            self.snapshots.capture(workers.group)


def training_state(sharded: bool, *, copy_limit_bytes: int, use_local: bool) -> TrainingState:
    """The kind of state a trainer with a sharded (or replicated) strategy has."""
    if sharded:
        return ShardedState()
    return ReplicatedState(DriverCopy(copy_limit_bytes), use_local=use_local)
