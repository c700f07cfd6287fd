"""Stopping every worker at the same window boundary when the driver has a change to make.

Inside a `train()` call the driver only waits on the workers, so the workers look themselves for
a reason to hand the group back early: a node of theirs that Ray is draining (a preemption
notice: the driver moves them off it), or a spare started beside a group that trains on smaller
after a loss which is now up (the driver lets it join). `BoundaryWatch` is a step hook: at a boundary
between two accumulation windows (every step without accumulation: nothing accumulated is then
lost when workers leave or join) every so often rank 0 looks (asking Ray for the draining nodes and `ray.wait`-ing on the
spares' readiness refs with no timeout: about a millisecond) and broadcasts the answer, with the
number of steps until the next look, to every worker. All of them thus stop at the same boundary
and the call returns saying why (`stopped_for`), to be continued by the driver after its change. A look costs one
small broadcast; rank 0 spaces the looks so that they come about once per `interval_s` of
training, whatever a step takes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from raysgd._internal.protocol import DRAIN, SPARE, WatchSpec
from raysgd_core import draining_nodes, get_context
from raysgd_operator import OperatorRunner

__all__ = ["BoundaryWatch"]


#: The answer's code for each reason to stop (what rank 0 broadcasts).
_REASONS = {1: DRAIN, 2: SPARE}


def _any_up(joining: Sequence[Sequence[Any]]) -> bool:
    """Whether every ref of at least one entry of `joining` is done (without waiting)."""
    import ray

    refs = [ref for spare in joining for ref in spare]
    if not refs:
        return False
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    done_set = set(done)
    return any(all(ref in done_set for ref in spare) for spare in joining)


class BoundaryWatch:
    """The step hook that stops every worker at the same boundary (see the module docstring)."""

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner
        self.spec: Optional[WatchSpec] = None
        #: Why the call stopped early (`DRAIN`, `SPARE`), None when it did not.
        self.stopped_for: Optional[str] = None
        self._next_check = 0
        self._since: tuple[int, float] = (0, 0.0)
        runner.add_step_hook(self._on_step)

    def arm(self, spec: Optional[WatchSpec]) -> None:
        """Watch `spec` from the call's first step boundary on (None: watch nothing). Every worker
        arms at the same step, so the looks fall on the same boundaries everywhere."""
        self.spec = spec
        self.stopped_for = None
        self._next_check = self.runner.position.step + 1
        self._since = (self.runner.position.step, time.monotonic())

    def _on_step(self) -> None:
        spec = self.spec
        if (
            spec is None
            or self.runner.position.step < self._next_check
            or not self.runner.position.at_window_start
        ):
            return
        import torch.distributed as dist

        ctx = get_context()
        steps = 1
        stop = 0
        if ctx.world_rank == 0:
            if spec.nodes and spec.nodes & set(draining_nodes()):
                stop = 1  # a move comes first: a spare can join after it
            elif _any_up(spec.joining):
                stop = 2
            done, since = self._since
            per_step = (time.monotonic() - since) / max(1, self.runner.position.step - done)
            steps = max(1, math.ceil(spec.interval_s / per_step)) if per_step > 0 else 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
            answer = torch.tensor([stop, steps], dtype=torch.int64, device=device)
            dist.broadcast(answer, src=0)
            stop, steps = (int(v) for v in answer.tolist())
        self._next_check = self.runner.position.step + steps
        self._since = (self.runner.position.step, time.monotonic())
        if stop:
            self.stopped_for = _REASONS[stop]
            self.runner.request_stop()
