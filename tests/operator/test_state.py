"""State dicts: weights-only round trip, resuming mid-epoch, get_models."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raysgd_operator import OperatorRunner, StateIO, TrainingOperator


class NoisyOperator(TrainingOperator):
    """A small regression whose result depends on the order of batches."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(config.get("seed", 0))
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss(), schedulers=scheduler
        )
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(40, 4, generator=gen)
        y = x.sum(dim=1, keepdim=True) ** 2
        self.register_data(
            train_loader=DataLoader(
                TensorDataset(x, y), batch_size=4, shuffle=config.get("shuffle", False)
            )
        )


def weights(runner: OperatorRunner) -> list[torch.Tensor]:
    return [t.clone() for m in runner.get_models() for t in m.state_dict().values()]


def reload(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "settings",
    [
        {"use_fp16": False},
        {"use_fp16": "bf16"},
        # A world of 2 told to this runner alone: it shards with a seeded, shuffling DistributedSampler.
        {"use_fp16": False, "world_size": 2, "config": {"shuffle": True}},
    ],
)
def test_resume_mid_epoch_redoes_the_same_steps(settings: dict[str, Any]) -> None:
    config = settings.get("config", {})
    kwargs = {"use_fp16": settings["use_fp16"], "world_size": settings.get("world_size", 1)}
    kwargs["scheduler_step_freq"] = "batch"
    straight = OperatorRunner(NoisyOperator, config, **kwargs)
    straight.train_epoch(num_steps=3)
    state = reload(straight.state.state_dict())
    assert state["position"] == 3 and state["epoch"] == 1
    assert set(state) >= {
        "epoch",
        "operator",
        "models",
        "optimizers",
        "schedulers",
        "precision",
        "position",
    }
    straight.train_epoch()
    straight.train_epoch(num_steps=4)
    expected, expected_epoch = weights(straight), straight.position.epoch

    resumed = OperatorRunner(NoisyOperator, {**config, "seed": 5}, **kwargs)
    resumed.train_epoch(num_steps=2)  # progress that the load must discard
    resumed.state.load_state_dict(state)
    rest = resumed.train_epoch()
    assert rest["batch_count"] == (10 if kwargs["world_size"] == 1 else 5) - 3
    resumed.train_epoch(num_steps=4)
    assert resumed.position.epoch == expected_epoch == 2
    for a, b in zip(expected, weights(resumed)):
        assert torch.equal(a, b)
    if kwargs["world_size"] == 2:
        sampler = resumed.operator.train_loader.sampler
        assert isinstance(sampler, DistributedSampler) and sampler.epoch == 2


def test_state_after_finished_epoch_starts_the_next_one() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    runner.train_epoch()
    state = reload(runner.state.state_dict())
    assert state["position"] == 0
    other = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    other.state.load_state_dict(state)
    result = other.train_epoch()
    assert (result["epoch"], result["batch_count"]) == (2, 10)
    assert other.operator.scheduler.last_epoch == 2


def test_state_is_a_snapshot_and_load_checks_counts() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    state = runner.state.state_dict()
    before = state["models"][0]["0.weight"].clone()
    runner.train_epoch()
    assert torch.equal(state["models"][0]["0.weight"], before)
    with pytest.raises(ValueError, match="models"):
        runner.state.load_state_dict({**state, "models": []})


def test_a_snapshot_into_an_earlier_one_reuses_its_memory_and_is_current() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    runner.train_epoch()
    earlier = runner.state.state_dict()
    pointers = [t.data_ptr() for t in earlier["models"][0].values()]
    adam = earlier["optimizers"][0]["state"][0]["exp_avg"].data_ptr()
    runner.train_epoch()
    again = runner.state.state_dict(into=earlier)
    # The same memory, now holding this step's values: weights and Adam's moments alike.
    assert [t.data_ptr() for t in again["models"][0].values()] == pointers
    assert again["optimizers"][0]["state"][0]["exp_avg"].data_ptr() == adam
    assert torch.equal(again["models"][0]["0.weight"], runner.operator.model[0].weight)
    assert again["optimizers"][0]["state"][0]["step"] == 20
    # Never the live tensors, and whatever no longer matches (here: a new shape) is a new copy.
    assert again["models"][0]["0.weight"] is not runner.operator.model[0].weight
    earlier["models"][0]["0.weight"] = torch.zeros(1)
    fresh = runner.state.state_dict(into=earlier)["models"][0]["0.weight"]
    assert fresh.shape == (8, 4) and torch.equal(fresh, runner.operator.model[0].weight)
    assert fresh.data_ptr() != runner.operator.model[0].weight.data_ptr()


def test_host_buffers_take_the_first_snapshot_into_their_memory() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    runner.train_epoch()  # Adam's moments exist from the first step on
    buffers = StateIO.host_buffers(runner.state.state_dict(live=True))
    weight = runner.operator.model[0].weight
    shaped = buffers["models"][0]["0.weight"]
    assert (shaped.shape, shaped.dtype) == (weight.shape, weight.dtype)
    assert shaped.data_ptr() != weight.data_ptr()
    pointers = [t.data_ptr() for t in buffers["models"][0].values()]
    adam = buffers["optimizers"][0]["state"][0]["exp_avg"].data_ptr()
    taken = runner.state.state_dict(into=buffers)
    assert [t.data_ptr() for t in taken["models"][0].values()] == pointers
    assert taken["optimizers"][0]["state"][0]["exp_avg"].data_ptr() == adam
    assert torch.equal(taken["models"][0]["0.weight"], weight)
    assert torch.equal(
        taken["optimizers"][0]["state"][0]["exp_avg"],
        runner.operator.optimizer.state[weight]["exp_avg"],
    )


def test_get_models_unwrapped_and_cpu_copy() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    (live,) = runner.get_models()
    assert live is runner.operator.model
    (copy,) = runner.get_models(to_cpu=True)
    assert copy is not live
    assert all(p.device.type == "cpu" for p in copy.parameters())
    assert torch.equal(copy[0].weight, live[0].weight)


def test_apply_operator_and_shutdown() -> None:
    runner = OperatorRunner(NoisyOperator, {}, scheduler_step_freq="epoch")
    assert runner.apply_operator(lambda op: op.world_rank) == 0
    runner.train_epoch(num_steps=2)
    runner.shutdown()
    assert runner.state.state_dict()["position"] == 0


class IndexRecordingOperator(NoisyOperator):
    """Records the batch_idx, epoch_batch_idx and global_step of every batch it trains."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        self.seen: list[tuple[int, int, int]] = []

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        info = batch_info
        self.seen.append((info["batch_idx"], info["epoch_batch_idx"], info["global_step"]))
        return super().train_batch(batch, batch_info)


def test_batch_idx_counts_in_the_call_and_epoch_batch_idx_in_the_epoch_across_loads() -> None:
    # batch_idx is a batch's place in its call (0 at every call's first batch, as RaySGD's was),
    # epoch_batch_idx its place in its epoch, which a load in the middle of an epoch (a periodic
    # checkpoint, resume=True) goes on with: per-epoch logic keys on it.
    first = OperatorRunner(IndexRecordingOperator, {}, scheduler_step_freq="epoch")
    saved: list[dict[str, Any]] = []
    first.add_step_hook(
        lambda: saved.append(first.state.state_dict()) if first.position.step in (6, 10) else None
    )
    first.train_epoch(num_steps=4)
    first.train_epoch()  # the 6 other batches of the epoch's 10
    assert first.operator.seen == [(i, i, i) for i in range(4)] + [
        (i - 4, i, i) for i in range(4, 10)
    ]

    resumed = OperatorRunner(IndexRecordingOperator, {}, scheduler_step_freq="epoch")
    resumed.state.load_state_dict(reload(saved[0]))
    resumed.train_epoch()  # the rest of the epoch
    assert resumed.operator.seen == [(i - 6, i, i) for i in range(6, 10)]
    resumed.train_epoch(num_steps=2)  # the next epoch
    assert resumed.operator.seen[-2:] == [(0, 0, 10), (1, 1, 11)]

    # A state saved between calls, or at the last step of an epoch: the next call and epoch
    # start at 0.
    for state in (first.state.state_dict(), saved[1]):
        between = OperatorRunner(IndexRecordingOperator, {}, scheduler_step_freq="epoch")
        between.state.load_state_dict(reload(state))
        between.train_epoch(num_steps=1)
        assert between.operator.seen == [(0, 0, 10)]
