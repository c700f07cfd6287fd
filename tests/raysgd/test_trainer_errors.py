"""Bad input fails at construction with a clear error (not a hang or a worker traceback), a user
error from any call comes in one form (the WorkerError and the user's own type at once), and a shut
down trainer refuses every call."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd_core import WorkerError

pytestmark = pytest.mark.timeout(120)


def model_creator(config):
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def data_creator(config):
    x = torch.randn(16, 1)
    return DataLoader(TensorDataset(x, x), batch_size=4)


CREATORS = {
    "model_creator": model_creator,
    "optimizer_creator": optimizer_creator,
    "data_creator": data_creator,
    "loss_creator": nn.MSELoss,
}


def with_creators(**overrides):
    kwargs = {**CREATORS, "num_workers": 1, **overrides}
    return TorchTrainer(**kwargs)


def wait_for_free_cpus(expected: float, timeout_s: float = 20.0) -> float:
    deadline = time.monotonic() + timeout_s
    free = ray.available_resources().get("CPU", 0.0)
    while free < expected and time.monotonic() < deadline:
        time.sleep(0.1)
        free = ray.available_resources().get("CPU", 0.0)
    return free


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": 0}, ValueError, "num_workers"),
        ({"num_workers": "2"}, TypeError, "num_workers"),
        ({"use_fp16": 3}, ValueError, "use_fp16"),
        ({"backend": "mpi"}, ValueError, "backend"),
        ({"scheduler_step_freq": "sometimes"}, ValueError, "scheduler_step_freq"),
        ({"use_gpu": "yes"}, ValueError, "use_gpu"),
        ({"config": [1, 2]}, TypeError, "config"),
        ({"num_cpus_per_worker": 0}, ValueError, "num_cpus_per_worker"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches"),
        ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm"),
        ({"model_creator": None}, ValueError, "model_creator"),
        ({"data_creator": "data.csv"}, TypeError, "data_creator"),
        ({"training_operator_cls": nn.Linear}, TypeError, "training_operator_cls"),
        ({"failure_policy": "no-such-policy"}, ValueError, "no-such-policy"),
    ],
)
def test_driver_side_checks(kwargs, error, match):
    # Checked before Ray is touched: no cluster needed, nothing started.
    with pytest.raises(error, match=match):
        with_creators(**kwargs)


def test_neither_operator_nor_creators():
    with pytest.raises(ValueError, match="training_operator_cls"):
        TorchTrainer(num_workers=1)
    with pytest.raises(ValueError, match="missing"):
        TorchTrainer(model_creator=model_creator, num_workers=1)


def test_use_gpu_without_gpus(ray_local):
    with pytest.raises(ValueError, match="no GPUs"):
        with_creators(use_gpu=True)


def test_worker_side_setup_errors_surface_as_their_own_type(ray_local):
    free = ray.available_resources().get("CPU", 0.0)
    with pytest.raises(TypeError, match="model_creator must return") as remote:
        with_creators(model_creator=lambda config: "not a model", num_workers=2)
    # Chained to the WorkerError that holds the worker's traceback.
    assert isinstance(remote.value.__cause__, WorkerError)
    # Rank 0 in this process (no worker process to start): its setup error comes in the same
    # form as a remote worker's.
    with pytest.raises(ValueError, match="3 loaders") as local:
        with_creators(data_creator=lambda config: (data_creator(config),) * 3, use_local=True)
    assert isinstance(local.value.__cause__, WorkerError)
    with pytest.raises(ValueError):
        with_creators(use_fp16="fp8")  # unknown precision backend name
    # A refused construction leaves no workers or reservations behind.
    assert wait_for_free_cpus(free) >= free


class NoValidationOperator(TrainingOperator):
    def setup(self, config):
        model = nn.Linear(1, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=data_creator(config))


class MissingEntryError(LookupError):
    """A user's exception with an `__init__` and a field of its own."""

    def __init__(self, entry: str) -> None:
        super().__init__(f"no entry {entry!r}")
        self.entry = entry


def test_user_errors_come_in_one_form_and_leave_the_trainer_usable_until_shut_down(
    ray_local, tmp_path
):
    trainer = TorchTrainer(training_operator_cls=NoValidationOperator, num_workers=1)
    try:
        with pytest.raises(ValueError, match="validation loader") as info:
            trainer.validate()
        # The same form as from train(): a WorkerError with the worker's traceback, too.
        assert isinstance(info.value, WorkerError) and "validate" in info.value.remote_traceback
        with pytest.raises(NotImplementedError, match="use_local=True"):
            trainer.get_local_operator()

        def hook(operator):
            raise MissingEntryError("lr")

        with pytest.raises(WorkerError, match="no entry 'lr'") as info:
            trainer.apply_all_operators(hook)
        assert isinstance(info.value, MissingEntryError) and info.value.entry == "lr"
        assert type(info.value.__cause__) is MissingEntryError
        assert "in hook" in info.value.remote_traceback
        # Each error left the group to the recovery loop, which logged it and repaired the
        # group; a user's error is not a failure.
        kinds = [event.kind for event in trainer.recovery_events]
        assert kinds == ["user_error", "resize"] * 2 and trainer.failures == 0
        assert trainer.train()["num_samples"] == 16  # still usable after the refusals
    finally:
        trainer.shutdown()
    # Shut down, it refuses every call; a second shutdown is harmless.
    trainer.shutdown()
    calls = [
        lambda: trainer.train(),
        lambda: trainer.validate(),
        lambda: trainer.save(str(tmp_path / "x.pt")),
        lambda: trainer.load(str(tmp_path / "x.pt")),
        lambda: trainer.state_dict(),
        lambda: trainer.load_state_dict({}),
        lambda: trainer.get_model(),
        lambda: trainer.get_local_operator(),
        lambda: trainer.update_scheduler(0.1),
        lambda: trainer.apply_all_workers(lambda: 1),
        lambda: trainer.apply_all_operators(lambda op: 1),
        lambda: trainer.num_workers,
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="shut down"):
            call()


class ValidationOnlyOperator(TrainingOperator):
    """Registers validation data only; its own `train_epoch` brings its data when `info` asks."""

    def setup(self, config):
        model = nn.Linear(1, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
        )
        self.register_data(validation_loader=data_creator(config))

    def train_epoch(self, iterator, info):
        if not info.get("own_data"):
            return super().train_epoch(iterator, info)
        x = torch.full((4, 1), 1.0)
        loss = self.criterion(self.model(x), 3 * x)
        self.optimizer.zero_grad()
        self.backward(loss, self.optimizer)
        self.optimizer_step(self.optimizer)
        return {"own_loss": loss.item()}


def test_an_operator_without_training_data_constructs_validates_and_trains_its_own(ray_local):
    trainer = TorchTrainer(
        training_operator_cls=ValidationOnlyOperator, num_workers=2, use_local=True
    )
    try:
        assert trainer.validate()["num_samples"] == 16
        with pytest.raises(ValueError, match=r"train\(\) needs a train loader"):
            trainer.train()
        before = trainer.get_model().weight.item()
        result = trainer.train(info={"own_data": True})
        assert result["own_loss"] > 0 and trainer.get_model().weight.item() != before
    finally:
        trainer.shutdown()
