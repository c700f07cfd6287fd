"""What the run controller works on, as narrow views: the worker group (`ElasticGroup`), the
training state (`RestorableState`) and what the cluster says (`ClusterView`; `RayCluster` asks
Ray). Each can be stood in for, so that the controller's every path runs without Ray."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Protocol

from raysgd_core import RecoveryReport, draining_nodes, preempted_nodes

__all__ = ["ClusterView", "ElasticGroup", "RayCluster", "RestorableState", "fitting_now"]

logger = logging.getLogger("raysgd.recovery")


class ElasticGroup(Protocol):
    """What the run controller needs of a worker group; `raysgd_core.WorkerGroup` is one."""

    @property
    def world_size(self) -> int:
        """Workers in the current process group (the live size)."""

    @property
    def needs_recovery(self) -> bool:
        """A worker raised or died: `recover` must run before the next call."""

    def recover(self, num_workers: int, *, timeout_s: float) -> RecoveryReport:
        """Re-form the group with up to `num_workers` workers, keeping the healthy ones."""

    def estimate_fitting(self) -> int:
        """A cheap guess of how many more workers the cluster has room for."""

    def retire(self, ranks: Sequence[int]) -> None:
        """Stop healthy workers on purpose (their node is going away); `recover` follows."""

    @property
    def workers(self) -> Sequence[Any]:
        """The workers in rank order, each with its `rank`, `node_id` and `is_local`."""

    @property
    def spares(self) -> Sequence[object]:
        """The spare workers that are up (`recover` promotes them first)."""

    @property
    def spares_starting(self) -> int:
        """Spare workers started but not up yet."""

    def start_spares(self, count: int) -> None:
        """Start `count` more spares now: replacements that join once they are up."""

    def spare_readiness(self) -> list[tuple[Any, ...]]:
        """For each spare, the refs that are all done once it is up."""

    def await_spares(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the spares still starting; how many are up."""

    def replace_spares_on(self, nodes: Iterable[str]) -> None:
        """Replace the spares on `nodes` (draining) by spares elsewhere."""

    def execute(self, fn: Any, *args: Any) -> list[Any]:
        """Run `fn(*args)` on every worker; the results in rank order."""

    def execute_single(self, rank: int, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the worker of `rank`."""


class RestorableState(Protocol):
    """What the run controller needs of the training state; `TrainingState` is one."""

    def restore(self, report: RecoveryReport) -> Any:
        """After a resize (`report`: what the group did): make every worker of the re-formed
        group ready to go on; may return a `RestoreOutcome`. `StateLostError` when there is no
        state to go on from."""

    def hand_over(self, leaving: Sequence[int]) -> None:
        """At a step boundary, before the workers of `leaving` go on purpose (or spares join:
        none leave): make the state of this boundary restorable without them."""

    def after_train(self, step: int, epochs: int) -> None:
        """A train call ended with the workers at `step`, `epochs` finished."""


class ClusterView(Protocol):
    """What the run controller asks of the cluster; `RayCluster` asks Ray."""

    def draining(self) -> dict[str, Optional[float]]:
        """Nodes being drained: node id -> deadline (a `time.time()` timestamp) or None."""

    def multi_node(self) -> bool:
        """Whether the cluster has more than one live node (else nothing can move anywhere)."""

    def live_count(self, nodes: Sequence[str]) -> int:
        """How many of `nodes` (one entry per lost worker) are still alive: their freed slots
        are room at once."""

    def preempted(self, nodes: Iterable[str]) -> set[str]:
        """Those of `nodes` reported gone after a preemption drain."""


class RayCluster:
    """`ClusterView` from Ray's public state (`ray.nodes()`, the drains `raysgd_core` reads)."""

    def draining(self) -> dict[str, Optional[float]]:
        return draining_nodes()

    def multi_node(self) -> bool:
        return sum(1 for _ in self._alive()) > 1

    def live_count(self, nodes: Sequence[str]) -> int:
        if not nodes:
            return 0
        alive = set(self._alive())
        return sum(1 for node in nodes if node in alive)

    def preempted(self, nodes: Iterable[str]) -> set[str]:
        return preempted_nodes(nodes)

    @staticmethod
    def _alive() -> list[str]:
        import ray

        try:
            return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        except Exception:  # no answer: no node counted on (a lookup must never break a call)
            logger.debug("ray.nodes() failed", exc_info=True)
            return []


def fitting_now(group: ElasticGroup) -> Optional[int]:
    """How many more workers the cluster has room for, by the group's cheap estimate (None when
    it could not make one: `decide.fitting` says what that means)."""
    try:
        return int(group.estimate_fitting())
    except Exception:
        logger.debug("estimate_fitting failed", exc_info=True)
        return None
