"""Preemption notices: a node Ray is draining (a spot machine's warning) is left before it goes.

A preemptible machine gets a warning before it is reclaimed, which a Ray cluster turns into a drain
of the node with a deadline (`raysgd_core.draining_nodes`). The workers are moved off such a node at
a step boundary, so that no step is redone and no row trained twice; a move is not a failure.

- Inside a `train()` call the driver waits on the workers, so they look themselves (`DrainWatch`, a
  step hook): at a step boundary every so often rank 0 asks Ray which nodes are draining (about a
  millisecond) and broadcasts the answer, with the number of steps until the next look, to every
  worker. All of them thus stop at the same step boundary when a node of theirs drains, and the
  call returns early ("yielded"). A look costs one small broadcast; rank 0 spaces the looks so
  that they come about once per `interval_s` of training, whatever a step takes.
- The driver (`Preemption`) looks at the start of every `train()` call and after a yielded one, and
  moves the workers off the draining nodes with one resize of the recovery loop: the state of this
  boundary is handed over (a sharded state's parts go to workers that stay), the leaving workers
  are retired, and the scaling policy sizes the group: spares or new workers
  elsewhere take over, or the group shrinks where there is no room. When every worker is on a
  draining node, replacements join first, while the state is still there to give them.

What cannot move: rank 0 with ``use_local=True`` runs in the driver's process, so it goes down with
its node. The trainer then writes a checkpoint at once when it has a `checkpoint_dir` (a driver
restarted elsewhere can `load` it) and says so; the other workers on that node still move. A node
nothing could be moved off (no room, every worker on it) is not watched again: its loss, when it
comes, is recovered like any loss (and counted as a preemption: `Recovery.preempted`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import ray
import torch

from raysgd._internal.recovery_log import EventKind, short_node
from raysgd_core import WorkerGroup, draining_nodes, get_context
from raysgd_operator import OperatorRunner

if TYPE_CHECKING:  # the driver's side only: a worker importing its watch loads no recovery loop
    from raysgd._internal.recovery import Recovery

__all__ = [
    "SPARE_WAIT_S",
    "WATCH_INTERVAL_S",
    "WATCH_KEY",
    "DrainWatch",
    "Preemption",
    "WatchSpec",
    "watch_for",
]

logger = logging.getLogger("raysgd.recovery")

#: How often, in seconds of training, the workers look for drains inside a call.
WATCH_INTERVAL_S = 1.0
#: Key of this worker's `DrainWatch` in its store.
WATCH_KEY = "raysgd.drain_watch"
#: The longest a move waits for spare workers still starting before it sizes the group.
SPARE_WAIT_S = 10.0


# ------------------------------------------------------------------------------ on the workers
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


# ------------------------------------------------------------------------------ on the driver
def _multi_node() -> bool:
    """Whether the cluster has another node: on one node nothing can be moved anywhere."""
    try:
        return sum(1 for n in ray.nodes() if n.get("Alive")) > 1
    except Exception:
        return False


class Preemption:
    """The trainer's handling of drains (see the module docstring).

    Args:
        group: The trainer's worker group.
        recovery: The recovery loop, whose resize moves the workers.
        hand_over: Makes the state of this step boundary restorable without the given ranks.
        local_checkpoint: Writes a checkpoint now (None when the trainer has no checkpoint_dir).
    """

    def __init__(
        self,
        *,
        group: WorkerGroup,
        recovery: Recovery,
        hand_over: Callable[[Sequence[int]], None],
        local_checkpoint: Callable[[], Optional[str]],
    ) -> None:
        self._group = group
        self._recovery = recovery
        self._hand_over = hand_over
        self._local_checkpoint = local_checkpoint
        #: Nodes nothing could be moved off: not watched any more.
        self.unmovable: set[str] = set()

    def watch_spec(self) -> Optional[WatchSpec]:
        """What the workers watch during the next call (None on a one-node cluster)."""
        if not _multi_node():
            return None
        # The driver's node too (use_local): rank 0 cannot leave it, but the notice must reach
        # the trainer within the call, while a checkpoint can still be written.
        nodes = {w.node_id for w in self._group.workers} - self.unmovable
        return WatchSpec(frozenset(nodes), WATCH_INTERVAL_S) if nodes else None

    def handle(self) -> bool:
        """Move every worker and spare off the draining nodes it is on; True if any moved."""
        group = self._group
        draining = draining_nodes()
        if not draining:
            return False
        ours = {w.node_id for w in group.workers} | {s.node_id for s in group.spares}
        notices = {n: d for n, d in draining.items() if n in ours and n not in self.unmovable}
        if not notices:
            return False
        local = [w for w in group.workers if w.is_local and w.node_id in notices]
        if local:
            self._local_rank_cannot_move(local[0].node_id)
        leaving = [w.rank for w in group.workers if w.node_id in notices and not w.is_local]
        if not leaving:
            group.replace_spares_on(notices)
            logger.info("replaced the spare worker(s) on draining node(s) %s", list(notices))
            return False
        moved = self.move_off(leaving, notices)
        if not moved:
            # Not again for these nodes: their loss, when it comes, is recovered like any other.
            self.unmovable |= set(notices)
        return moved

    def move_off(self, ranks: Sequence[int], nodes: dict[str, Optional[float]]) -> bool:
        """Move the workers of `ranks` off `nodes` (draining: node -> deadline, None for none)
        before the deadline; every worker has stopped at the same step boundary. Not a failure:
        neither counted nor charged to any retry budget, and recorded as a "preemption" event with
        the steps its resizes redid (0 unless a worker was lost meanwhile).

        Returns False when the workers could not be moved: nothing started in their place (they
        stay, and the node's loss will be an ordinary one), or a worker was lost during the move
        (the node went before the deadline). Such a loss is counted (as a preemption), and the
        group is left for the next call to recover, as after any loss.
        """
        recovery = self._recovery
        started = time.monotonic()
        deadlines = [d for d in nodes.values() if d is not None]
        deadline = min(deadlines) if deadlines else None
        where = ", ".join(short_node(n) for n in nodes)
        left = f"{deadline - time.time():.1f} s before the deadline" if deadline else "no deadline"
        before = self._group.world_size
        leaving = sorted(ranks)
        hand_over = lambda: self._hand_over(leaving)  # noqa: E731
        timeout_s = _until(deadline, recovery.restart_timeout_s)
        # A spare still starting (a group formed moments ago) is room the scaling policy should
        # see: wait for it, within a part of the time the notice leaves.
        self._group.await_spares(min(SPARE_WAIT_S, timeout_s / 3))
        resizes = []
        recovery.draining = frozenset(nodes)
        try:
            if len(leaving) >= before:
                # Everyone is on a draining node: the replacements come in first, while the
                # state is still there to give them.
                hand_over()
                grown = recovery.resize(before + len(leaving), "preemption", timeout_s=timeout_s)
                resizes.append(grown)
                if grown.lost is None and self._group.world_size <= before:
                    return self._not_moved(
                        leaving,
                        nodes,
                        before,
                        f"every worker is on draining node(s) {where} "
                        f"({left}) and no replacement started: they stay",
                    )
            if all(r.lost is None for r in resizes):
                staying = self._group.world_size - len(leaving)
                resizes.append(
                    recovery.resize(
                        lambda: recovery.size_for_move(alive=staying),
                        "preemption",
                        timeout_s=timeout_s,
                        leaving=leaving,
                        hand_over=hand_over,
                    )
                )
        finally:
            recovery.draining = frozenset()
        lost = next((r.lost for r in resizes if r.lost is not None), None)
        if lost is not None:
            recovery.draining = frozenset(nodes)
            try:
                recovery.count_loss(lost, during_restart=True)
            finally:
                recovery.draining = frozenset()
        if lost is not None or not resizes[-1].ok:
            return self._not_moved(
                leaving,
                nodes,
                before,
                f"moving rank(s) {leaving} off draining node(s) {where} "
                f"({left}) failed: a worker was lost, or none could start",
            )
        took = time.monotonic() - started
        redone = sum(r.steps_redone for r in resizes)
        recovery.log.record(
            EventKind.PREEMPTION,
            f"moved rank(s) {leaving} off draining node(s) {where} ({left}) in {took:.2f} s: "
            f"{before} -> {self._group.world_size} worker(s), {redone} step(s) redone",
            ranks=tuple(leaving),
            nodes=tuple(nodes),
            duration_s=took,
            num_workers_before=before,
            num_workers_after=self._group.world_size,
            steps_redone=redone,
        )
        return True

    def _not_moved(
        self, leaving: Sequence[int], nodes: dict[str, Optional[float]], before: int, what: str
    ) -> bool:
        """Record a move that did not happen (a warning event of the preemption kind)."""
        recovered = (
            "the next call recovers the group"
            if self._group.needs_recovery
            else "their loss will be recovered from a checkpoint"
        )
        self._recovery.log.record(
            EventKind.PREEMPTION,
            f"{what}; {recovered}",
            level=logging.WARNING,
            nodes=tuple(nodes),
            ranks=tuple(leaving),
            num_workers_before=before,
            num_workers_after=self._group.world_size,
        )
        return False

    def _local_rank_cannot_move(self, node: str) -> None:
        self.unmovable.add(node)
        path = self._local_checkpoint()
        if path is None:
            logger.warning(
                "the driver's node %s is draining: rank 0 runs in this process (use_local=True) "
                "and cannot move; give the trainer a checkpoint_dir to have a checkpoint written "
                "at such a notice",
                node[:8],
            )
        else:
            logger.warning(
                "the driver's node %s is draining: rank 0 runs in this process (use_local=True) "
                "and cannot move; wrote checkpoint %s (load it in a trainer started elsewhere)",
                node[:8],
                path,
            )


def _until(deadline: Optional[float], default_s: float) -> float:
    """How long a restart for a move may take: up to the deadline, less a margin."""
    if deadline is None:
        return default_s
    return max(1.0, min(default_s, deadline - time.time() - 2.0))
