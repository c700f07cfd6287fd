"""Records `WorkerGroup` hands out: where each rank runs, what a recovery did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["RecoveryReport", "WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """Where one rank runs."""

    rank: int
    local_rank: int
    local_world_size: int
    node_id: str
    node_ip: str
    pid: int
    device: str
    is_local: bool = False  # rank 0 living in the calling process (use_local=True)


@dataclass(frozen=True)
class RecoveryReport:
    """What `WorkerGroup.recover` did.

    Attributes:
        path: "keep-healthy" (survivors kept their processes) or "full-restart" (all new actors).
        kept: old rank -> new rank of every worker that survived.
        started: new ranks of the workers started by this recovery.
        world_size: the size of the re-formed group (0 when nothing could be started).
        duration_s: wall time of the recovery.
        lost: old ranks that were dead, stuck or dropped.
        found_lost: old rank -> node id of each lost worker that no call had reported lost:
            this recovery found it dead or not answering (a loss since the error that called
            for the recovery, such as the second of a burst). A subset of `lost`; a caller
            that counts losses counts these too.
        timings: seconds per phase: "ping_s" (finding the dead and stuck), "leave_s" (survivors
            leaving the old process group, while the replacements start), "start_s" (from asking
            for the replacements until they are up and their init hook ran), "form_s" (the new
            process group). A phase that did not happen is absent.
        steps_redone: training steps started before the loss that are done again once the state
            is restored. The group knows nothing of steps, so `WorkerGroup.recover` leaves it
            None; the layer that restores the training state fills it in (`TorchTrainer`'s
            resize events carry the completed report).
    """

    path: str
    kept: dict[int, int]
    started: list[int]
    world_size: int
    duration_s: float
    lost: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    steps_redone: Optional[int] = None
    found_lost: dict[int, str] = field(default_factory=dict)
