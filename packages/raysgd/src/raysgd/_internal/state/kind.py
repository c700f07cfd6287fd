"""The interface of a kind of training state: what the driver asks of it, and its workers' half.

A replicated strategy (``ddp``, ``none``) leaves the whole state on every worker; a sharded one
(``fsdp``) leaves a part on each, with in-memory snapshots of its own part and a peer's. Each kind
is one module with both halves (`replicated`, `sharded`): the driver's, behind `StateKind` (how a
restore is planned, what settles the workers once their state changed as a whole, how a
checkpoint is written, read and the state gathered into one process, how a move hands the state
over, what a fall-back says), and the workers', the `worker.state.WorkerState` class it names
(`StateKind.worker_class`), which the driver hands to every worker it starts or restores. The
driver's `TrainingState` holds one kind (`pick.kind_for`) and asks no question about it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Optional, Protocol

from raysgd._internal.protocol import Holding, LoadSource, RestorePlan
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.state import WorkerState
from raysgd_core import WorkerGroup

__all__ = ["StateKind", "Workers"]


class Workers(Protocol):
    """What a kind needs of the driver's workers (the driver's `worker_calls.WorkerCalls`): the
    group, and where a file can be written."""

    group: WorkerGroup

    def writer_rank(self, directory: str) -> Optional[int]:
        """A rank that can write a file into `directory`, which the driver sees; None if none
        can."""


class StateKind(abc.ABC):
    """What the driver does with one kind of state (see the module docstring)."""

    #: The workers' half: what each worker holds of this kind of state, and how it moves.
    worker_class: ClassVar[type[WorkerState]]
    #: Name of the `train(checkpoint="auto")` checkpoint inside `checkpoint_dir`.
    checkpoint_name: str
    #: Whether the driver may keep a bounded copy of the state (`DriverCopy`).
    keeps_driver_copy: bool
    #: Modules a spare imports while it waits, so that taking a lost worker's place is quick.
    spare_imports: tuple[str, ...] = ()
    #: Whether `get_model()` gathers every worker's part into new whole models (a collective)
    #: instead of reading rank 0's.
    gathers_models: bool = False

    @abc.abstractmethod
    def plan(
        self, holdings: Sequence[Holding], world_size: int, rank_sources: Sequence[Optional[int]]
    ) -> RestorePlan:
        """How a group of `world_size` is restored from what its workers hold (the plan's
        `found` is False when none of them holds a usable state); `rank_sources`: whose slot
        each rank takes (`RestorePlan.rank_sources`)."""

    @abc.abstractmethod
    def settle(self, workers: Workers) -> None:
        """The workers' state just changed as a whole (they started, restored or loaded)."""

    @abc.abstractmethod
    def save(self, workers: Workers, location: Storage, step: int) -> str:
        """Write a checkpoint of the workers at `step` to `location`; where it is (an absolute
        path for a local one)."""

    @abc.abstractmethod
    def gather(self, workers: Workers, step: int) -> dict[str, Any]:
        """The whole state in the driver's process (`TorchTrainer.state_dict`)."""

    @abc.abstractmethod
    def hand_over(self, workers: Workers, leaving: Sequence[int]) -> None:
        """With every worker at the same step boundary, make this boundary's state restorable
        without the workers of `leaving` (empty: spares are about to join)."""

    @abc.abstractmethod
    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        """The warning when the state comes back from `what` (a copy, a checkpoint) because no
        worker holds it any more."""

    @classmethod
    @abc.abstractmethod
    def source_at(cls, location: Storage, reachable: bool) -> LoadSource:
        """What the workers load the checkpoint of this kind's format at `location` from: the
        location itself when `reachable` (every worker can read it), else its bytes through the
        object store."""

    @classmethod
    @abc.abstractmethod
    def state_source(
        cls, state: Mapping[str, Any], reachable: bool
    ) -> AbstractContextManager[tuple[LoadSource, Optional[bytes]]]:
        """What the workers load a `TorchTrainer.state_dict()` of this kind's format from, while
        the context lasts (`reachable`: whether every worker sees this process's local disk), and
        the state's bytes when the driver may keep them as its copy (a whole state's; else
        None)."""

    def copy_source(self, data: bytes) -> LoadSource:
        """What the workers load the driver's bounded copy (`DriverCopy`) from; only kinds that
        keep one (`keeps_driver_copy`) are asked."""
        raise NotImplementedError(f"{type(self).__name__} keeps no copy on the driver")
