"""Which Ray nodes are being drained: the warning a preemptible machine gives before it goes away.

A cloud's preemption warning (a minute or two before the machine goes) reaches a Ray cluster as a drain of
the node (the autoscaler, KubeRay's SIGTERM handling, or ``ray drain-node`` by hand), with a reason
and a deadline after which the node is killed. Ray stops placing new work on a draining node.

Ray 2.60 answers "which nodes are draining, and until when" only through a private call, made in
one place (`raysgd_core._internal.ray_drains`, which `tests/core/test_drains.py` checks against a
real drain). Where the call is missing, `draining_nodes()` returns nothing and logs once:
preemption notices are then not seen, and a preempted worker is recovered like any lost one.

Only drains of nodes that hold a worker matter, and Ray accepts an idle-termination drain only for a
node that runs nothing (it answers "not accepted" otherwise, which the same test checks), so a
drain of a node with a worker on it is a preemption (or a drain by hand, treated the same).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Optional

__all__ = ["PREEMPTED_DEATH_REASON", "draining_nodes", "preempted_nodes"]

logger = logging.getLogger("raysgd_core")

_warned: list[bool] = []

#: `ray.nodes()`'s "DeathReason" of a node that died after a preemption drain (Ray's
#: `NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED`).
PREEMPTED_DEATH_REASON = 3


def draining_nodes() -> dict[str, Optional[float]]:
    """Nodes being drained: node id (hex) -> the deadline as a `time.time()` timestamp, or None
    when the drain has no deadline. Empty when none is, or when this Ray cannot say."""
    from raysgd_core._internal import ray_drains

    try:
        return ray_drains.read_draining_nodes()
    except Exception as exc:  # Ray moved or changed the call: degrade to no notices
        if not _warned:
            _warned.append(True)
            logger.warning(
                "cannot read which Ray nodes are draining (%s): preemption notices are not seen, "
                "and a preempted worker is recovered like a lost one",
                exc,
            )
        return {}


def preempted_nodes(nodes: Iterable[str]) -> set[str]:
    """Those of `nodes` that Ray reports dead after a preemption drain (from the public
    `ray.nodes()`, whose "DeathReason" says so once the node is gone)."""
    import ray

    wanted = set(nodes)
    if not wanted:
        return set()
    try:
        table = ray.nodes()
    except Exception:  # no answer: nothing is known to be preempted
        return set()
    return {
        str(n["NodeID"])
        for n in table
        if n.get("NodeID") in wanted
        and not n.get("Alive", True)
        and n.get("DeathReason") == PREEMPTED_DEATH_REASON
    }
