"""A spot machine reclaimed, on one machine: a `ray.cluster_utils.Cluster` whose node gets Ray's
preemption notice (the real ``ray drain-node`` command, as KubeRay or the autoscaler issue it) and
is removed at the notice's deadline, as a cloud takes the machine back.

Used by `bench:preemption` (the move itself) and `bench:goodput` (one drain in a run).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

__all__ = ["Reclaimer", "cluster", "drain_node", "timeline_node", "worker_nodes"]


@contextlib.contextmanager
def cluster(nodes: int = 3) -> Iterator[Any]:
    """A connected `Cluster`: a head with no CPU (it holds no worker, so it is never the one
    drained) and `nodes` nodes of 1 CPU each."""
    import ray
    from ray.cluster_utils import Cluster

    started = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        for _ in range(nodes):
            started.add_node(num_cpus=1)
        started.wait_for_nodes()
        ray.init(address=started.address, log_to_driver=False)
        yield started
    finally:
        ray.shutdown()
        started.shutdown()


def drain_node(address: str, node_id: str, deadline_s: int) -> None:
    """``ray drain-node`` with a preemption reason and a deadline (it only marks the node: whoever
    drains must take it away)."""
    subprocess.run(
        [
            sys.executable, "-m", "ray.scripts.scripts", "drain-node",
            "--address", address, "--node-id", node_id,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
            "--deadline-remaining-seconds", str(deadline_s),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip


class Reclaimer:
    """Drains `victim()`'s node once `ready()` is true and removes it at the deadline, from a
    thread; a run over before then (`stop()`) keeps its node.

    `times` gets the wall-clock moments of the notice (``"notice"``) and of the removal
    (``"reclaimed"``).
    """

    def __init__(
        self,
        started: Any,
        ready: Callable[[], bool],
        victim: Callable[[], str],
        deadline_s: int,
    ) -> None:
        self.times: dict[str, float] = {}
        self._cluster, self._ready, self._victim = started, ready, victim
        self._deadline_s = deadline_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The run is over: no notice from now on, and a drained node is not removed."""
        self._done.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._ready() and not self._done.is_set():
            time.sleep(0.02)
        if self._done.is_set():
            return
        node_id = self._victim()
        drain_node(self._cluster.address, node_id, self._deadline_s)
        self.times["notice"] = time.time()
        if not self._done.wait(self._deadline_s):
            node = next(n for n in self._cluster.worker_nodes if n.node_id == node_id)
            self._cluster.remove_node(node)
            self.times["reclaimed"] = time.time()


def worker_nodes(trainer: Any) -> list[str]:
    """The node of each rank of a raysgd `TorchTrainer`, by rank."""
    import ray

    return trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())


def timeline_node(timeline: Any, rank: int) -> str:
    """The newest node that `rank` stamped in a benchmark timeline (the Ray Train side's)."""
    marks = [e for e in timeline.read() if e["event"] == "node" and e["rank"] == rank]
    return marks[-1]["node"]
