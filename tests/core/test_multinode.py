"""Placement, local ranks and spares on multi-node `ray.cluster_utils.Cluster`s."""

from __future__ import annotations

import time

import pytest
import ray

from raysgd_core import WorkerDiedError, WorkerGroup, get_context

pytestmark = pytest.mark.timeout(150)


def _where() -> tuple[int, int, int, str]:
    import torch
    import torch.distributed as dist

    ctx = get_context()
    t = torch.ones(1)
    dist.all_reduce(t)
    return ctx.world_rank, ctx.local_rank, int(t.item()), ctx.node_id


def test_two_nodes_spread_and_local_ranks(ray_multinode):
    cluster = ray_multinode
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)

    with WorkerGroup(2, placement_strategy="SPREAD") as spread:
        nodes = {w.node_id for w in spread.workers}
        assert len(nodes) == 2

    with WorkerGroup(4, placement_strategy="PACK") as group:
        results = group.execute(_where)
        assert [r[2] for r in results] == [4, 4, 4, 4]
        by_node: dict[str, list[tuple[int, int]]] = {}
        for rank, local_rank, _, node in results:
            by_node.setdefault(node, []).append((rank, local_rank))
        assert len(by_node) == 2
        for members in by_node.values():
            assert [local for _, local in members] == [0, 1]  # counted per node in rank order
        assert [w.local_world_size for w in group.workers] == [2, 2, 2, 2]
        assert [(w.rank, w.local_rank) for w in group.workers] == [
            (r, lr) for r, lr, _, _ in results
        ]


def test_a_spare_lost_with_its_node_is_not_promoted(ray_multinode):
    cluster = ray_multinode
    nodes = [cluster.add_node(num_cpus=1) for _ in range(4)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    by_id = {n.node_id: n for n in nodes}

    with WorkerGroup(2, spare_workers=1) as group:
        deadline = time.monotonic() + 60
        while not group.spares and time.monotonic() < deadline:
            time.sleep(0.1)
        (spare,) = group.spares
        survivor = group.workers[0]
        # The spare's node and rank 1's node go away together.
        cluster.remove_node(by_id[spare.node_id])
        cluster.remove_node(by_id[group.workers[1].node_id])
        with pytest.raises(WorkerDiedError):
            group.execute(_where)
        report = group.recover(2, timeout_s=60)
        assert report.started == [1] and report.world_size == 2
        assert group.workers[0].pid == survivor.pid
        assert group.workers[1].pid != spare.pid  # a new actor, on the one node left with room
        assert group.workers[1].node_id not in {spare.node_id, survivor.node_id}
        assert [r[2] for r in group.execute(_where)] == [2, 2]
