"""TorchTrainer options: scheduler frequencies, DDP arguments and wrapping, odd model/optimizer
shapes, NaN metrics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from raysgd import BATCH_SIZE, TorchTrainer, TrainingOperator
from raysgd_operator import TrainingOptions

pytestmark = pytest.mark.timeout(120)


def loaders(config):
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    data = TensorDataset(x, 2 * x + 5)
    return DataLoader(data, batch_size=config.get(BATCH_SIZE, 8)), DataLoader(data, batch_size=16)


def model_creator(config):
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def step_lr(optimizer, config):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def plateau(optimizer, config):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def scheduler_trainer(scheduler_creator, freq) -> TorchTrainer:
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=loaders,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq=freq,
        num_workers=1,
        # Stepping the scheduler is the operator's job, the same in any process: rank 0 runs here,
        # which spares each case a worker process start.
        use_local=True,
    )


def last_epochs(trainer: TorchTrainer) -> list[int]:
    return trainer.apply_all_operators(lambda op: op.scheduler.last_epoch)


def test_every_scheduler_frequency(ray_local):
    for freq, expected in (("epoch", [1]), ("batch", [8])):  # 64 samples / 8 per batch
        trainer = scheduler_trainer(step_lr, freq)
        try:
            trainer.train()
            assert last_epochs(trainer) == expected, freq
        finally:
            trainer.shutdown()
    trainer = scheduler_trainer(plateau, "manual")
    try:
        trainer.train()
        assert last_epochs(trainer) == [0]  # "manual" never steps by itself
        trainer.update_scheduler(0.5)
        trainer.update_scheduler(0.5)
        assert last_epochs(trainer) == [2]
    finally:
        trainer.shutdown()
    with pytest.raises(ValueError, match="scheduler_step_freq"):
        scheduler_trainer(step_lr, None)


class DDPArgsOperator(TrainingOperator):
    def setup(self, config):
        model = nn.Linear(1, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
            ddp_args={"find_unused_parameters": True},
        )
        self.register_data(train_loader=loaders(config)[0])


def test_custom_ddp_args_reach_ddp(ray_local):
    trainer = TorchTrainer(training_operator_cls=DDPArgsOperator, num_workers=2)
    try:
        found = trainer.apply_all_operators(
            lambda op: (
                isinstance(op.model, DistributedDataParallel),
                op.model.find_unused_parameters,
            )
        )
        assert found == [(True, True), (True, True)]
        assert trainer.train(num_steps=2)["batch_count"] == 2
    finally:
        trainer.shutdown()


def test_wrap_ddp_false_keeps_plain_models(ray_local):
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=loaders,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        num_workers=2,
        wrap_ddp=False,
    )
    try:
        assert trainer.apply_all_operators(lambda op: type(op.model).__name__) == ["Linear"] * 2
        result = trainer.train()
        assert result["num_samples"] == 64  # the DistributedSampler still shards the data
        assert isinstance(trainer.get_model(), nn.Linear)
    finally:
        trainer.shutdown()


class IterableSGD(torch.optim.SGD):
    """An optimizer that is also iterable: still one optimizer, not a sequence of them."""

    def __iter__(self):
        return iter(self.param_groups)


class IterableOperator(TrainingOperator):
    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = IterableSGD(model.parameters(), lr=0.05)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        self.register_data(train_loader=loaders(config)[0])


def test_sequential_model_and_iterable_optimizer_are_single_objects(ray_local):
    trainer = TorchTrainer(training_operator_cls=IterableOperator, num_workers=2)
    try:
        shapes = trainer.apply_all_operators(
            lambda op: (len(op.components.models), type(op.optimizer).__name__)
        )
        assert shapes == [(1, "IterableSGD")] * 2
        losses = [trainer.train()["train_loss"] for _ in range(4)]
        assert losses[-1] < losses[0]
        assert isinstance(trainer.get_model(), nn.Sequential)
    finally:
        trainer.shutdown()


class NaNOperator(IterableOperator):
    def train_batch(self, batch, batch_info):
        result = super().train_batch(batch, batch_info)
        result["score"] = math.nan if batch_info["batch_idx"] == 0 else 0.0
        return result


def test_nan_metric_propagates_to_mean_not_last(ray_local):
    trainer = TorchTrainer(training_operator_cls=NaNOperator, num_workers=1)
    try:
        result = trainer.train(num_steps=3)
    finally:
        trainer.shutdown()
    assert math.isnan(result["score"])
    assert result["last_score"] == 0.0


def test_options_reach_every_worker_whole(ray_local):
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=loaders,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        scheduler_creator=step_lr,
        num_workers=1,
        use_gpu=False,
        use_fp16="bf16",
        scheduler_step_freq="epoch",
        accumulate_grad_batches=2,
        clip_grad_norm=5.0,
    )
    try:
        expected = TrainingOptions(
            use_fp16="bf16",
            scheduler_step_freq="epoch",
            accumulate_grad_batches=2,
            clip_grad_norm=5.0,
            num_threads=1,
        )
        assert trainer.apply_all_operators(lambda op: op.options) == [expected]
        assert trainer.apply_all_operators(lambda op: op.accumulate_grad_batches) == [2]
    finally:
        trainer.shutdown()
