"""Behaviour in a real 2-process gloo group, plus DataLoader rebuilding checked in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests._support.ranks import run_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from raysgd_operator import OperatorRunner, TrainingOperator

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run _dist_worker.py as ranks 0 and 1 of a gloo group; return what each recorded."""
    tmp = tmp_path_factory.mktemp("gloo")
    init_file = tmp / "init"
    run_ranks(WORKER, 2, lambda rank: (str(rank), "2", str(init_file), str(tmp)))
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.timeout(120)
def test_custom_ddp_args_and_wrap_ddp_false(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["ddp_type"] == "DistributedDataParallel"
        assert out["find_unused"] is True
        assert out["plain_type"] == "Linear"


@pytest.mark.timeout(120)
def test_accumulation_matches_one_big_batch_and_skips_sync(two_ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = two_ranks
    # k=2: the first batch's backward ran under no_sync (local gradients differ across ranks),
    # the second synchronized the sum, and the single step equals one step over all 16 rows.
    assert not torch.allclose(rank0["acc2_grads"][0], rank1["acc2_grads"][0])
    assert torch.allclose(rank0["acc2_grads"][1], rank1["acc2_grads"][1])
    for out in two_ranks:
        assert torch.allclose(out["acc2_weight"], _reference_weight(), atol=1e-6)
    # k=1: every batch is synchronized and stepped.
    for i in range(2):
        assert torch.allclose(rank0["acc1_grads"][i], rank1["acc1_grads"][i])
    assert not torch.allclose(rank0["acc1_weight"], _reference_weight(), atol=1e-4)


@pytest.mark.timeout(120)
def test_added_sampler_gets_set_epoch(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["sampler_epoch"] == 2
        assert out["sharded_samples"] == 8  # 16 rows over 2 ranks


@pytest.mark.timeout(120)
def test_rebind_rewraps_and_reshards(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["rebind"] is True
        assert out["rebind_ddp"] is True
        assert out["rebind_loader"] == (True, 2, 4)  # a DistributedSampler, 2 replicas, batch 4
        # The user's own DistributedSampler cannot take the new batch size: the caller must rebuild.
        assert out["rebind_own_sampler"] is False
    assert torch.equal(two_ranks[0]["rebind_weight"], two_ranks[1]["rebind_weight"])
    # Shrinking to a group of 1: no DDP, the loader unsharded with the new batch size.
    shrunk = two_ranks[0]
    assert shrunk["shrink"] is True
    assert shrunk["shrink_model"] == "Linear"
    assert shrunk["shrink_loader"] == (1, 8)
    assert shrunk["shrink_samples"] == 16


def _reference_weight() -> torch.Tensor:
    """One SGD step on all 16 rows in one process: what DDP + accumulation must reproduce."""
    x = torch.arange(32.0).reshape(16, 2) / 32
    y = x.sum(dim=1, keepdim=True) * 3 - 1
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model.weight.detach()


def _collate(batch: list[Any]) -> Any:
    return torch.utils.data.default_collate(batch)


def _init_worker(worker_id: int) -> None:
    pass


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def _operator_with(loaders: dict[str, Any]) -> type[TrainingOperator]:
    class LoaderOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            self.register_data(**loaders)

    return LoaderOperator


def test_distributed_sampler_keeps_loader_settings() -> None:
    """A runner told it is rank 1 of 2 (no process group needed to shard data)."""
    data = TensorDataset(torch.arange(20.0))
    gen = torch.Generator().manual_seed(3)
    user = DataLoader(
        data,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=False,
        drop_last=True,
        timeout=5,
        worker_init_fn=_init_worker,
        prefetch_factor=3,
        persistent_workers=True,
        generator=gen,
    )
    val = DataLoader(data, batch_size=4)
    runner = OperatorRunner(
        _operator_with({"train_loader": user, "validation_loader": val}),
        {},
        world_rank=1,
        world_size=2,
    )
    train = runner.operator.train_loader
    assert isinstance(train.sampler, DistributedSampler)
    assert (
        train.sampler.num_replicas,
        train.sampler.rank,
        train.sampler.shuffle,
        train.sampler.seed,
    ) == (2, 1, True, 0)
    for attr in (
        "batch_size",
        "num_workers",
        "collate_fn",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "prefetch_factor",
        "persistent_workers",
        "generator",
        "dataset",
    ):
        assert getattr(train, attr) == getattr(user, attr), attr
    validation = runner.operator.validation_loader
    assert (
        isinstance(validation.sampler, DistributedSampler) and validation.sampler.shuffle is False
    )
    assert sorted(int(b[0]) for batch in validation for b in batch[0].unsqueeze(1)) == list(
        range(1, 20, 2)
    )


def test_loaders_left_alone() -> None:
    data = TensorDataset(torch.arange(8.0))
    own = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=4, rank=0))
    stream = DataLoader(Stream(), batch_size=2)
    op = OperatorRunner(
        _operator_with({"train_loader": own, "validation_loader": stream}),
        {},
        world_rank=0,
        world_size=2,
    ).operator
    assert op.train_loader is own and op.validation_loader is stream
    single = DataLoader(data, batch_size=2, shuffle=True)
    op = OperatorRunner(
        _operator_with({"train_loader": single}), {}, world_size=2, add_dist_sampler=False
    ).operator
    assert op.train_loader is single
    op = OperatorRunner(_operator_with({"train_loader": single}), {}).operator
    assert op.train_loader is single
