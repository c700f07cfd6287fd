"""Acting on preemption notices: move workers off a node Ray is draining, before it goes.

A preemptible machine gets a warning before it is reclaimed, which a Ray cluster turns into a drain
of the node with a deadline (`raysgd_core.drains`). The trainer looks for drains of the nodes that
hold its workers or spares at the start of every `train()` call, and the workers look inside the
call (`drain_watch`), stopping together at a step boundary when they see one. Either way
`Preemption.handle` then moves the workers off those nodes (`Recovery.move_off`: spares or new
workers elsewhere take over, with the state of the workers that stay, or shrink when there is no
room), and the call goes on from that step: no step is redone and no row trained twice.

What cannot move: rank 0 with ``use_local=True`` runs in the driver's process, so it goes down with
its node. The trainer then writes a checkpoint at once when it has a `checkpoint_dir` (a driver
restarted elsewhere can `load` it) and says so; the other workers on that node still move. A node
nothing could be moved off (no room, every worker on it) is not watched again: its loss, when it
comes, is recovered like any loss.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import ray

from raysgd._internal.drain_watch import WatchSpec
from raysgd_core import WorkerGroup, draining_nodes

__all__ = ["WATCH_INTERVAL_S", "Preemption"]

logger = logging.getLogger("raysgd.recovery")

#: How often, in seconds of training, the workers look for drains inside a call.
WATCH_INTERVAL_S = 1.0


def _multi_node() -> bool:
    """Whether the cluster has another node: on one node nothing can be moved anywhere."""
    try:
        return sum(1 for n in ray.nodes() if n.get("Alive")) > 1
    except Exception:
        return False


class Preemption:
    """The trainer's handling of drains (see the module docstring)."""

    def __init__(
        self,
        *,
        group: Callable[[], WorkerGroup],
        recovery: Any,
        before_retire: Callable[[list[int]], None],
        local_checkpoint: Callable[[], Optional[str]],
    ) -> None:
        self._group = group
        self._recovery = recovery
        self._before_retire = before_retire
        self._local_checkpoint = local_checkpoint
        #: Nodes nothing could be moved off: not watched any more.
        self.unmovable: set[str] = set()

    def watch_spec(self) -> Optional[WatchSpec]:
        """What the workers watch during the next call (None on a one-node cluster)."""
        if not _multi_node():
            return None
        # The driver's node too (use_local): rank 0 cannot leave it, but the notice must reach
        # the trainer within the call, while a checkpoint can still be written.
        nodes = {w.node_id for w in self._group().workers} - self.unmovable
        return WatchSpec(frozenset(nodes), WATCH_INTERVAL_S) if nodes else None

    def handle(self, *, max_retries: int) -> bool:
        """Move every worker and spare off the draining nodes it is on; True if any moved."""
        group = self._group()
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
        moved = self._recovery.move_off(
            leaving,
            notices,
            max_retries=max_retries,
            before_retire=lambda: self._before_retire(leaving),
        )
        if not moved:
            # Not again for these nodes: their loss, when it comes, is recovered like any other.
            self.unmovable |= set(notices)
        return moved

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
