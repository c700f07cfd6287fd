"""Preemption notices: a node Ray is draining (a spot machine's warning) is left before it goes.

A preemptible machine gets a warning before it is reclaimed, which a Ray cluster turns into a drain
of the node with a deadline (`raysgd_core.draining_nodes`). The workers are moved off such a node at
a step boundary, so that no step is redone and no row trained twice; a move is not a failure.

- Inside a `train()` call the workers look themselves (`boundary_watch`): all of them stop at the
  same step boundary when a node of theirs drains, and the call returns early, saying so.
- The driver (`Preemption`) looks at the start of every `train()` call and after one stopped for a drain, and
  moves the workers off the draining nodes with one resize of the recovery loop: the state of this
  boundary is handed over (a sharded state's parts go to workers that stay), the leaving workers
  are retired, and the scaling policy sizes the group: spares or new workers
  elsewhere take over, or the group shrinks where there is no room. When every worker is on a
  draining node, replacements join first, while the state is still there to give them.

What cannot move: rank 0 with ``use_local=True`` runs in the driver's process, so it goes down with
its node. The trainer then writes a checkpoint at once when it has a `checkpoint_dir` (a driver
restarted elsewhere can `load` it) and says so; the other workers on that node still move. A node
nothing could be moved off (no room, every worker on it) is not watched again: its loss, when it
comes, is recovered like any loss (and counted as a preemption: `Losses.preempted`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import ray

from raysgd._internal.driver.checkpoint_schedule import Checkpoints
from raysgd._internal.driver.events import EventKind, short_node
from raysgd._internal.driver.group_view import RestorableState
from raysgd._internal.driver.recovery import Recovery
from raysgd_core import WorkerGroup, draining_nodes

__all__ = ["SPARE_WAIT_S", "Preemption"]

logger = logging.getLogger("raysgd.recovery")

#: The longest a move waits for spare workers still starting before it sizes the group.
SPARE_WAIT_S = 10.0


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
        state: The training state, handed over before workers leave (`TrainingState.hand_over`).
        checkpoints: Where a checkpoint goes when rank 0 cannot move (`Checkpoints.at_notice`).
    """

    def __init__(
        self,
        *,
        group: WorkerGroup,
        recovery: Recovery,
        state: RestorableState,
        checkpoints: Checkpoints,
    ) -> None:
        self._group = group
        self._recovery = recovery
        self._state = state
        self._checkpoints = checkpoints
        #: Nodes nothing could be moved off: not watched any more.
        self.unmovable: set[str] = set()

    def watched_nodes(self) -> frozenset[str]:
        """The nodes the workers watch for drains during the next call (none on a one-node
        cluster)."""
        if not _multi_node():
            return frozenset()
        # The driver's node too (use_local): rank 0 cannot leave it, but the notice must reach
        # the trainer within the call, while a checkpoint can still be written.
        return frozenset({w.node_id for w in self._group.workers} - self.unmovable)

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
        timeout_s = _until(deadline, recovery.restart_timeout_s)
        # A spare still starting (a group formed moments ago) is room the scaling policy should
        # see: wait for it, within a part of the time the notice leaves.
        self._group.await_spares(min(SPARE_WAIT_S, timeout_s / 3))
        resizes = []
        recovery.losses.draining = frozenset(nodes)
        try:
            if len(leaving) >= before:
                # Everyone is on a draining node: the replacements come in first, while the
                # state is still there to give them.
                self._state.hand_over(leaving)
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
                # Sized by the scaling policy once the leaving workers are gone.
                resizes.append(
                    recovery.resize(None, "preemption", timeout_s=timeout_s, leaving=leaving)
                )
        finally:
            recovery.losses.draining = frozenset()
        lost = any(r.lost is not None for r in resizes)
        if lost or not resizes[-1].ok:
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
        path = self._checkpoints.at_notice()
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
