"""The driver's side of each kind of training state a strategy gives its workers.

A replicated strategy (``ddp``, ``none``) leaves the whole state on every worker; a sharded one
(``fsdp``) leaves a part on each, with in-memory snapshots of its own part and a peer's. All that
the driver does differently for the two lives here, behind `StateKind`: how a restore is planned,
what settles the workers once their state changed as a whole, how a checkpoint is written and
the state gathered into one process, how a move hands the state over, and what a fall-back on a
checkpoint says. `TrainingState` holds one kind (`for_options` picks it from the strategy) and
asks no question about it. The workers' side of the same split is `worker.replicated` and
`worker.sharded`.
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import ray

from raysgd._internal.driver.restore_plan import (
    missing_parts,
    plan_from_peers,
    plan_from_snapshots,
)
from raysgd._internal.driver.worker_calls import WorkerCalls
from raysgd._internal.protocol import Holding, RestorePlan
from raysgd._internal.storage.atomic_files import write_file
from raysgd._internal.storage.format import (
    AUTO_NAMES,
    MANIFEST_NAME,
    SHARDED,
    WHOLE,
    gathered,
    state_from_bytes,
    write_manifest,
)
from raysgd._internal.storage.location import Storage, as_storage
from raysgd._internal.worker import calls as worker
from raysgd_core import WorkerGroup
from raysgd_operator import SHARDED_STATE_IMPORTS, TrainingOptions

__all__ = [
    "Replicated",
    "Sharded",
    "StateKind",
    "for_options",
]

logger = logging.getLogger("raysgd")


class StateKind(abc.ABC):
    """What the driver does with one kind of state (see the module docstring)."""

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
    def settle(self, group: WorkerGroup) -> None:
        """The workers' state just changed as a whole (they started, restored or loaded)."""

    @abc.abstractmethod
    def save(self, workers: WorkerCalls, location: Storage, step: int) -> str:
        """Write a checkpoint of the workers at `step` to `location`; where it is (an absolute
        path for a local one)."""

    @abc.abstractmethod
    def gather(self, workers: WorkerCalls, step: int) -> dict[str, Any]:
        """The whole state in the driver's process (`TorchTrainer.state_dict`)."""

    @abc.abstractmethod
    def hand_over(self, group: WorkerGroup, leaving: Sequence[int]) -> None:
        """With every worker at the same step boundary, make this boundary's state restorable
        without the workers of `leaving` (empty: spares are about to join)."""

    @abc.abstractmethod
    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        """The warning when the state comes back from `what` (a copy, a checkpoint) because no
        worker holds it any more."""


class Replicated(StateKind):
    """Every worker holds the whole state: a survivor has all of it, a checkpoint is one file."""

    checkpoint_name = AUTO_NAMES[WHOLE]
    keeps_driver_copy = True

    def plan(
        self, holdings: Sequence[Holding], world_size: int, rank_sources: Sequence[Optional[int]]
    ) -> RestorePlan:
        return plan_from_peers(holdings, rank_sources)

    def settle(self, group: WorkerGroup) -> None:
        # Every worker holds the models and optimizers whole; what differs from rank to rank is
        # given to the ring peer now, so that a loss before the next window start finds it.
        group.execute(worker.replicate_slots)

    def save(self, workers: WorkerCalls, location: Storage, step: int) -> str:
        """One file, written by a worker that can reach it (an object store; the local disk of
        a worker on this node or of one that shares it), else through the driver."""
        group = workers.group
        if not location.is_local:
            group.execute(worker.save_file, location, 0)
            return location.url
        path = location.path
        rank = workers.writer_rank(os.path.dirname(path))
        if rank is not None:
            group.execute(worker.save_file, location, rank)
            logger.debug("checkpoint %s written by rank %d", path, rank)
        else:
            write_file(path, group.execute(worker.state_bytes)[0])
            logger.debug(
                "checkpoint %s written through the driver (no worker shares its disk)", path
            )
        return path

    def gather(self, workers: WorkerCalls, step: int) -> dict[str, Any]:
        return state_from_bytes(workers.group.execute(worker.state_bytes)[0])

    def hand_over(self, group: WorkerGroup, leaving: Sequence[int]) -> None:
        # The workers that stay hold the models and optimizers of this boundary already; each
        # leaving worker gives its slot (generators, per-rank state) to one that stays.
        if leaving:
            group.execute(worker.hand_over_slots, list(leaving))

    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        return (
            f"no worker holds the training state any more: restoring {what}; the interrupted "
            f"call starts again from there (at least {redone} step(s) are done again)"
        )


class Sharded(StateKind):
    """Each worker holds its part, with snapshots of its own and a peer's: a restore takes the
    newest snapshot whose every part survived, a checkpoint is a folder of every worker's part
    with a manifest."""

    checkpoint_name = AUTO_NAMES[SHARDED]
    # Never in one place: a copy would have to gather every part.
    keeps_driver_copy = False
    spare_imports = SHARDED_STATE_IMPORTS
    gathers_models = True

    def plan(
        self, holdings: Sequence[Holding], world_size: int, rank_sources: Sequence[Optional[int]]
    ) -> RestorePlan:
        return replace(plan_from_snapshots(holdings, world_size), rank_sources=tuple(rank_sources))

    def settle(self, group: WorkerGroup) -> None:
        # A new snapshot in the new layout: every part has a copy on a peer again.
        group.execute(worker.capture)

    def save(self, workers: WorkerCalls, location: Storage, step: int) -> str:
        """A folder: on the local disk written beside it and renamed into place (an older
        checkpoint there is replaced only then); on an object store its old manifest goes first,
        so that a write cut short leaves no torn checkpoint."""
        epoch = _epoch(workers)
        if not location.is_local:
            location.remove(MANIFEST_NAME)
            _write_parts(workers, location)
            write_manifest(location, SHARDED, epoch, step)
            return location.url
        path = location.path
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".raysgd-ckpt-", dir=parent)
        try:
            folder = as_storage(tmp)
            _write_parts(workers, folder)
            write_manifest(folder, SHARDED, epoch, step)
            _replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def gather(self, workers: WorkerCalls, step: int) -> dict[str, Any]:
        """The checkpoint folder's files as bytes (`storage.format.gathered`)."""
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            folder = as_storage(os.path.join(tmp, "state"))
            os.makedirs(folder.path)
            _write_parts(workers, folder)
            write_manifest(folder, SHARDED, _epoch(workers), step)
            files = {name: folder.read_bytes(name) for name in folder.listdir()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return gathered(files)

    def hand_over(self, group: WorkerGroup, leaving: Sequence[int]) -> None:
        """A snapshot now, and each leaving worker's part given to a worker that stays. When
        every worker leaves, the snapshot is all: the replacements that join first restore
        from it."""
        step = group.execute(worker.capture)[0]
        staying = [r for r in range(group.world_size) if r not in set(leaving)]
        if not staying or not leaving:
            return
        holdings = group.execute(worker.holding)
        moves: list[tuple[int, int, int]] = []
        for i, part in enumerate(sorted(set(leaving))):
            holder = next(
                (
                    rank
                    for rank, holding in enumerate(holdings)
                    if any(h.step == step and part in h.parts for h in holding.snapshots)
                ),
                None,
            )
            if holder is not None:
                moves.append((part, holder, staying[i % len(staying)]))
        # Every worker takes part: the holders send, the staying workers receive.
        group.execute(worker.adopt_parts, step, moves)

    def fallback_warning(self, what: str, redone: int, holdings: Sequence[Holding]) -> str:
        missing = missing_parts(holdings)
        lost = (
            f"the in-memory parts of worker(s) {missing} were lost together with their replicas"
            if missing
            else "every worker that held an in-memory snapshot was lost"
        )
        return f"{lost}: restoring the last {what} (work since then is redone)"


def for_options(options: TrainingOptions) -> StateKind:
    """The kind of state the options' strategy gives its workers."""
    return Sharded() if options.sharded else Replicated()


def _epoch(workers: WorkerCalls) -> int:
    return int(workers.group.execute_single(0, worker.epoch))


def _write_parts(workers: WorkerCalls, folder: Storage) -> None:
    """Every worker writes its part into `folder` (a collective); the parts of workers that
    cannot reach a local folder come through the object store and are written here."""
    for shipped in workers.group.execute(worker.save, folder):
        if shipped:
            bundles: dict[int, dict[str, bytes]] = {}
            for name, ref in shipped.items():
                data = bundles.setdefault(id(ref), ray.get(ref))[name]
                folder.write_bytes(name, data)


def _replace_dir(tmp: str, path: str) -> None:
    """Move the finished folder `tmp` to `path`; an older checkpoint there is replaced only now."""
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    old = tempfile.mkdtemp(prefix=".raysgd-old-", dir=os.path.dirname(path))
    os.rmdir(old)
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)
