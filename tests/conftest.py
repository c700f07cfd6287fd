"""Shared fixtures: one local Ray cluster per test session, multi-node clusters on demand.

Starting Ray costs about 3 s, so tests share one local cluster (told it has 4 CPUs so that 4 workers
fit on this 2-core machine). Tests that need several nodes use `ray_multinode`, which stops the shared
cluster, gives the test a `ray.cluster_utils.Cluster`, and leaves Ray stopped afterwards; the next test
asking for `ray_local` starts the shared cluster again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

LOCAL_CPUS = 4
_mode: dict[str, str | None] = {"kind": None}


def _start_local() -> None:
    import ray

    if _mode["kind"] == "local" and ray.is_initialized():
        return
    from raysgd_core import local_ray_options

    ray.shutdown()
    ray.init(
        # "local" always starts a new cluster: without it ray.init joins whatever cluster
        # /tmp/ray/ray_current_cluster names (another test session's, a leftover Cluster).
        address="local",
        num_cpus=LOCAL_CPUS,
        log_to_driver=True,
        # As the trainer starts its own Ray: no dashboard, no metrics export.
        **local_ray_options(),
        configure_logging=False,
    )
    _mode["kind"] = "local"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Multi-node tests last: each one stops the shared cluster, which the next `ray_local` test
    then starts again (seconds each time); together at the end they cost that restart once."""
    items.sort(key=lambda item: "ray_multinode" in getattr(item, "fixturenames", ()))


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A running local Ray cluster with LOCAL_CPUS CPUs, shared across tests."""
    _start_local()
    yield


@pytest.fixture
def wait_for_cpus() -> Callable[..., float]:
    """`wait(expected, timeout_s=20)`: free CPUs once Ray reports `expected` of them free (or the
    timeout passed); freed resources come back asynchronously."""
    import ray

    def wait(expected: float, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        free = ray.available_resources().get("CPU", 0.0)
        while free < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            free = ray.available_resources().get("CPU", 0.0)
        return free

    return wait


@pytest.fixture
def ray_multinode() -> Iterator[object]:
    """A fresh `ray.cluster_utils.Cluster` (head with 0 CPUs); the test adds its nodes, then connects."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    _mode["kind"] = None
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
