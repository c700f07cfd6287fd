"""`broadcast_state` on a real 3-worker gloo group: the state reaches every receiver exactly, a
rank that is neither source nor receiver gets nothing, over a subgroup (some ranks stay out) and
over the whole group (everyone takes part: no subgroup is made)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from raysgd._internal.worker.transfer import broadcast_state
from raysgd_core import WorkerGroup, get_context

pytestmark = pytest.mark.timeout(120)


def _state(rank: int) -> dict[str, Any]:
    """A state whose values say which rank built it: tensors of several dtypes and sizes, nested
    containers and plain values, as an optimizer's state dict has them."""
    return {
        "models": [{"weight": torch.full((3, 4), float(rank)), "bias": torch.arange(4.0) + rank}],
        "optimizers": [{"state": {0: {"step": torch.tensor(7 + rank)}}, "lr": 0.1 * (rank + 1)}],
        "half": torch.full((5,), rank + 0.5, dtype=torch.bfloat16),
        "epoch": rank,
    }


def _send(source: int, receivers: list[int]) -> Optional[dict[str, Any]]:
    import torch.distributed as dist

    rank = get_context().world_rank
    got = broadcast_state(
        _state(rank) if rank == source else None,
        source=source,
        receivers=receivers,
        device=torch.device("cpu"),
    )
    # The group is still whole and usable afterwards (a subgroup was dropped, not the group).
    ones = torch.ones(1)
    dist.all_reduce(ones)
    assert ones.item() == dist.get_world_size()
    return got


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["epoch"] == want["epoch"]
    assert got["optimizers"][0]["lr"] == want["optimizers"][0]["lr"]
    assert torch.equal(
        got["optimizers"][0]["state"][0]["step"], want["optimizers"][0]["state"][0]["step"]
    )
    for name in ("weight", "bias"):
        assert torch.equal(got["models"][0][name], want["models"][0][name])
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], want["half"])


def test_the_state_reaches_the_receivers_only(ray_local: None) -> None:
    with WorkerGroup(3) as group:
        # Rank 1 stays out: source 0 and receiver 2 use a subgroup.
        out = group.execute(_send, 0, [2])
        assert out[1] is None
        _assert_same(out[2], _state(0))
        _assert_same(out[0], _state(0))  # the source keeps its own
        # Everyone takes part: the whole group carries it.
        out = group.execute(_send, 1, [0, 2])
        for rank in (0, 2):
            _assert_same(out[rank], _state(1))
