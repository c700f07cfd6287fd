"""`raysgd_core.draining_nodes()` reads Ray's drains through the one private call raysgd makes
for it (Ray 2.60 has no public one), isolated in `raysgd_core._internal.ray_drains`; this drains a
real node and fails loudly when Ray moves or changes that call. `preempted_nodes()` reads the
public `ray.nodes()` once the node is gone."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

import pytest
import ray

from raysgd_core import draining_nodes, drains, preempted_nodes
from raysgd_core._internal import ray_drains


@ray.remote(num_cpus=1)
class _Busy:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _drain(
    address: str, node_id: str, reason: str, *extra: str, check: bool = True
) -> subprocess.CompletedProcess:
    """`ray drain-node` as an operator or a cloud's hook runs it."""
    command = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address]
    command += ["--node-id", node_id, "--reason", reason, *extra]
    return subprocess.run(command, check=check, capture_output=True, text=True)


@pytest.mark.timeout(120)
def test_a_preemption_drain_is_seen_with_its_deadline_and_the_reclaimed_node_as_preempted(
    ray_multinode: Any,
) -> None:
    cluster = ray_multinode
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    busy = _Busy.remote()  # a drain of an idle node ends at once; a worker keeps it draining
    assert ray.get(busy.node.remote()) == node.node_id
    assert node.node_id not in draining_nodes()
    # An autoscaler's idle-termination drain is refused on a node that runs a worker, so it
    # never reads as a notice to the workers there.
    idle = _drain(
        cluster.address, node.node_id, "DRAIN_NODE_REASON_IDLE_TERMINATION",
        "--reason-message", "idle", check=False,
    )  # fmt: skip
    assert idle.returncode != 0 and "not accepted" in idle.stderr, idle.stderr
    assert node.node_id not in draining_nodes()
    asked = time.time()
    _drain(
        cluster.address, node.node_id, "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
        "spot reclaim", "--deadline-remaining-seconds", "3",
    )  # fmt: skip
    # The private call itself, so that a change in Ray fails here and not behind the fallback.
    assert set(ray_drains.read_draining_nodes()) == {node.node_id}, (
        "Ray's private get_draining_nodes() moved or changed"
    )
    draining = draining_nodes()
    assert set(draining) == {node.node_id}
    deadline = draining[node.node_id]
    assert deadline is not None and asked + 2 <= deadline <= time.time() + 3.5
    time.sleep(max(0.0, deadline - time.time()) + 1.0)
    cluster.remove_node(node)  # reclaimed at the deadline, as a cloud does
    until = time.monotonic() + 30
    while not preempted_nodes([node.node_id]) and time.monotonic() < until:
        time.sleep(0.2)
    assert preempted_nodes([node.node_id]) == {node.node_id}


def test_without_rays_private_call_no_drain_is_seen_and_it_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A Ray without the call (as a future release may be): stood in for by a reader that raises
    # what a missing attribute raises. Training then goes on as if no notice came.
    def gone() -> dict:
        raise AttributeError("'GlobalState' object has no attribute 'get_draining_nodes'")

    monkeypatch.setattr(ray_drains, "read_draining_nodes", gone)
    monkeypatch.setattr(drains, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="raysgd_core"):
        assert draining_nodes() == {} and draining_nodes() == {}
    said = [r for r in caplog.records if "cannot read which Ray nodes are draining" in r.message]
    assert len(said) == 1
