"""TorchTrainer options: scheduler frequencies, wrap_ddp=False, the options every worker gets.

Custom DDP arguments, a Sequential model with an iterable optimizer and NaN metrics are the
operator's own behaviour, tested in one process or a 2-process gloo group (tests/operator:
test_distributed.py, test_register.py, test_training.py, test_metrics.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import BATCH_SIZE, TorchTrainer
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


def test_wrap_ddp_false_keeps_plain_models(ray_local):
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=loaders,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        num_workers=2,
        wrap_ddp=False,
        # Rank 0 runs here and rank 1 in a worker: still a group of 2, one process start fewer.
        use_local=True,
    )
    try:
        assert trainer.apply_all_operators(lambda op: type(op.model).__name__) == ["Linear"] * 2
        result = trainer.train()
        assert result["num_samples"] == 64  # the DistributedSampler still shards the data
        assert isinstance(trainer.get_model(), nn.Linear)
    finally:
        trainer.shutdown()


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
