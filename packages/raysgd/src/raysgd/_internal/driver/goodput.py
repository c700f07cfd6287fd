"""Goodput: how much of the time spent in `train()` and `validate()` went into work that was kept.

The trainer measures the time inside its calls (`wall_s`); the meter observes the run controller's
events as they are recorded (`RecoveryLog.subscribe`: the events are the one source of what a
resize cost) and its transitions (`RunController.subscribe`: what a checkpoint blocked, how long
a backoff took, the step time a call ended with):

- `detection`: from the moment the surviving workers last finished a step to the moment the loss
  was seen (a dead process: at once; a silent one: when its peers' bounded wait ran out);
- `start`: starting, promoting and joining workers in every resize (the group's ping, leave,
  start and form phases);
- `restore`: bringing the new group to the state it goes on from;
- `redone`: steps finished before a loss, lost with it and done again, at the call's mean step
  time (the step in flight is counted in `detection` up to the loss);
- `checkpoint`: the training loop blocked by checkpoints (one asked for at the start of a call;
  the copy to host memory of `checkpoint_every`, and any wait for the upload before it);
- `waiting`: the policy's backoff while no worker could start.

`productive_s` is `wall_s` less all of that: the time of the steps that were kept, with each
call's own overhead and validation. `goodput` is `productive_s / wall_s`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["CAUSES", "GoodputMeter"]

#: The causes of lost time, as `goodput()["lost_s"]` keys them.
CAUSES = ("detection", "start", "restore", "redone", "checkpoint", "waiting")
#: The group phases of a resize that count as starting workers (the rest is the restore).
_START_PHASES = ("ping_s", "leave_s", "start_s", "form_s")


class GoodputMeter:
    """Adds up the trainer's time and where it was lost (see the module docstring)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.lost_s = dict.fromkeys(CAUSES, 0.0)
        self.steps_redone = 0
        self._failure_at: Optional[float] = None
        # Steps redone in the current call: their time is known once the call's step time is.
        self._redone_pending = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Measure one `train()` or `validate()` call."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - started

    def lose(self, cause: str, seconds: float) -> None:
        """Count `seconds` lost to `cause` (one of `CAUSES`)."""
        self.lost_s[cause] += max(0.0, float(seconds))

    def end_call(self, step_s: float) -> None:
        """Count the steps redone since the last call's end at `step_s`, this call's mean step
        time."""
        self.lose("redone", self._redone_pending * step_s)
        self._redone_pending = 0

    def on_transition(self, transition: Any) -> None:
        """Observe one transition of the run controller (`RunController.subscribe`)."""
        self.lose("checkpoint", transition.checkpoint_s)
        # The seconds the backoff took, not the policy's number: an interrupted or skipped wait
        # (a grow put off, say) is not lost time.
        self.lose("waiting", transition.waited_s)
        if transition.step_s is not None:
            self.end_call(transition.step_s)

    def take(self, event: Any) -> None:
        """Observe one recovery event (`RecoveryLog.subscribe`)."""
        if event.kind in ("failure", "restart_failed") and self._failure_at is None:
            self._failure_at = event.timestamp
        elif event.kind == "resize":
            phases = event.phases or {}
            self.lose("start", sum(phases.get(name, 0.0) for name in _START_PHASES))
            self.lose("restore", phases.get("restore_s", 0.0))
            redone = int(event.steps_redone or 0)
            self.steps_redone += redone
            if self._failure_at is not None and event.state_at is not None:
                self.lose("detection", self._failure_at - event.state_at)
                # The step in flight when the loss came is one of the redone ones; its time up
                # to the loss is already in `detection`, and its second run is kept work.
                redone = max(0, redone - 1)
            self._redone_pending += redone
            self._failure_at = None

    def report(self, failures: int) -> dict[str, Any]:
        """The figures `TorchTrainer.goodput()` returns."""
        lost = {cause: round(seconds, 6) for cause, seconds in self.lost_s.items()}
        productive = max(0.0, self.wall_s - sum(self.lost_s.values()))
        return {
            "wall_s": round(self.wall_s, 6),
            "productive_s": round(productive, 6),
            "lost_s": lost,
            "steps_redone": self.steps_redone,
            "failures": failures,
            "goodput": productive / self.wall_s if self.wall_s > 0 else 1.0,
        }
