"""Preemption notices: a node Ray is draining (a spot machine's warning) is left before it goes.

A preemptible machine gets a warning before it is reclaimed, which a Ray cluster turns into a drain
of the node with a deadline (`raysgd_core.draining_nodes`). The workers are moved off such a node at
a step boundary, so that no step is redone and no row trained twice; a move is not a failure.

- Inside a `train()` call the workers look themselves (`boundary_watch`): all of them stop at the
  same step boundary when a node of theirs drains, and the call returns early, saying so.
- The driver looks at the start of every `train()` call and after one stopped for a drain:
  `Drains.notice` says which of the group's nodes drain and which ranks must leave them, and
  `Moves` moves them (the run's MOVING phase): the state of this boundary is handed over, the
  leaving workers are retired, and the scaling policy sizes the group.

What cannot move: rank 0 with ``use_local=True`` runs in the driver's process, so it goes down with
its node. A checkpoint is then written at once when the trainer has a `checkpoint_dir` (a driver
restarted elsewhere can `load` it), and the log says so; the other workers on that node still
move. A node nothing could be moved off (no room, every worker on it) is not watched again: its
loss, when it comes, is recovered like any loss (and counted as a preemption).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from raysgd._internal.driver.checkpoints import Checkpoints
from raysgd._internal.driver.decide import move_timeout
from raysgd._internal.driver.events import RecoveryLog, short_node
from raysgd._internal.driver.group_view import ClusterView, ElasticGroup, RestorableState
from raysgd._internal.driver.guard import CallGuard
from raysgd._internal.driver.phases import Phase, PhaseWriter
from raysgd._internal.driver.resize import SPARE_WAIT_S, Resizer

__all__ = ["DrainNotice", "Drains", "Moves"]

logger = logging.getLogger("raysgd.recovery")


@dataclass(frozen=True)
class DrainNotice:
    """The group's nodes being drained, and who must leave them.

    Attributes:
        nodes: Draining node -> its deadline (a `time.time()` timestamp), or None for none.
        leaving: The ranks on those nodes that can move.
        local_node: The driver's node, when it drains and rank 0 runs there (``use_local``).
    """

    nodes: dict[str, Optional[float]]
    leaving: tuple[int, ...]
    local_node: Optional[str]


class Drains:
    """What the trainer knows of drains (see the module docstring).

    Args:
        group: The trainer's worker group.
        cluster: Where the drains are read.
        checkpoints: Where a checkpoint goes when rank 0 cannot move (`Checkpoints.at_notice`).
    """

    def __init__(
        self, *, group: ElasticGroup, cluster: ClusterView, checkpoints: Optional[Checkpoints]
    ) -> None:
        self._group = group
        self._cluster = cluster
        self._checkpoints = checkpoints
        #: Nodes nothing could be moved off: not watched any more.
        self.unmovable: set[str] = set()

    def watched_nodes(self) -> frozenset[str]:
        """The nodes the workers watch for drains during the next call (none on a one-node
        cluster)."""
        if not self._cluster.multi_node():
            return frozenset()
        # The driver's node too (use_local): rank 0 cannot leave it, but the notice must reach
        # the trainer within the call, while a checkpoint can still be written.
        return frozenset({w.node_id for w in self._group.workers} - self.unmovable)

    def notice(self) -> Optional[DrainNotice]:
        """The drains of the group's workers' and spares' nodes now (None when there are none)."""
        draining = self._cluster.draining()
        if not draining:
            return None
        group = self._group
        ours = {w.node_id for w in group.workers} | {s.node_id for s in group.spares}
        nodes = {n: d for n, d in draining.items() if n in ours and n not in self.unmovable}
        if not nodes:
            return None
        local = [w.node_id for w in group.workers if w.is_local and w.node_id in nodes]
        leaving = tuple(w.rank for w in group.workers if w.node_id in nodes and not w.is_local)
        return DrainNotice(nodes, leaving, local[0] if local else None)

    def not_moved(self, nodes: dict[str, Optional[float]]) -> None:
        """Nothing could be moved off `nodes`: they are not watched again (their loss, when it
        comes, is recovered like any other)."""
        self.unmovable |= set(nodes)

    def rank0_cannot_move(self, node: str) -> None:
        """Rank 0 runs in this process on draining `node`: write a checkpoint now, when there is
        somewhere to write it, and say so."""
        self.unmovable.add(node)
        path = self._checkpoints.at_notice() if self._checkpoints is not None else None
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


class Moves:
    """Moving the workers of `group` off draining nodes (`drains` says which), its `state` handed
    over first; each resize by `resizer`, each phase entered through `run`, each move recorded in
    `log`. Rank 0 in the driver's process cannot move: `guard` writes its checkpoint."""

    def __init__(
        self,
        *,
        group: ElasticGroup,
        state: RestorableState,
        drains: Drains,
        resizer: Resizer,
        guard: CallGuard,
        log: RecoveryLog,
        run: PhaseWriter,
    ) -> None:
        self._group = group
        self._state = state
        self._drains = drains
        self._resizer = resizer
        self._guard = guard
        self._log = log
        self._run = run
        #: The draining nodes being moved off (the MOVING phase's transitions carry them).
        self.moving_off: frozenset[str] = frozenset()

    def check(self, **what: Any) -> None:
        """Look for drains of the group's nodes and move off them (MOVING). `what`: the
        transition into MOVING's other fields; with them MOVING is entered even when no node
        drains any more (the workers stopped for one)."""
        notice = self._drains.notice()
        if notice is None and not what:
            return
        self.moving_off = frozenset(notice.nodes) if notice is not None else frozenset()
        try:
            self._run.enter(Phase.MOVING, **what)
            if notice is not None:
                self._move(notice)
        finally:
            self.moving_off = frozenset()

    def _move(self, notice: DrainNotice) -> None:
        """Move every worker and spare off the draining nodes of `notice`."""
        if notice.local_node is not None:
            self._guard.again_once(self._drains.rank0_cannot_move, notice.local_node)
        if not notice.leaving:
            self._group.replace_spares_on(notice.nodes)
            logger.info("replaced the spare worker(s) on draining node(s) %s", list(notice.nodes))
            return
        if not self.move_off(notice.leaving, notice.nodes):
            self._drains.not_moved(notice.nodes)

    def move_off(self, ranks: Sequence[int], nodes: dict[str, Optional[float]]) -> bool:
        """MOVING: move the workers of `ranks` off `nodes` (draining: node -> deadline, None for
        none) before the deadline; every worker has stopped at the same step boundary. Not a
        failure: neither counted nor charged to any retry budget, and recorded as a "preemption"
        event with the steps its resizes redid (0 unless a worker was lost meanwhile).

        Returns False when the workers could not be moved: nothing started in their place (they
        stay, and the node's loss will be an ordinary one), or a worker was lost during the move
        (the node went before the deadline). Such a loss is counted (as a preemption), and the
        group is left for the next attempt to recover, as after any loss.
        """
        previous, self.moving_off = self.moving_off, frozenset(nodes)
        try:
            if self._run.phase is not Phase.MOVING:
                self._run.enter(Phase.MOVING)
            return self._move_off(sorted(ranks), nodes)
        finally:
            self.moving_off = previous

    def _move_off(self, leaving: list[int], nodes: dict[str, Optional[float]]) -> bool:
        started = time.monotonic()
        deadlines = [d for d in nodes.values() if d is not None]
        deadline = min(deadlines) if deadlines else None
        where = ", ".join(short_node(n) for n in nodes)
        left = f"{deadline - time.time():.1f} s before the deadline" if deadline else "no deadline"
        before = self._group.world_size
        timeout_s = move_timeout(deadline, self._resizer.restart_timeout_s, time.time())
        # A spare still starting (a group formed moments ago) is room the scaling policy should
        # see: wait for it, within a part of the time the notice leaves.
        self._group.await_spares(min(SPARE_WAIT_S, timeout_s / 3))
        resizes = []
        if len(leaving) >= before:
            # Everyone is on a draining node: the replacements come in first, while the state is
            # still there to give them.
            self._state.hand_over(leaving)
            grown = self._resizer.resize(before + len(leaving), "preemption", timeout_s=timeout_s)
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
                self._resizer.resize(None, "preemption", timeout_s=timeout_s, leaving=leaving)
            )
        if any(r.lost is not None for r in resizes) or not resizes[-1].ok:
            return self._not_moved(
                leaving,
                nodes,
                before,
                f"moving rank(s) {leaving} off draining node(s) {where} "
                f"({left}) failed: a worker was lost, or none could start",
            )
        self._log.record_move(
            leaving,
            nodes,
            left,
            took_s=time.monotonic() - started,
            before=before,
            after=self._group.world_size,
            redone=sum(r.steps_redone for r in resizes),
        )
        return True

    def _not_moved(
        self, leaving: Sequence[int], nodes: dict[str, Optional[float]], before: int, what: str
    ) -> bool:
        """Record a move that did not happen (a warning event of the preemption kind)."""
        self._log.record_not_moved(
            what,
            leaving,
            nodes,
            before=before,
            after=self._group.world_size,
            recovering=self._group.needs_recovery,
        )
        return False
