"""The messages between the driver and its workers: what one side sends the other.

The driver's parts (`driver/`) call the functions of `worker.calls` on every worker through
`WorkerGroup.execute`; what travels with those calls, and what comes back, is defined here, once,
for both sides. So neither side defines what the other reads, and the worker side never imports
the driver side:

- starting and restoring a worker's runner: `RunnerArgs`;
- a `train()` call: what to watch (`WatchSpec`), what to checkpoint (`CheckpointPlan`), and the
  answer (`TrainAnswer`);
- a restore after a resize: what each worker holds (`Holding`, with its `HeldSnapshot`s), and the
  plan every worker follows (`RestorePlan`, with its `SnapshotPlan` and `SlotMove`s), which the
  kinds of state plan (`state.replicated`, `state.sharded`);
- a load: what is loaded (a `LoadSource`: each kind of state sends its own) and the answer
  (`LoadAnswer`).

Everything here is small and plain (it is pickled with every call): no tensor of the model.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Optional

from raysgd._internal.storage.location import Storage
from raysgd_operator import AverageMeterCollection, CallRecord, Progress, TrainingOptions

if TYPE_CHECKING:
    from raysgd_operator import OperatorRunner

__all__ = [
    "DRAIN",
    "JOIN_WATCH_INTERVAL_S",
    "SPARE",
    "WATCH_INTERVAL_S",
    "CheckpointPlan",
    "HeldSnapshot",
    "Holding",
    "LoadAnswer",
    "LoadSource",
    "PartMove",
    "RestorePlan",
    "RunnerArgs",
    "SlotCopy",
    "SlotMove",
    "SnapshotPlan",
    "StateCopy",
    "TrainAnswer",
    "WatchSpec",
    "call_from_meta",
    "call_meta",
]


# ------------------------------------------------------------------------------ the runner
class RunnerArgs(NamedTuple):
    """What a worker's runner is built from, for a group of one size."""

    #: The operator class (in the object store as a top-level argument: resolved on the worker).
    operator_cls: Any
    #: Each worker's config (its share of the global batch).
    config: dict[str, Any]
    options: TrainingOptions
    #: Every rank's split of the datasets (`{name: DataIterator}` in rank order; empty without).
    dataset_splits: Sequence[Mapping[str, Any]]
    #: The worker's half of the kind of state the strategy gives it (a `worker.state.WorkerState`
    #: class; pickled by reference, so a worker imports only its own kind's module).
    state_class: Any


# ------------------------------------------------------------------------------ a train() call
#: How often, in seconds of training, the workers look inside a call.
WATCH_INTERVAL_S = 1.0
#: How often while a spare may join: the group trains slower until it has.
JOIN_WATCH_INTERVAL_S = 0.25
#: Why the workers stopped: a node of theirs is draining (the driver moves them off it).
DRAIN = "drain"
#: Why the workers stopped: a spare is up (the driver lets it join).
SPARE = "spare"


@dataclass(frozen=True)
class WatchSpec:
    """What a `train()` call watches.

    Attributes:
        nodes: The nodes of its workers: a drain of one of them stops the call.
        interval_s: How often to look, in seconds of training.
        joining: For each spare that may join the group, the refs that are all done once it is
            up: one such spare stops the call.
    """

    nodes: frozenset[str]
    interval_s: float = WATCH_INTERVAL_S
    joining: tuple[tuple[Any, ...], ...] = ()


@dataclass(frozen=True)
class CheckpointPlan:
    """What a `train()` attempt checkpoints: every `every` steps into a new folder under `root`,
    keeping the newest `keep` complete ones (None: all). `token` is unique to the attempt: every
    worker derives the same folder name from it, and an attempt redone after a failure never
    writes into the folder of an interrupted one."""

    root: Storage
    every: int
    keep: Optional[int] = None
    token: str = ""


class TrainAnswer(NamedTuple):
    """What one worker's part of a `train()` call returns.

    Attributes:
        metrics: This worker's metrics of the call.
        step: Finished steps since training began.
        rows: Rows the whole group trained in the call when it went on after a recovery, the
            split is known and the batches counted their rows as `num_samples`, else None.
        stopped_for: Why the call stopped early at a step boundary, None when it did not: a node
            of the group is draining (`boundary_watch.DRAIN`: the driver moves its workers off
            it) or a spare is up (`SPARE`: the driver lets it join).
    """

    metrics: dict
    step: int
    rows: Optional[int]
    stopped_for: Optional[str]
    #: Epochs finished (the one in progress not counted).
    epochs: int = 0
    #: The mean duration of the recent steps, in seconds.
    step_s: float = 0.0
    #: Seconds the loop waited at checkpoint steps in this call (`checkpoint_every`).
    blocked_s: float = 0.0


# ------------------------------------------------------------------------------ a restore
@dataclass(frozen=True)
class HeldSnapshot:
    """One in-memory snapshot of a sharded state, as one worker holds it.

    Attributes:
        step: The step it was taken at.
        world_size: The size of the group that took it (one part per rank).
        metadata: DCP's metadata of the parts.
        state: The small rest of the state (epoch, position, schedulers, ...).
        call: The `train()` call in progress when it was taken.
        parts: The old ranks whose parts it holds (its own and its peer's copy), each with the
            call's metrics of that rank up to the snapshot.
    """

    step: int
    world_size: int
    metadata: bytes
    state: dict[str, Any]
    call: Optional[CallRecord]
    parts: Mapping[int, Optional[AverageMeterCollection]]


class SlotCopy(NamedTuple):
    """A rank slot a worker keeps a copy of (`Holding.peer_slots`)."""

    #: The rank whose slot it is, in its group.
    rank: int
    #: That group's number (`raysgd_core` context's generation).
    group: int
    #: The step of the window start the slot describes.
    step: int


@dataclass(frozen=True)
class Holding:
    """What one worker holds of the training state (its answer to `worker.holding`).

    Attributes:
        progress: How far it got; None for a worker without a runner (a replacement).
        snapshots: With a sharded strategy, the snapshots it holds parts of.
        rank: The rank whose slot its runner holds, and that rank's group's number: its rank in
            the group it trained in last (None: a new worker, or one whose restore failed
            midway: its own slot is then among `peer_slots`).
        peer_slots: With a replicated state, the slots of other ranks it keeps copies of (its
            ring predecessor's; a leaving worker's before a move).
    """

    progress: Optional[Progress]
    snapshots: tuple[HeldSnapshot, ...] = ()
    rank: Optional[tuple[int, int]] = None
    peer_slots: tuple[SlotCopy, ...] = ()


@dataclass(frozen=True)
class SnapshotPlan:
    """The snapshot a sharded state is rebuilt from.

    Attributes:
        metadata: DCP's metadata.
        state: The small rest of the state.
        holders: Every part (old rank) -> the rank of the re-formed group that holds it and
            sends it to the workers that need it and lack it.
        meters: New rank -> its share of the interrupted call's metrics up to the snapshot
            (new rank r takes those of old ranks r, r + n, ...).
    """

    metadata: bytes
    state: dict[str, Any]
    holders: dict[int, int]
    meters: list[Optional[AverageMeterCollection]]


@dataclass(frozen=True)
class SlotMove:
    """One rank slot sent at a restore (ranks of the re-formed group).

    Attributes:
        rank: The rank of the group before whose slot it is.
        holder: The rank that sends it.
        receiver: The rank that takes it.
        replica: Whether the holder sends a copy it keeps of another rank's slot (else its own).
    """

    rank: int
    holder: int
    receiver: int
    replica: bool


class PartMove(NamedTuple):
    """One part of a sharded snapshot given to a worker that stays (a move off a draining
    node: ranks of the group before it)."""

    #: The rank whose part it is.
    part: int
    #: The rank that holds a copy of it and sends it.
    holder: int
    #: The rank that takes it.
    receiver: int


@dataclass(frozen=True)
class RestorePlan:
    """What the planners decided (and, when they found nothing, the trainer's fallback).

    Attributes:
        step: The finished step training goes on from.
        steps_redone: Steps started (by a worker that survived) that are lost: the one in
            flight, plus any since the state restored. 0 when nothing was lost.
        call: The `train()` call to go on with (None: the next call starts afresh).
        source: From peers: the rank (in the re-formed group) whose state every worker takes.
        receivers: From peers: the ranks that receive it.
        snapshot: From snapshots: what every worker is rebuilt from.
        fallback: Neither found a state: what every worker loads instead (a checkpoint
            location, or the serialised state in the object store), chosen by the trainer.
        description: Where the state comes from, in words ("rank 1 at step 30", ...).
        finished_at: When the surviving workers last finished a step (`time.time()`; None when
            none did): the loss was detected that long after the group's last progress.
        rank_sources: For each rank of the re-formed group, the rank of the group before whose
            slot (`StateIO.rank_slot`: per-rank state, generators) it takes: a kept worker
            its own, a replacement a lost worker's; None for a worker that starts its own
            afresh. Empty: every rank takes its own number's.
        slot_moves: From peers: how the ranks of the re-formed group that take another rank's
            place get its slot.
        inexact: Why the group does not go on exactly as it would have without the failure,
            in words (empty: it does, bit for bit where the group kept its size).
    """

    step: int
    steps_redone: int
    call: Optional[CallRecord]
    source: Optional[int] = None
    receivers: tuple[int, ...] = ()
    snapshot: Optional[SnapshotPlan] = None
    fallback: Any = None
    description: str = ""
    finished_at: Optional[float] = None
    rank_sources: tuple[Optional[int], ...] = ()
    slot_moves: tuple[SlotMove, ...] = ()
    inexact: tuple[str, ...] = ()

    def rank_source(self, rank: int) -> Optional[int]:
        """Whose per-rank state rank `rank` takes (see `rank_sources`)."""
        return self.rank_sources[rank] if rank < len(self.rank_sources) else rank

    @property
    def found(self) -> bool:
        """Whether the workers themselves hold a state to go on from."""
        return self.source is not None or self.snapshot is not None

    def falling_back(self, fallback: Any, step: int, description: str, redone: int) -> RestorePlan:
        """This plan with the trainer's `fallback` (taken at `step`): the interrupted call starts
        again from there."""
        return replace(
            self,
            step=step,
            steps_redone=redone,
            call=None,
            fallback=fallback,
            description=description,
        )


def call_meta(call: Optional[CallRecord]) -> Optional[dict[str, Any]]:
    """`call` as plain JSON-able data, for a periodic checkpoint's manifest: a restore that goes
    back to the checkpoint goes on with the call from there, its count up to there kept."""
    if call is None or not isinstance(call.call_id, (int, str)):
        return None
    return {
        "call_id": call.call_id,
        "num_steps": call.num_steps,
        "start_step": call.start_step,
        "steps": call.steps,
        "rows": call.rows,
        "epoch": call.epoch,
        "loop_s": call.loop_s,
    }


def call_from_meta(meta: Any) -> Optional[CallRecord]:
    """The call `call_meta` wrote (None for anything else)."""
    if not isinstance(meta, Mapping):
        return None
    try:
        return CallRecord(
            call_id=meta["call_id"],
            num_steps=meta["num_steps"],
            start_step=int(meta["start_step"]),
            steps=int(meta["steps"]),
            rows=meta["rows"],
            epoch=meta["epoch"],
            loop_s=float(meta["loop_s"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------ a load
class LoadSource(abc.ABC):
    """What every worker loads: a checkpoint or a state, sent by the kind of state whose format it
    is (`state.replicated.WholeSource`, `state.sharded.PartsSource`), which reads it into any
    strategy and any number of workers."""

    #: Whether a source that is not a checkpoint is found before anything changes (the worker
    #: then answers why, `LoadAnswer.refused`, instead of raising: the group stays formed).
    checked_first: ClassVar[bool] = False

    @abc.abstractmethod
    def load_into(self, runner: OperatorRunner, rank_source: Optional[int]) -> None:
        """Load into `runner`, with the rank slot (`StateIO.rank_slot`) saved for rank
        `rank_source` (None: none, the runner's per-rank state starts afresh). A collective
        where the source is read in parts."""


class LoadAnswer(NamedTuple):
    """What one worker's part of a load returns: its step and finished epochs after the load, or
    why it refused the state (a file that is not a checkpoint: nothing was changed)."""

    step: int
    epochs: int
    refused: Optional[str] = None


# ------------------------------------------------------------------------------ the driver's copy
class StateCopy(NamedTuple):
    """Rank 0's answer for the driver's bounded copy of a whole state."""

    #: The state's bytes, or None when it is larger than the copy's limit.
    data: Optional[bytes]
    #: The state's size in bytes.
    size: int
    #: The step it describes.
    step: int
    #: Seconds the worker spent on it.
    seconds: float
