"""When a sharded state's next snapshot falls due: every K steps, or K chosen by measurement.

A snapshot costs the training loop two things: the copy of the worker's part to host memory (the
loop waits for it), and the steps that run slower while its thread writes, reads and swaps the
part with the peer (on a machine whose cores the training uses). Both are measured: the wait
directly, the slowdown as the steps' time while a snapshot's thread runs beyond the time of the
steps while none does. With ``snapshot_every="auto"`` the interval is the shortest that keeps
that cost under `BUDGET` of the training time::

    K = ceil(cost of one snapshot / (BUDGET x the time of a step without one))

so that a lost worker redoes as few steps as the cost allows: a cheap snapshot of a small model
on slow steps is taken every step or two, an expensive one of a large model less often. Until
both are measured (the snapshot taken at start-up, the steps while none is being taken) the
intervals start at `FIRST_INTERVAL` and double at every snapshot up to `RAMP_LIMIT`: a loss in a
run's first steps redoes a few of them, not all since the start, and a snapshot whose thread
outlasts a few steps (so that no step without one is measured yet) is not taken at every other
step for long.

Every worker must take its snapshot at the same step (the snapshot is a collective), but each
measures its own cost and steps. So no worker changes its interval alone: at every snapshot the
workers agree on the largest interval any of them wants (`wanted`, `agree`), and while none
wants one yet, on the ramp's largest interval: a re-formed group (a replacement knows nothing yet
and starts the ramp again) agrees again at the snapshot the trainer takes after the restore.
"""

from __future__ import annotations

import math
from typing import Optional, Union

__all__ = ["BUDGET", "FIRST_INTERVAL", "MAX_INTERVAL", "RAMP_LIMIT", "SnapshotSchedule"]

#: The share of the training time the snapshots may cost with ``snapshot_every="auto"``.
BUDGET = 0.03
#: The first interval, before the cost and the step time are known (see `RAMP_LIMIT`).
FIRST_INTERVAL = 2
#: The longest interval while the cost or the step time is still unknown.
RAMP_LIMIT = 20
#: The longest interval "auto" picks: a state this much costlier than a step is better served by
#: checkpoints.
MAX_INTERVAL = 1000
#: Weight of the newest measurement in the running means (recent steps count more).
_NEW = 0.2


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _NEW) * old + _NEW * new


class SnapshotSchedule:
    """When the next snapshot falls due, from the measured cost (see the module docstring).

    Args:
        every: Steps between snapshots, 0 for none between the ones the trainer asks for, or
            "auto".
    """

    def __init__(self, every: Union[int, str]) -> None:
        self.auto = every == "auto"
        self.every = FIRST_INTERVAL if self.auto else int(every)
        #: The step of the last snapshot taken.
        self.last_step = 0
        #: Mean seconds of a step while no snapshot's thread runs.
        self.step_s: Optional[float] = None
        #: Mean cost of one snapshot in seconds of training (the wait plus the slowdown).
        self.cost_s: Optional[float] = None
        self._pending: Optional[float] = None  # the cost of the snapshot in flight so far

    def due(self, step: int) -> bool:
        """Whether a snapshot falls due at `step`."""
        return self.every > 0 and step - self.last_step >= self.every

    def taken(self, step: int, wait_s: float) -> None:
        """A snapshot was taken at `step`; the loop waited `wait_s` for its copy."""
        self.last_step = step
        self._pending = wait_s

    def stepped(self, duration_s: float, snapshot_running: bool) -> None:
        """A step took `duration_s`, with a snapshot's thread running or not."""
        if snapshot_running and self._pending is not None and self.step_s is not None:
            self._pending += max(0.0, duration_s - self.step_s)
        elif not snapshot_running:
            self.step_s = _mean(self.step_s, duration_s)

    def finished(self) -> None:
        """The snapshot in flight is held: its cost is known."""
        if self._pending is None:
            return
        self.cost_s, self._pending = _mean(self.cost_s, self._pending), None

    def wanted(self) -> int:
        """The interval this worker's measurements ask for ("auto"), 0 before they exist."""
        if not (self.auto and self.cost_s is not None and self.step_s):
            return 0
        return min(MAX_INTERVAL, max(1, math.ceil(self.cost_s / (BUDGET * self.step_s))))

    def agree(self, largest_wanted: int, largest_every: int) -> None:
        """Every worker's `wanted` and `every`, the largest of each, taken at the same snapshot:
        the interval from this snapshot on, the same on every worker (the costliest worker's,
        or the ramp's next, doubled from the furthest any worker got)."""
        if self.auto:
            self.every = largest_wanted or min(RAMP_LIMIT, 2 * largest_every)
