"""TorchTrainer training behaviour: both construction styles learn, metrics, batch split, num_steps."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import BATCH_SIZE, TorchTrainer, TrainingOperator

pytestmark = pytest.mark.timeout(120)

N_TRAIN, N_VAL = 256, 64
FLOPS_PER_SAMPLE, PEAK_FLOPS_PER_S = 6.0, 1e6


def linear_data(n: int) -> TensorDataset:
    x = torch.linspace(-1, 1, n).unsqueeze(1)
    return TensorDataset(x, 2 * x + 5)


def model_creator(config):
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.3))


def data_creator(config):
    batch = config.get(BATCH_SIZE, 16)
    train = DataLoader(linear_data(N_TRAIN), batch_size=batch, shuffle=True)
    return train, DataLoader(linear_data(N_VAL), batch_size=batch)


class LinearOperator(TrainingOperator):
    def setup(self, config):
        model = model_creator(config)
        optimizer = optimizer_creator(model, config)
        self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
        train, val = data_creator(config)
        self.register_data(train_loader=train, validation_loader=val)


def creator_trainer(**kwargs) -> TorchTrainer:
    kwargs.setdefault("num_workers", 2)
    kwargs.setdefault("config", {BATCH_SIZE: 32})
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        **kwargs,
    )


def assert_learned(model: nn.Linear) -> None:
    assert model.weight.item() == pytest.approx(2.0, abs=0.1)
    assert model.bias.item() == pytest.approx(5.0, abs=0.1)


@pytest.fixture(scope="module")
def shared(ray_local_module: None) -> Iterator[SimpleNamespace]:
    """The module's one creator-style trainer (2 workers, global batch 32), shared by the tests
    below that take it, and what its fresh model did first.

    Its options only add to what it does: `flops_per_sample` and `peak_flops_per_s` add the
    `flops_per_s` and `mfu` result keys, and the initialization hook sets an environment variable
    on every worker. Made, it trains its fresh model 4 epochs, validates and hands the model back
    (`first`, `last`, `val`, `model`: what the default-metrics test checks); every test after that
    leaves it at the end of an epoch, and reads epoch numbers relative to `trainer.epoch`.
    """

    def hook() -> None:
        os.environ["RAYSGD_TEST_HOOK"] = "set"

    trainer = creator_trainer(
        flops_per_sample=FLOPS_PER_SAMPLE,
        peak_flops_per_s=PEAK_FLOPS_PER_S,
        initialization_hook=hook,
    )
    try:
        first = trainer.train()
        for _ in range(3):
            last = trainer.train()
        val = trainer.validate()
        model = trainer.get_model()
        yield SimpleNamespace(trainer=trainer, first=first, last=last, val=val, model=model)
    finally:
        trainer.shutdown()


def test_creator_style_learns_and_reports_default_metrics(shared: SimpleNamespace) -> None:
    first, last, val = shared.first, shared.last, shared.val
    # Global batch 32 over 2 workers: each sees half of 256 samples in batches of 16.
    assert set(first) >= {"epoch", "batch_count", "num_samples", "train_loss", "last_train_loss"}
    assert first["epoch"] == 1 and last["epoch"] == 4
    assert first["num_samples"] == N_TRAIN and first["batch_count"] == N_TRAIN // 32
    assert last["train_loss"] < first["train_loss"]
    assert set(val) >= {"batch_count", "num_samples", "val_loss", "last_val_loss"}
    assert {"val_accuracy", "last_val_accuracy"} <= set(val)
    assert val["num_samples"] == N_VAL and val["val_loss"] < 0.01
    assert isinstance(shared.model, nn.Linear)  # one model comes back bare, unwrapped from DDP
    assert_learned(shared.model)


class ScoreOperator(LinearOperator):
    """Custom metric: 'score' is the batch index; averaged by samples over batches and workers."""

    def train_batch(self, batch, batch_info):
        result = super().train_batch(batch, batch_info)
        result["score"] = float(batch_info["batch_idx"])
        return result


def test_operator_style_learns_with_use_local_and_weights_custom_metrics_by_samples(ray_local):
    trainer = TorchTrainer(
        training_operator_cls=ScoreOperator, config={BATCH_SIZE: 32}, num_workers=2, use_local=True
    )
    try:
        # The first 4 batches of epoch 1 on each rank (the driver's and the remote one).
        result = trainer.train(num_steps=4)
        assert result["score"] == pytest.approx((0 + 1 + 2 + 3) / 4), "custom metric: mean"
        assert result["last_score"] == pytest.approx(3.0), "custom metric: last"
        assert result["num_samples"] == 4 * 32, "custom metric: samples"
        for _ in range(4):  # the rest of epoch 1, then epochs 2 to 4
            trainer.train()
        local = trainer.get_local_operator()
        assert type(local).__name__ == "ScoreOperator" and local.world_rank == 0
        # The driver holds rank 0: its model is the trained one, without a copy.
        assert local.world_size == 2
        assert_learned(trainer.get_model())
        assert trainer.apply_all_workers(lambda: 1) == [1, 1]
        pids = trainer.apply_all_workers(os.getpid)
        assert pids[0] == os.getpid() and pids[1] != os.getpid()
    finally:
        trainer.shutdown()


def test_an_uneven_batch_size_is_rounded_down_with_a_warning(ray_local):
    # An even one (20 over 2 workers) is split as is: tests/raysgd/test_imports.py checks it.
    # Rank 0 in this process: the split and the warning are the driver's either way.
    with pytest.warns(UserWarning, match="does not divide"):
        trainer = creator_trainer(config={BATCH_SIZE: 21}, use_local=True)
    try:
        assert trainer.config[BATCH_SIZE] == 20
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [10, 10]
        result = trainer.train()
        assert result["num_samples"] == N_TRAIN
        assert result["batch_count"] == pytest.approx(N_TRAIN / 20, abs=1)
    finally:
        trainer.shutdown()


def test_the_split_of_each_group_size_is_made_and_warned_about_once(
    recwarn: pytest.WarningsRecorder,
) -> None:
    # A start, every resize to that size and TorchTrainer.config read one split per size.
    from raysgd._internal.driver.datasets import DatasetSplitter
    from raysgd._internal.driver.worker_calls import RunnerRecipe
    from raysgd_operator import TrainingOptions

    recipe = RunnerRecipe(
        None, TrainingOptions(), {BATCH_SIZE: 16, "lr": 1}, DatasetSplitter({}), state_class=None
    )
    assert recipe.args(4).config == {BATCH_SIZE: 4, "lr": 1}
    assert recipe.args(3).config == {BATCH_SIZE: 5, "lr": 1}
    assert recipe.config_for(3) == {BATCH_SIZE: 15, "lr": 1}
    assert recipe.args(3).config[BATCH_SIZE] == 5 and recipe.config_for(4)[BATCH_SIZE] == 16
    said = [str(w.message) for w in recwarn if "does not divide" in str(w.message)]
    assert said == [
        "config[BATCH_SIZE]=16 does not divide over 3 workers; using 5 per worker, "
        "a global batch of 15"
    ]


def test_reduce_results_false_and_profile(shared: SimpleNamespace) -> None:
    trainer = shared.trainer
    per_worker = trainer.train(reduce_results=False, profile=True)
    assert isinstance(per_worker, list) and len(per_worker) == 2
    assert all(r["num_samples"] == N_TRAIN // 2 for r in per_worker)
    assert {"mean_fwd_s", "mean_grad_s", "mean_apply_s", "mean_train_epoch_s"} <= set(
        per_worker[0]["profile"]
    )
    val = trainer.validate(reduce_results=False, profile=True)
    assert len(val) == 2
    assert {"mean_eval_fwd_s", "mean_validation_s"} <= set(val[0]["profile"])
    assert "profile" in trainer.train(profile=True)
    # Introspection: current size, the core worker group, no failures seen.
    assert trainer.num_workers == 2 and trainer.worker_group.world_size == 2
    assert trainer.failures == 0 and trainer.recovery_events == []


def test_train_reports_the_groups_throughput(shared: SimpleNamespace) -> None:
    """samples/s is the group's num_samples over its loop time, which lies inside the call; with
    FLOPs per sample and a peak (none is known for a CPU) the FLOP/s and MFU follow from it."""
    trainer = shared.trainer
    started = time.perf_counter()
    result = trainer.train()
    wall_s = time.perf_counter() - started
    per_worker = trainer.train(reduce_results=False)
    assert result["num_samples"] == N_TRAIN
    assert 0 < result["loop_s"] <= wall_s
    assert result["samples_per_s"] == pytest.approx(N_TRAIN / result["loop_s"])
    assert result["flops_per_s"] == pytest.approx(FLOPS_PER_SAMPLE * result["samples_per_s"])
    assert result["mfu"] == pytest.approx(result["flops_per_s"] / (2 * PEAK_FLOPS_PER_S))
    # Each worker's own: its half of the rows over its own loop time.
    for worker in per_worker:
        assert worker["samples_per_s"] == pytest.approx(N_TRAIN / 2 / worker["loop_s"])
        assert worker["mfu"] == pytest.approx(
            FLOPS_PER_SAMPLE * worker["samples_per_s"] / PEAK_FLOPS_PER_S
        )


def test_initialization_hook_runs_on_every_worker(shared: SimpleNamespace) -> None:
    trainer = shared.trainer
    assert trainer.apply_all_workers(lambda: os.environ.get("RAYSGD_TEST_HOOK")) == ["set", "set"]
    # Each worker runs as many intra-op threads as CPUs it reserved.
    assert trainer.apply_all_workers(torch.get_num_threads) == [1, 1]


def test_num_steps_continue_and_wrap(shared: SimpleNamespace) -> None:
    # Last of the shared trainer's tests: it starts at the end of an epoch and ends at one too.
    # 2 workers x 128 samples / 16 per batch = 8 batches per worker per epoch.
    trainer = shared.trainer
    done = trainer.epoch  # epochs the earlier tests trained to their end
    assert trainer.train(num_steps=3)["batch_count"] == 3
    rest = trainer.train()  # finishes the current epoch
    assert rest["batch_count"] == 5 and rest["epoch"] == done + 1
    wrap = trainer.train(num_steps=10)  # 8 of the next epoch, then 2 of the one after
    assert wrap["batch_count"] == 10 and wrap["epoch"] == done + 3
    assert trainer.train()["batch_count"] == 6
    assert trainer.validate(num_steps=1)["batch_count"] == 1
