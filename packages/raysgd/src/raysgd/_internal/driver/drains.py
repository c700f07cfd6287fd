"""Preemption notices: a node Ray is draining (a spot machine's warning) is left before it goes.

A preemptible machine gets a warning before it is reclaimed, which a Ray cluster turns into a drain
of the node with a deadline (`raysgd_core.draining_nodes`). The workers are moved off such a node at
a step boundary, so that no step is redone and no row trained twice; a move is not a failure.

- Inside a `train()` call the workers look themselves (`boundary_watch`): all of them stop at the
  same step boundary when a node of theirs drains, and the call returns early, saying so.
- The driver looks at the start of every `train()` call and after one stopped for a drain:
  `Drains.notice` says which of the group's nodes drain and which ranks must leave them, and the
  run controller moves them (its MOVING phase): the state of this boundary is handed over, the
  leaving workers are retired, and the scaling policy sizes the group.

What cannot move: rank 0 with ``use_local=True`` runs in the driver's process, so it goes down with
its node. A checkpoint is then written at once when the trainer has a `checkpoint_dir` (a driver
restarted elsewhere can `load` it), and the log says so; the other workers on that node still
move. A node nothing could be moved off (no room, every worker on it) is not watched again: its
loss, when it comes, is recovered like any loss (and counted as a preemption).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from raysgd._internal.driver.checkpoints import Checkpoints
from raysgd._internal.driver.group_view import ClusterView, ElasticGroup

__all__ = ["DrainNotice", "Drains"]

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
