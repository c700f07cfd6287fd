"""What the recovery loop works on, as narrow views: the worker group (`ElasticGroup`) and the
training state (`RestorableState`); its named stages (`Stage`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

from raysgd_core import RecoveryReport
from raysgd_fault import Action

__all__ = ["NEXT_STAGE", "ElasticGroup", "RestorableState", "Stage", "on_live_nodes"]


class ElasticGroup(Protocol):
    """What the recovery loop needs of a worker group; `raysgd_core.WorkerGroup` is one."""

    @property
    def world_size(self) -> int:
        """Workers in the current process group (the live size)."""

    @property
    def needs_recovery(self) -> bool:
        """A worker raised or died: `recover` must run before the next call."""

    def recover(self, num_workers: int, *, timeout_s: float) -> RecoveryReport:
        """Re-form the group with up to `num_workers` workers, keeping the healthy ones."""

    def estimate_fitting(self) -> int:
        """A cheap guess of how many more workers the cluster has room for."""

    def retire(self, ranks: Sequence[int]) -> None:
        """Stop healthy workers on purpose (their node is going away); `recover` follows."""

    @property
    def spares(self) -> Sequence[object]:
        """The spare workers that are up (`recover` promotes them first)."""

    @property
    def spares_starting(self) -> int:
        """Spare workers started but not up yet."""

    def start_spares(self, count: int) -> None:
        """Start `count` more spares now: replacements that join once they are up."""

    def spare_readiness(self) -> list[tuple[Any, ...]]:
        """For each spare, the refs that are all done once it is up."""

    def execute(self, fn: Any, *args: Any) -> list[Any]:
        """Run `fn(*args)` on every worker; the results in rank order."""

    def execute_single(self, rank: int, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the worker of `rank`."""


class RestorableState(Protocol):
    """What the recovery loop needs of the training state; `TrainingState` is one."""

    def restore(self, report: RecoveryReport) -> Any:
        """After a resize (`report`: what the group did): make every worker of the re-formed
        group ready to go on; may return a `RestoreOutcome`. `StateLostError` when there is no
        state to go on from."""

    def hand_over(self, leaving: Sequence[int]) -> None:
        """At a step boundary, before the workers of `leaving` go on purpose (or spares join:
        none leave): make the state of this boundary restorable without them."""


class Stage(str, enum.Enum):
    """Where the recovery loop is in one `run()` call (see the module docstring)."""

    RUNNING = "running"
    FAILED = "failed"
    WAITING = "waiting"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    GAVE_UP = "gave_up"


#: The stage each policy action leads to.
NEXT_STAGE = {
    Action.RETRY: Stage.RESTARTING,
    Action.WAIT: Stage.WAITING,
    Action.GIVE_UP: Stage.GAVE_UP,
}


def on_live_nodes(nodes: Sequence[str]) -> int:
    """How many of `nodes` (one entry per lost worker) Ray still reports alive."""
    if not nodes:
        return 0
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return sum(1 for node in nodes if node in alive)
