"""A sharded state's in-memory snapshots on one worker: taken at a step boundary, kept as tensors
in host memory, each part also on the ring peer, so that a lost worker's part comes back without
a disk.

Every `snapshot_every` steps, or as often as their measured cost allows (`snapshot_schedule`), when
a validation runs at a step no snapshot was taken at (what it draws belongs to the state from
there on), and when the trainer asks (at start-up, after a restore or a load, before
workers leave) every worker, at the same step boundary:

1. copies its part of the models and optimizers to host memory (`sharded_memory.stage`, into one
   new buffer), the one copy that training waits for;
2. keeps the small rest of the state (epoch, position, schedulers, the call in progress with its
   metrics so far);
3. in a background thread, on a gloo group of its own, saves the copy with
   `torch.distributed.checkpoint` into memory (`sharded_memory.keep`: the tensors stay as they
   are, with metadata that says where each chunk sits in the whole) and sends its part to its
   ring peer (`part_exchange`): worker r keeps its own part and that of worker r - 1;
4. commits it: an all-reduce over the snapshot group that every worker enters once it holds the
   snapshot (its own part and its peer's). A worker that comes out of it knows that every worker
   holds the new snapshot, and drops the one before.

So a snapshot is tensors in host memory from end to end: no file, no serialisation. A lost
worker's part is gone only when its peer is lost too. A snapshot interrupted by a failure leaves
the one before it on every worker that did not come out of the commit, and the new one on every
worker that did (and then on all of them): the newest step every survivor holds is whole either
way. In steady state a worker keeps one snapshot: two copies of its part's size, its own and its
peer's. While one is taken it keeps the one before as well: four at most. Each copy is one buffer,
given back to the system when it is dropped (a checkpoint being written from a copy keeps it until
written).
How a snapshot restores the state, and becomes a checkpoint: `state.sharded`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from raysgd._internal.worker.part_exchange import exchange
from raysgd._internal.worker.snapshot_schedule import SnapshotSchedule
from raysgd._internal.worker.state import RANK_SLOTS, gather_rank_slots
from raysgd_operator import AverageMeterCollection, CallRecord, OperatorRunner

if TYPE_CHECKING:  # the module imports DCP: imported at run time on first use only
    from raysgd_operator.sharded_memory import Chunks

__all__ = [
    "PEAK_COPIES",
    "STEADY_COPIES",
    "Generation",
    "Snapshots",
    "Taken",
    "budget_message",
    "nbytes",
]

logger = logging.getLogger("raysgd")

#: How long the snapshot group's collectives wait for a peer before giving up on a snapshot.
SWAP_TIMEOUT_S = 300.0


@dataclass
class Generation:
    """One finished snapshot as a worker holds it."""

    step: int
    world_size: int
    metadata: bytes
    #: The small rest of the state (`StateIO.sharded_parts`'s second dict).
    state: dict[str, Any]
    #: The call in progress when it was taken (its rows so far), or None.
    call: Optional[CallRecord]
    #: old rank -> (its chunks, its call metrics): this worker's own part and its peer's.
    parts: dict[int, tuple[Chunks, Optional[AverageMeterCollection]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Taken:
    """The snapshot taken last: its step, the thread that finishes it, and its host copy (which a
    checkpoint at the same step writes as files)."""

    step: int
    #: None for a copy made only to be written (no snapshot is kept: `Snapshots.keeping`).
    thread: Optional[threading.Thread]
    staged: dict[str, Any]
    state: dict[str, Any]


class Snapshots:
    """This worker's snapshots and the step hook that takes them (see the module docstring)."""

    def __init__(
        self, runner: OperatorRunner, every: Union[int, str], budget_mb: Optional[float] = None
    ) -> None:
        self.runner = runner
        self.schedule = SnapshotSchedule(every)
        #: `snapshot_memory_mb`: the host memory a worker's snapshots may take (None: no bound).
        self.budget_mb = budget_mb
        #: Whether snapshots are kept between steps: the budget holds `PEAK_COPIES` of the
        #: largest worker's part (decided at every snapshot the trainer asks for).
        self.keeping = True
        #: The largest worker's part, in bytes, when last measured (None: not yet).
        self.part_bytes: Optional[int] = None
        #: What the budget chose, when it was last decided and not yet said (`budget_message`).
        self.choice: Optional[str] = None
        self.held: dict[int, Generation] = {}
        #: Steps reported to the driver (`ShardedState.holding`): never dropped before the restore
        #: or the move that asked for them (until the next snapshot is taken).
        self.reported: set[int] = set()
        self._group: Any = None
        self._files_group: Any = None
        self._thread: Optional[threading.Thread] = None
        #: The snapshot taken last (held once its thread has finished).
        self.taking: Optional[Taken] = None
        #: The step of the last snapshot every worker was known to hold (the commit).
        self.committed: Optional[int] = None
        self._failed: Optional[BaseException] = None
        # The last step boundary (after its snapshot, if any), and the call it was in.
        self._boundary: Optional[tuple[float, Any]] = None
        if self.schedule.every > 0:
            runner.add_step_hook(self._on_step)
            runner.position.add_window_start_hook(self._on_window_start)

    def _on_step(self) -> None:
        now, call = time.perf_counter(), self.runner.position.call
        running = self._thread is not None and self._thread.is_alive()
        if self._boundary is not None and _same_call(self._boundary[1], call):
            self.schedule.stepped(now - self._boundary[0], running)
        if not running:
            self.schedule.finished()
        # At a window start only: a snapshot inside a window would have to hold the gradients
        # accumulated since its start.
        position = self.runner.position
        if self.keeping and self.schedule.due(position.step) and position.at_window_start:
            self.take(wait=False)
        self._boundary = (time.perf_counter(), call)

    def _on_window_start(self) -> None:
        """The window start in progress was marked again at its step: a call ended there or a
        validation ran, and what they changed (an epoch's scheduler step, the validation's
        draws) belongs to it, as it does to the run never interrupted. The snapshot of that
        step, when one was taken, gets it (only its small rest changed: no optimizer stepped).
        After a validation a restore must not go back past it (the steps redone would draw
        without it): a snapshot is taken at that step when none was, and either is held here
        and on the peer before the call returns. A call's end alone waits for nothing: going
        back past it redoes the same draws."""
        runner, taking = self.runner, self.taking
        position = runner.position
        at_step = taking is not None and taking.step == position.window_step
        if at_step:
            # Every worker is here (see the hook).
            state = _with_rank_slots(runner, runner.state.small_state())
            # The same dictionary the snapshot holds (`Generation.state`).
            taking.state.update(state)
        if position.validated_at != position.window_step or not self.keeping:
            return
        if not at_step:
            self.take(wait=False)
        self.join()

    def group(self) -> Any:
        """The gloo group snapshots are saved and swapped over (made on first use: every worker
        asks at the same point)."""
        import torch.distributed as dist

        if self._group is None:
            # Collectives of this group run in threads beside training's: a group of their own,
            # on the CPU (the parts are in host memory), never in the way of the training group.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SWAP_TIMEOUT_S))
        return self._group

    def files_group(self) -> Any:
        """The gloo group a checkpoint's files are written over, in the writer threads (made on
        first use: every worker asks at the same checkpoint step). Not the snapshot group: its
        collectives would interleave with a snapshot's in another thread."""
        import torch.distributed as dist

        if self._files_group is None:
            self._files_group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=SWAP_TIMEOUT_S)
            )
        return self._files_group

    def take(self, *, wait: bool, even_over_budget: bool = False) -> Generation | None:
        """Snapshot this worker's part now (every worker calls it at the same step). With `wait`,
        return once the snapshot is held here and on the peer. None when the budget does not
        hold a snapshot (see `keeping`), unless `even_over_budget` (a move, which needs the
        leaving workers' parts for as long as it takes)."""
        import torch.distributed as dist

        from raysgd_operator import sharded_memory

        self.join()
        self.reported.clear()
        group = self.group()
        runner, rank = self.runner, dist.get_rank()
        started = time.perf_counter()
        tensors, state = runner.state.sharded_parts()
        self._agree(nbytes(tensors), group)
        if not (self.keeping or even_over_budget):
            self.forget()
            return None
        state = _with_rank_slots(runner, state)
        meters = runner.position.call_meters()
        call = runner.position.call
        staged = sharded_memory.stage(tensors)
        del tensors
        # The state taken is the window start's (`StateIO.state_dict`).
        step, size = runner.position.window_step, dist.get_world_size()
        copied = time.perf_counter()
        self.schedule.taken(step, copied - started)

        def finish() -> None:
            try:
                metadata, chunks = sharded_memory.keep(staged, group)
                holder = [metadata]
                dist.broadcast_object_list(holder, src=0, group=group)
                kept = time.perf_counter()
                generation = Generation(step, size, holder[0], state, call)
                generation.parts[rank] = (chunks, meters)
                if size > 1:
                    peer = (rank - 1) % size
                    [generation.parts[peer]] = exchange(
                        group, [((rank + 1) % size, chunks, meters)], [peer]
                    )
                self.held[step] = generation
                if size > 1:
                    # The commit: out of it only once every worker holds this snapshot.
                    dist.all_reduce(torch.ones(1), group=group)
                self.committed = step
                for old in set(self.held) - self.reported - {step}:
                    del self.held[old]
                logger.debug(
                    "snapshot at step %d: %.3f s in the loop, %.3f s keeping, %.3f s swapping",
                    step,
                    copied - started,
                    kept - copied,
                    time.perf_counter() - kept,
                )
            except BaseException as exc:  # kept for `join`; a lost peer ends the swap here
                self._failed = exc

        self._thread = threading.Thread(target=finish, name="raysgd-snapshot", daemon=True)
        self._thread.start()
        self.taking = Taken(step, self._thread, staged, state)
        if wait:
            self.join()
            if self._failed is not None:
                raise RuntimeError(f"the snapshot at step {step} failed: {self._failed}")
            return self.held[step]
        return None

    def _agree(self, nbytes: int, group: Any) -> None:
        """Agree with every worker on the next snapshot's step (with "auto", each worker measured
        its own cost, and a replacement starts the ramp again) and, with a budget, on whether
        snapshots are kept: the largest part decides, for all of them."""
        import torch.distributed as dist

        if not self.schedule.auto and self.budget_mb is None:
            return
        wanted = torch.tensor(
            [self.schedule.wanted(), self.schedule.every, nbytes], dtype=torch.int64
        )
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=group)
        if self.schedule.auto:
            self.schedule.agree(int(wanted[0]), int(wanted[1]))
        most = int(wanted[2])
        if self.budget_mb is None or most == self.part_bytes:
            return
        self.part_bytes = most
        self.keeping = PEAK_COPIES * most <= self.budget_mb * 2**20
        self.choice = budget_message(most, self.budget_mb, self.keeping)

    def copy_only(self) -> Taken:
        """A host copy of this worker's part and the small rest, to be written as a checkpoint's
        files, with no snapshot kept (every worker calls it at the same step)."""
        from raysgd_operator import sharded_memory

        tensors, state = self.runner.state.sharded_parts()
        state = _with_rank_slots(self.runner, state)
        staged = sharded_memory.stage(tensors)
        return Taken(self.runner.position.window_step, None, staged, state)

    def parts_at(self, step: int) -> dict[int, tuple[Chunks, Optional[AverageMeterCollection]]]:
        """The parts this worker holds of the snapshot at `step` (none when it holds none)."""
        self.join()
        generation = self.held.get(step)
        return dict(generation.parts) if generation is not None else {}

    def forget(self) -> None:
        """Drop every snapshot held: the state was replaced as a whole (a load), and they are
        of the state before it."""
        self.join()
        self.held.clear()
        self.reported.clear()
        self.taking, self._boundary, self.committed = None, None, None

    def on_new_group(self) -> None:
        """The process group was re-formed: the snapshots held belong to the old one, and the
        snapshot groups are made again over the new one when next used."""
        self.forget()
        self._group, self._files_group = None, None

    def join(self, timeout_s: Optional[float] = None) -> None:
        """Wait for the snapshot in flight (if any) to be held."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if not thread.is_alive():
                self._thread = None
        if self._failed is not None:
            logger.warning("a sharded snapshot failed: %s", self._failed)
            self._failed = None


def budget_message(part_bytes: int, budget_mb: float, keeping: bool) -> str:
    """What the snapshots take of `snapshot_memory_mb` per worker, and what a loss costs."""
    part = part_bytes / 2**20
    held = f"{STEADY_COPIES} copies of a worker's part ({STEADY_COPIES * part:.0f} MB)"
    peak = f"{PEAK_COPIES} ({PEAK_COPIES * part:.0f} MB) while one is taken"
    if keeping:
        return (
            f"fsdp snapshots in host memory: {held}, {peak}, within snapshot_memory_mb="
            f"{budget_mb:g}; a lost worker costs the steps since the last snapshot"
        )
    return (
        f"no fsdp snapshots in host memory: they take {held}, {peak}, more than "
        f"snapshot_memory_mb={budget_mb:g}. A lost worker costs a return to the newest "
        "checkpoint (checkpoint_every), and without one it ends the run; more workers make "
        "each part smaller"
    )


#: Copies of its part a worker holds between snapshots (its own, and its peer's) and, at most,
#: while one is taken (the one before stays until every worker holds the new one).
STEADY_COPIES, PEAK_COPIES = 2, 4


def nbytes(tree: Any) -> int:
    """The bytes of a worker's part or its host copy (nested dicts of tensors; of a DTensor, its
    local part)."""
    if isinstance(tree, dict):
        return sum(nbytes(value) for value in tree.values())
    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        tensor = local() if callable(local) else tree
        return tensor.numel() * tensor.element_size()
    return 0


def _with_rank_slots(runner: OperatorRunner, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every rank's slot (a collective: every worker calls it at the same point).
    Every worker keeps every rank's (small): whichever survives has the lost ones' for their
    replacements."""
    rank_slots = gather_rank_slots(runner, None)
    if rank_slots is not None:
        state[RANK_SLOTS] = rank_slots
    return state


def _same_call(a: Any, b: Any) -> bool:
    """Whether two call records are of one call (a step's time across two calls includes the
    driver's time between them)."""
    if a is None or b is None:
        return False
    return (a.call_id, a.start_step) == (b.call_id, b.start_step)
