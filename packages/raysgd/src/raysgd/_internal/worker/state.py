"""What one worker holds of the training state, and how it moves: one interface, chosen by the
strategy.

- `ReplicatedState` (``ddp``, ``none``; `worker.replicated`): every worker holds the whole state.
  After a resize the survivor furthest along sends it to the workers that need it.
- `ShardedState` (``fsdp``; `worker.sharded`): each worker holds its part of the model and
  optimizers, and keeps in-memory snapshots (tensors) of its part and of a peer's. After a resize
  every worker is rebuilt from the newest snapshot whose every part survived.

Every method runs on a worker; the driver's `training_state.TrainingState` decides (with the pure
planners of `driver.restore_plan`) and calls them through `calls`, which picks the kind
(`worker.state_class`). Loading a checkpoint (`load_into`)
is the same for both: a whole state loads into any strategy, a sharded folder into any strategy
and size (DCP reshards it).
"""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Callable, ClassVar, Optional

import ray

from raysgd._internal.protocol import Holding, LoadSource, RestorePlan, RunnerArgs
from raysgd._internal.storage.format import METADATA_FILE, state_from_bytes, state_to_bytes
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.transfer import flatten
from raysgd_core import get_context, scratch_dir
from raysgd_operator import OperatorRunner

__all__ = [
    "RANK_SLOTS",
    "HostCopy",
    "WorkerState",
    "apply_rank_slot",
    "gather_rank_slots",
    "load_into",
    "state_within",
]

#: Where a saved state keeps what differs from rank to rank (`OperatorRunner.rank_slot`: the
#: operator's per-rank state, the random generators, the loader's seed of the epoch), in rank
#: order.
RANK_SLOTS = "rank_slots"
#: Where states written before the generators were kept per rank held the operator's per-rank
#: states alone.
_RANK_STATES = "rank_states"


class HostCopy(abc.ABC):
    """A worker's part of the state, copied to host memory (`WorkerState.copy_to_host`)."""

    @abc.abstractmethod
    def write(self, folder: Storage) -> None:
        """Write the part into the checkpoint `folder` (in a background thread)."""


class WorkerState(abc.ABC):
    """What this worker holds of the training state (see the module docstring).

    Args:
        runner: The worker's runner, whose models, optimizers and position are the state.
    """

    #: The checkpoint kind `save` writes into a folder (`storage.format.WHOLE` or `SHARDED`).
    kind: ClassVar[str]

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner

    @abc.abstractmethod
    def holding(self) -> Holding:
        """What this worker holds, for the restore planner (asked after a resize)."""

    @classmethod
    @abc.abstractmethod
    def restore(cls, args: RunnerArgs, plan: RestorePlan) -> WorkerState:
        """After a resize: make this worker's runner (kept, re-bound or built from `args`) hold
        the state `plan` says, at its position and in the call it belongs to (a collective)."""

    @abc.abstractmethod
    def save(self, folder: Storage) -> Optional[dict[str, Any]]:
        """Write this worker's part of the state now into the checkpoint `folder` (a collective
        for a sharded state). Returns the files this worker could not reach the folder with,
        for the driver to write (``{name: ObjectRef of {name: bytes}}``), else None."""

    @abc.abstractmethod
    def copy_to_host(self) -> Optional[HostCopy]:
        """Copy this worker's part of the state now to host memory, for a checkpoint written in
        the background (the training loop waits only for this); None when this worker writes no
        part. The copy may reuse the memory of this worker's previous one: copy again only once
        that one was written."""

    def prepare_host_copy(self) -> Optional[Callable[[], None]]:
        """Work that makes the first `copy_to_host` as quick as later ones (allocating the host memory it
        copies into), to run in a background thread before that checkpoint falls due; None when
        there is none. Called on the training thread between steps."""
        return None

    @classmethod
    @abc.abstractmethod
    def parts(cls, world_size: int) -> list[str]:
        """The files of a checkpoint folder of this kind written by `world_size` workers."""

    def adopt_parts(self, step: int, moves: Sequence[tuple[int, int, int]]) -> None:
        """Move copies of leaving workers' parts of the snapshot at `step` (a move off a draining
        node): each ``(part, holder, receiver)`` of `moves`, sent by the holder and kept by the
        receiver (a collective). Nothing to move when every worker holds the whole state."""
        return None

    def load(self, source: LoadSource) -> None:
        """Load a checkpoint (either format) into this worker's runner."""
        load_into(self.runner, source)

    def capture(self) -> int:
        """Make the state of this step restorable from the workers' memory now (every worker
        calls it at the same step); the step. A state every worker holds whole already is."""
        return self.runner.step

    def copy_for_driver(self, limit_bytes: int) -> Optional[tuple[Optional[bytes], int]]:
        """``(bytes, size)`` of the state for the driver's bounded copy (the bytes only when the
        size is at most `limit_bytes`), or None where the driver keeps no copy of this kind."""
        return None

    def close(self) -> None:
        """Release what the state keeps besides the runner (threads, snapshots)."""
        return None


def gather_rank_slots(runner: OperatorRunner, dst: Optional[int]) -> Optional[list[Any]]:
    """Every rank's slot (`OperatorRunner.rank_slot`), in rank order: on rank `dst`, or on every
    rank with None; None elsewhere. A collective: every worker calls it at once."""
    import torch.distributed as dist

    mine = runner.rank_slot()
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    if dst is None:
        dist.all_gather_object(everyone, mine)
        return everyone
    dist.gather_object(mine, everyone if dist.get_rank() == dst else None, dst=dst)
    return everyone if dist.get_rank() == dst else None


def apply_rank_slot(
    runner: OperatorRunner, saved: Mapping[str, Any], source: Optional[int]
) -> None:
    """Give `runner` the slot that the state `saved` holds for rank `source` of the run it was
    saved in; none when it holds none for it (the operator starts its per-rank state afresh, the
    generators stay as they are)."""
    slots = saved.get(RANK_SLOTS)
    if slots is None and saved.get(_RANK_STATES) is not None:
        slots = [{"state": state} for state in saved[_RANK_STATES]]
    have = slots is not None and source is not None and 0 <= source < len(slots)
    runner.load_rank_slot(slots[source] if have else None)  # type: ignore[index]


def load_into(runner: OperatorRunner, source: LoadSource, rank_source: Optional[int] = -1) -> None:
    """Load `source` into `runner`: a whole state into any strategy (each worker keeps its part
    when sharded), a sharded folder into any strategy and size (a collective). The operator's
    rank slot (`OperatorRunner.rank_slot`) is the one saved for rank `rank_source` (-1: this worker's rank; None: none,
    it starts afresh)."""
    if rank_source == -1:
        rank_source = get_context().world_rank
    if source.whole is not None:
        whole = source.whole
        if isinstance(whole, Storage):
            data = whole.parent().read_bytes(whole.name)
            where = f"file {whole.url!r}"
        else:
            data = ray.get(whole) if isinstance(whole, ray.ObjectRef) else whole
            where = "state"
        state = state_from_bytes(data, source=where)
        runner.load_state_dict(state)
        apply_rank_slot(runner, state, rank_source)
        return
    assert source.metadata is not None and source.state is not None
    files = source.files
    if isinstance(files, Storage) and files.is_local and os.path.isdir(files.path):
        runner.load_sharded(files.path, source.state)
        apply_rank_slot(runner, source.state, rank_source)
        return
    # Fetch only the files holding parts of this worker's new shard (all when it cannot tell).
    names = set(files) if isinstance(files, dict) else set(files.listdir())
    needed = runner.needed_parts(source.metadata) or {n for n in names if n.endswith(".distcp")}
    directory = tempfile.mkdtemp(prefix="load-", dir=scratch_dir())
    try:
        _write(directory, METADATA_FILE, source.metadata)
        bundles: dict[int, dict[str, Any]] = {}
        for name in sorted(needed):
            if name not in names:
                raise RuntimeError(f"checkpoint part {name!r} is missing")
            if isinstance(files, dict):
                ref = files[name]
                data = bundles.setdefault(id(ref), ray.get(ref))[name]
            else:
                data = files.read_bytes(name)
            _write(directory, name, data)
        runner.load_sharded(directory, source.state)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    apply_rank_slot(runner, source.state, rank_source)


def _write(directory: str, name: str, data: Any) -> None:
    import torch

    with open(os.path.join(directory, name), "wb") as handle:
        handle.write(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)


def state_within(runner: OperatorRunner, limit_bytes: int) -> tuple[Optional[bytes], int]:
    """``(bytes or None, size)`` of `runner`'s whole state: the bytes only when the size is at
    most `limit_bytes` (measured on the live tensors first, so that a large state is never
    serialised for nothing)."""
    size = sum(t.numel() * t.element_size() for t in flatten(runner.state_dict(live=True))[1])
    return (state_to_bytes(runner.state_dict()) if size <= limit_bytes else None), size
