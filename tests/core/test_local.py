"""use_local=True: rank 0 is the calling process and never stays blocked by a failed peer."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from tests._support.markers import entering, wait_for_peers

from raysgd_core import WorkerDiedError, WorkerError, WorkerGroup, get_context

pytestmark = pytest.mark.timeout(120)


def _all_reduce_info() -> tuple[int, int, float]:
    import torch

    ctx = get_context()
    t = torch.tensor([float(ctx.world_rank + 1)])
    dist.all_reduce(t)
    return ctx.world_rank, os.getpid(), t.item()


def _all_reduce_ones(folder: str) -> float:
    import torch

    t = torch.ones(1)
    entering(folder)
    dist.all_reduce(t)
    return t.item()


def _remote_exits_while_rank0_reduces(folder: str) -> float:
    if get_context().world_rank == 2:
        wait_for_peers(folder)  # rank 0 (and 1) are inside the all_reduce
        os._exit(1)
    return _all_reduce_ones(folder)


def _rank0_raises(folder: str) -> float:
    if get_context().world_rank == 0:
        wait_for_peers(folder)  # the remote ranks are inside the all_reduce
        raise KeyError("local failure")
    return _all_reduce_ones(folder)


def test_local_rank0_and_remote_death(ray_local, tmp_path):
    group = WorkerGroup(3, use_local=True).start()
    try:
        results = group.execute(_all_reduce_info)
        assert [r for r, _, _ in results] == [0, 1, 2]
        assert results[0][1] == os.getpid()
        assert all(total == 6.0 for _, _, total in results)
        assert group.workers[0].is_local and group.workers[0].pid == os.getpid()

        with pytest.raises(RuntimeError, match="use_local"):
            WorkerGroup(2, use_local=True).start()

        # A remote rank dies while rank 0 (this thread) is inside an all_reduce.
        with pytest.raises(WorkerDiedError) as info:
            group.execute(_remote_exits_while_rank0_reduces, str(tmp_path / "exits"))
        assert info.value.ranks == [2]
        report = group.recover(3, timeout_s=60)
        assert report.kept == {0: 0, 1: 1} and report.started == [2]
        results = group.execute(_all_reduce_info)
        assert results[0][1] == os.getpid() and [t for _, _, t in results] == [6.0] * 3

        # Rank 0 raising while the remote ranks are in a collective unblocks them.
        with pytest.raises(WorkerError) as err:
            group.execute(_rank0_raises, str(tmp_path / "raises"))
        assert err.value.rank == 0 and isinstance(err.value.__cause__, KeyError)
        group.recover(3, timeout_s=60)
        assert [t for _, _, t in group.execute(_all_reduce_info)] == [6.0] * 3
    finally:
        group.shutdown()
    assert not dist.is_initialized()
    # The process is free for another local group.
    with WorkerGroup(1, use_local=True) as single:
        assert single.execute(_all_reduce_info) == [(0, os.getpid(), 1.0)]


def test_a_local_group_left_behind_by_a_ray_restart_does_not_block_the_next(ray_local):
    """A use_local group never shut down (a test failed half-way), then Ray shut down and started
    again, as RaySGD's own test fixtures do: a new use_local group starts in this process."""
    import ray

    from raysgd_core import local_ray_options

    abandoned = WorkerGroup(2, use_local=True)
    abandoned.start()
    ray.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    ray.init(address="local", num_cpus=4, **local_ray_options(), configure_logging=False)
    try:
        with WorkerGroup(2, use_local=True) as group:
            assert [r for r, _, _ in group.execute(_all_reduce_info)] == [0, 1]
            assert group.execute(_all_reduce_info)[0][2] == 3.0
    finally:
        ray.shutdown()  # the shared fixture starts its cluster again for the next test
