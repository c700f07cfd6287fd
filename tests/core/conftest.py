"""Fixtures shared by the raysgd_core tests."""

from __future__ import annotations

import time
from typing import Callable

import pytest


def _leftovers() -> tuple[list, list]:
    """(live raysgd_core worker actors, placement groups not removed) in the connected cluster."""
    import ray
    from ray._private.state import actors as actor_table

    # The state API (ray.util.state) needs the dashboard, which the test clusters do not run.
    actors = [
        a
        for a in actor_table().values()
        if a["State"] != "DEAD" and "WorkerActor" in a["ActorClassName"]
    ]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups


@pytest.fixture
def wait_no_leftovers() -> Callable[[float], tuple[list, list]]:
    """Wait (removal is asynchronous) until no worker actor or placement group is left; return
    whatever is still there."""

    def wait(timeout_s: float = 20.0) -> tuple[list, list]:
        deadline = time.monotonic() + timeout_s
        found = _leftovers()
        while (found[0] or found[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
            found = _leftovers()
        return found

    return wait
