"""Helpers for the Tune adapter tests: every Tune run must give back all it reserved."""

from __future__ import annotations

import time

import pytest


def live_placement_groups() -> list[str]:
    """Ids of placement groups not yet removed (Tune's trial groups, the workers' own groups)."""
    import ray

    table = ray.util.placement_group_table()
    return [pg_id for pg_id, info in table.items() if info.get("state") != "REMOVED"]


def assert_nothing_leaked(timeout_s: float = 30.0) -> None:
    """All CPUs free again and no placement group left (resources return asynchronously)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= total and not live_placement_groups():
            break
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == total, "CPUs still reserved after the run"
    assert not live_placement_groups(), "placement groups left after the run"


@pytest.fixture
def nothing_leaked():
    """Assert, after the test, that its Tune runs gave back every CPU and placement group."""
    yield
    assert_nothing_leaked()


@pytest.fixture
def tune_storage(tmp_path) -> str:
    """A storage path for Tune's results (RunConfig(storage_path=...))."""
    return str(tmp_path / "tune")
