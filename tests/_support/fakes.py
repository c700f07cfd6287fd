"""Stand-ins for what the run controller works on (`group_view`'s narrow views), for walking its
every path without Ray or processes: a worker group whose size changes only through `recover`,
bounded by `room`; a training state that records its restores and hand-overs; what the cluster
says; scripted attempts that raise the errors a real group raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from raysgd_core import RecoveryReport, WorkerDiedError

__all__ = ["FakeCluster", "FakeGroup", "FakeState", "Script", "died"]


class FakeGroup:
    """A worker group whose size changes only through `recover`, bounded by `room`."""

    def __init__(self, size: int, room: int) -> None:
        self.world_size = size
        self.room = room
        self.needs_recovery = False
        self.dead = 0  # workers lost since the last recover (still counted in `world_size`)
        self.recover_calls: list[int] = []
        self.recover_errors: list[BaseException] = []  # raised by the next recover calls
        # Workers the next recover finds gone although no call reported them (rank -> node).
        self.found_next: dict[int, str] = {}
        self.spare_waits: list[float] = []  # a move's waits for starting spares
        self.spares_up = 0  # spares started and up: `recover` promotes them first
        self.spares_starting = 0

    @property
    def spares(self) -> list[str]:
        return ["spare"] * self.spares_up

    def start_spares(self, count: int) -> None:
        self.spares_starting += count

    def spare_readiness(self) -> list[tuple[Any, ...]]:
        return [("ref",)] * (self.spares_up + self.spares_starting)

    def recover(self, num_workers: int, *, timeout_s: float) -> RecoveryReport:
        self.recover_calls.append(num_workers)
        if self.recover_errors:
            raise self.recover_errors.pop(0)
        found, self.found_next = self.found_next, {}
        self.dead += len(found)
        survivors = min(self.world_size - self.dead, num_workers)
        self.spares_up -= min(self.spares_up, num_workers - survivors)
        self.world_size = min(num_workers, max(self.room, survivors))
        self.needs_recovery, self.dead = False, 0
        return RecoveryReport(
            path="keep-healthy",
            kept={r: r for r in range(survivors)},
            started=list(range(survivors, self.world_size)),
            world_size=self.world_size,
            duration_s=0.0,
            lost=[],
            timings={"start_s": 0.25, "form_s": 0.125},
            found_lost=found,
        )

    def estimate_fitting(self) -> int:
        return max(0, self.room - (self.world_size - self.dead))

    def retire(self, ranks: Sequence[int]) -> None:
        self.needs_recovery = True
        self.dead += len(ranks)

    def await_spares(self, timeout_s: float) -> int:
        self.spare_waits.append(timeout_s)
        return 0


class FakeState:
    """The loop's view of the training state: each restore recorded (and answered by `restore`,
    when given), each hand-over passed to `hand_over` (when given)."""

    def __init__(self, restore: Any = None, hand_over: Any = None) -> None:
        self.restored: list[RecoveryReport] = []
        self._restore, self._hand_over = restore, hand_over

    def restore(self, report: RecoveryReport) -> Any:
        self.restored.append(report)
        return self._restore(report) if self._restore is not None else None

    def hand_over(self, leaving: Sequence[int]) -> None:
        if self._hand_over is not None:
            self._hand_over(leaving)


class FakeCluster:
    """What the cluster says: whether a lost worker's node lives on (its slot is free again at
    once: a killed process), and no drains."""

    def __init__(self, nodes_alive: bool = True) -> None:
        self.nodes_alive = nodes_alive

    def draining(self) -> dict[str, Optional[float]]:
        return {}

    def multi_node(self) -> bool:
        return False

    def live_count(self, nodes: Sequence[str]) -> int:
        return len(nodes) if self.nodes_alive else 0

    def preempted(self, nodes: Any) -> set[str]:
        return set()


def died(group: FakeGroup, ranks: Sequence[int]) -> WorkerDiedError:
    """What a real group raises when `ranks` die: it needs recovery (its size changes only then)."""
    group.needs_recovery = True
    group.dead += len(ranks)
    return WorkerDiedError("worker process exited", list(ranks), ["node"] * len(ranks))


class Script:
    """An attempt that raises the scripted errors one per call, then returns "done"."""

    def __init__(self, *errors: Any) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            make = self.errors.pop(0)
            raise make()
        return "done"
