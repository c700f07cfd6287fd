"""Noticing, inside a `train()` call, that a node holding a worker is about to be reclaimed.

The driver waits on the workers while they train, so the workers look themselves: at a step
boundary every so often, rank 0 asks Ray which nodes are draining (`raysgd_core.draining_nodes`,
about a millisecond) and broadcasts the answer, with the number of steps until the next look, to
every worker. All of them thus stop at the same step boundary when a node of theirs drains, and the
call returns early ("yielded"); the trainer moves the workers off the node and the call goes on
from that step. A look costs one small broadcast that the workers wait for; rank 0 spaces the looks
so that they come about once per `interval_s` of training, whatever a step takes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from raysgd_core import draining_nodes, get_context
from raysgd_operator import OperatorRunner

__all__ = ["WATCH_KEY", "DrainWatch", "WatchSpec", "watch_for"]

#: Key of this worker's `DrainWatch` in its store.
WATCH_KEY = "raysgd.drain_watch"


@dataclass(frozen=True)
class WatchSpec:
    """What a `train()` call watches: the nodes of its workers, and how often (seconds)."""

    nodes: frozenset[str]
    interval_s: float = 1.0


class DrainWatch:
    """The step hook that looks for draining nodes (see the module docstring)."""

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner
        self.nodes: Optional[frozenset[str]] = None
        self.interval_s = 1.0
        self._next_check = 0
        self._since: tuple[int, float] = (0, 0.0)
        runner.add_step_hook(self._on_step)

    def arm(self, spec: Optional[WatchSpec]) -> None:
        """Watch `spec.nodes` from the call's first step boundary on (None: watch nothing). Every
        worker arms at the same step, so the looks fall on the same boundaries everywhere."""
        self.nodes = None if spec is None else frozenset(spec.nodes)
        if spec is not None:
            self.interval_s = spec.interval_s
        self._next_check = self.runner.step + 1
        self._since = (self.runner.step, time.monotonic())

    def _on_step(self) -> None:
        if self.nodes is None or self.runner.step < self._next_check:
            return
        import torch.distributed as dist

        ctx = get_context()
        steps = 1
        draining = 0
        if ctx.world_rank == 0:
            draining = int(bool(self.nodes & set(draining_nodes())))
            done, since = self._since
            per_step = (time.monotonic() - since) / max(1, self.runner.step - done)
            steps = max(1, math.ceil(self.interval_s / per_step)) if per_step > 0 else 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
            answer = torch.tensor([draining, steps], dtype=torch.int64, device=device)
            dist.broadcast(answer, src=0)
            draining, steps = (int(v) for v in answer.tolist())
        self._next_check = self.runner.step + steps
        self._since = (self.runner.step, time.monotonic())
        if draining:
            self.runner.request_stop()


def watch_for(runner: OperatorRunner, spec: Optional[WatchSpec]) -> None:
    """Arm this worker's watch for the call about to run (made on first use, per runner)."""
    store = get_context().store
    watch: Optional[DrainWatch] = store.get(WATCH_KEY)
    if watch is None or watch.runner is not runner:
        if spec is None:
            return
        watch = store[WATCH_KEY] = DrainWatch(runner)
    watch.arm(spec)
