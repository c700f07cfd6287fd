"""How long a worker waits for a peer in a collective: a bound tied to the measured step time.

A peer that goes silent (a frozen or partitioned node, a process hung on a live one) keeps its
connections open, so the ranks waiting for it in a collective would wait for the process group's
whole timeout. Instead, every worker bounds each collective of a training step:

    step bound = min(slow bound, max(peer_timeout_s, STEP_MULTIPLE x the slowest of the last
                 RECENT_STEPS steps))

so that a rank waiting on a silent peer raises within seconds, keeps its process and state, and
the driver learns which rank did not answer (`raysgd_core.GroupOptions.peer_grace_s`). The peer
that never answers is the one lost.

Everything that is not a measured step waits up to the slow bound, which is the process group's
own timeout (`slow_bound`, what the trainer forms its group with): the steps before one was
measured (caches warm up, DDP builds its buckets), every step until a whole call has run with
``compile=True`` (compiling, and recompiling for the epoch's last batch), validation, checkpoints
and restores. The first step of each later call (its data loader starts) waits up to
`FIRST_STEP_MULTIPLE` x `peer_timeout_s`, or the step bound when that is longer. A step's duration is the time between two
step boundaries of one call, its data loading included.

A rank that fails or dies releases every rank at once (the group is aborted: see raysgd_core's
`abort`), so these bounds matter for silent peers only: the first rank that waits out its bound
has the group aborted on the others, so a silent peer costs one bound, whatever the group's size.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Any, Optional, Union

from raysgd_base import check_number
from raysgd_core import get_context, set_collective_timeout
from raysgd_operator import OperatorRunner, TrainingOptions

__all__ = [
    "RECENT_STEPS",
    "SLOW_FLOOR_S",
    "STEP_MULTIPLE",
    "CollectiveBound",
    "slow_bound",
]

#: A step's collectives may take this many times the slowest recent step before a peer counts as
#: silent: room for a slow batch, a garbage-collection pause or a snapshot step.
STEP_MULTIPLE = 5.0
#: How many recent steps the slowest one is taken from.
RECENT_STEPS = 20
#: The slow bound is at least this (and `SLOW_MULTIPLE` x `peer_timeout_s`).
SLOW_FLOOR_S = 120.0
SLOW_MULTIPLE = 12.0
#: The first step of a call after the first: this many times `peer_timeout_s` (or the step bound).
FIRST_STEP_MULTIPLE = 3.0
#: The bound is set again only when it moves by more than this fraction.
_HYSTERESIS = 0.25


def slow_bound(timeout_s: Union[float, timedelta], peer_timeout_s: float) -> float:
    """The bound of everything that is not a measured step (see the module docstring), never
    above the user's collective timeout `timeout_s`."""
    if isinstance(timeout_s, timedelta):
        timeout_s = timeout_s.total_seconds()
    check_number("timeout_s", timeout_s, above=0)
    return min(float(timeout_s), max(SLOW_FLOOR_S, SLOW_MULTIPLE * float(peer_timeout_s)))


class CollectiveBound:
    """The step hook that sets this worker's collective bound (see the module docstring).

    Args:
        runner: The worker's runner, whose step boundaries are measured.
        options: Its options (`peer_timeout_s`, `compile`).
    """

    def __init__(self, runner: OperatorRunner, options: TrainingOptions) -> None:
        self.runner = runner
        self.floor_s = float(options.peer_timeout_s)
        #: Compiled models keep the slow bound until one whole call has run.
        self._warm = not options.compile
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._last_boundary: Optional[float] = None
        self.current_s: Optional[float] = None
        self._group: Any = None
        runner.add_step_hook(self._on_step)

    def begin_call(self, step_hint_s: float = 0.0) -> None:
        """A train call starts: its first step waits up to the first-step bound once steps were
        measured, else up to the slow bound. `step_hint_s`: the group's recent step time, as
        the driver knows it, for a worker that has measured none (one that just joined)."""
        self._last_boundary = None
        if not self._recent and step_hint_s > 0:
            self._recent.append(step_hint_s)
        bound = self.step_bound()
        if bound is None:
            self._set(self.slow_s)
        else:
            self._set(min(self.slow_s, max(FIRST_STEP_MULTIPLE * self.floor_s, bound)))

    def end_call(self, finished: bool) -> None:
        """A train call ended (`finished`: it ran to its end): back to the slow bound."""
        self._last_boundary = None
        self._warm = self._warm or finished
        self._set(self.slow_s)

    @property
    def slow_s(self) -> float:
        """The process group's own timeout, which the slow phases wait up to."""
        return float(get_context().timeout_s)

    def mean_step_s(self) -> float:
        """The mean of the recent steps' durations (0 before one was measured)."""
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def step_bound(self) -> Optional[float]:
        """The bound of the next step's collectives (None: no step measured yet, or a compiled
        model before its first whole call)."""
        if not self._recent or not self._warm:
            return None
        return min(self.slow_s, max(self.floor_s, STEP_MULTIPLE * max(self._recent)))

    def _on_step(self) -> None:
        now = time.monotonic()
        if self._last_boundary is not None:
            self._recent.append(now - self._last_boundary)
        self._last_boundary = now
        bound = self.step_bound()
        if bound is not None:
            self._set(bound)

    def _set(self, seconds: float) -> None:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        current = self.current_s if group is self._group else None
        if current == seconds:
            return
        # Small moves of the step bound are not worth a call; going back to the slow bound is.
        if current is not None and seconds != self.slow_s:
            if abs(seconds - current) <= _HYSTERESIS * current:
                return
        if set_collective_timeout(seconds):
            # A group formed since (a resize) starts with its own timeout: set it again there.
            self.current_s, self._group = seconds, group
