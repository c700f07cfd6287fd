"""Workers go into a caller's placement group (explicit, or the current one inside a Tune-like
trial) instead of a new one; estimate_fitting counts the room left."""

from __future__ import annotations

import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysgd_core import WorkerGroup, get_context

pytestmark = pytest.mark.timeout(120)


def _world() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return get_context().world_size, int(t.item())


class Trial:
    """Stands for a Tune trial actor: it runs a WorkerGroup with placement_group="auto"."""

    def run(self) -> tuple[list, int]:
        with WorkerGroup(3, use_local=True) as group:
            return group.execute(_world), _live_groups()


def _live_groups() -> int:
    return sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())


def test_explicit_and_current_placement_group(ray_local, wait_no_leftovers):
    pg = placement_group([{"CPU": 1}] * 3)
    ray.get(pg.ready())
    try:
        with WorkerGroup(2, placement_group=pg) as group:
            assert group.execute(_world) == [(2, 2), (2, 2)]
            assert _live_groups() == 1  # no group of its own
            assert group.estimate_fitting() == 1  # the third bundle is free
        assert _live_groups() == 1  # the borrowed group is not removed

        # A trial actor in bundle 0 that captures child tasks: rank 0 is the trial itself, the two
        # remote ranks take the other bundles.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        trial = (
            ray.remote(num_cpus=1)(Trial)
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_capture_child_tasks=True
                )
            )
            .remote()
        )
        results, groups_seen = ray.get(trial.run.remote(), timeout=90)
        assert results == [(3, 3)] * 3
        assert groups_seen == 1
        ray.kill(trial)
    finally:
        remove_placement_group(pg)
    assert wait_no_leftovers() == ([], [])


def test_estimate_fitting_counts_free_cpus(ray_local):
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    with WorkerGroup(1, num_cpus_per_worker=1) as group:
        assert group.estimate_fitting() == 3  # of the 4 CPUs, one is the worker's
