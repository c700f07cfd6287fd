"""TorchTrainer.as_trainable / make_trainable: one distributed trainer per Tune trial."""

from __future__ import annotations

import time

import pytest
import torch
from ray import tune
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_tune import BaseTorchTrainable, make_trainable

# Two workers of half a CPU each plus one CPU for the trial: two trials fit the 4-CPU test cluster.
WORKERS = {"num_workers": 2, "num_cpus_per_worker": 0.5, "use_gpu": False}


def model_creator(config):
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05))


def data_creator(config):
    """y = 2x + 1 on [0, 1): 256 training and 64 validation points."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(320, 1, generator=gen)
    y = 2 * x + 1
    train = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=config[BATCH_SIZE])
    val = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=config[BATCH_SIZE])
    return train, val


TRAINER_ARGS = {
    "model_creator": model_creator,
    "data_creator": data_creator,
    "optimizer_creator": optimizer_creator,
    "loss_creator": nn.MSELoss,
    "config": {BATCH_SIZE: 32},
}


def _bundles(trainable, config=None):
    return trainable.default_resource_request(config or {}).bundles


def test_resource_request_reserves_trial_and_workers():
    trainable = TorchTrainer.as_trainable(**TRAINER_ARGS, **WORKERS)
    assert issubclass(trainable, BaseTorchTrainable)
    request = trainable.default_resource_request({})
    assert request.strategy == "PACK"
    assert request.bundles == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
    # The Tune config wins over the trainer's arguments.
    assert _bundles(trainable, {"num_workers": 3, "num_cpus_per_worker": 1}) == [{"CPU": 1.0}] * 4
    # use_local: the trial process is rank 0 and holds a worker's bundle, not an extra CPU.
    assert _bundles(trainable, {"use_local": True}) == [{"CPU": 0.5}, {"CPU": 0.5}]
    # use_gpu="auto" resolves on this machine instead of failing as int("auto") did.
    auto = make_trainable(TorchTrainer, **TRAINER_ARGS, num_workers=1, use_gpu="auto")
    gpus = sum(b.get("GPU", 0) for b in _bundles(auto))
    assert gpus == (1 if torch.cuda.is_available() else 0)


def test_resource_request_reserves_spare_workers():
    trainable = TorchTrainer.as_trainable(**TRAINER_ARGS, **WORKERS, spare_workers=1)
    assert _bundles(trainable) == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert _bundles(trainable, {"spare_workers": 2, "use_local": True}) == [{"CPU": 0.5}] * 4
    with pytest.raises(ValueError, match="spare_workers"):
        _bundles(trainable, {"spare_workers": -1})


def test_a_trial_refuses_workers_without_cpus_by_the_group_options_rule():
    trainable = TorchTrainer.as_trainable(**TRAINER_ARGS, **WORKERS)
    with pytest.raises(ValueError, match=r"^num_cpus_per_worker must be a number > 0, got 0$"):
        _bundles(trainable, {"num_cpus_per_worker": 0})


def test_override_tune_step_must_take_two_parameters():
    def one_param(trainer):
        return {}

    with pytest.raises(ValueError, match="exactly two parameters"):
        TorchTrainer.as_trainable(override_tune_step=one_param, **TRAINER_ARGS)


@pytest.mark.timeout(150)
def test_grid_search_two_trials(ray_local, tune_storage, nothing_leaked):
    # use_local: each trial's process is its rank 0, beside one worker actor.
    trainable = TorchTrainer.as_trainable(**TRAINER_ARGS, **WORKERS, use_local=True)
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.05, 0.1])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
        run_config=tune.RunConfig(
            storage_path=tune_storage, stop={"training_iteration": 2}, verbose=0
        ),
    ).fit()
    assert not results.errors
    assert sorted(r.config["lr"] for r in results) == [0.05, 0.1]
    for result in results:
        history = result.metrics_dataframe
        assert list(history["training_iteration"]) == [1, 2]
        for key in ("train_loss", "val_loss", "val_accuracy", "epoch", "num_samples"):
            assert key in history.columns, key
        assert "profile" in result.metrics
        assert list(history["epoch"]) == [1, 2]
        # Loss falls from one Tune iteration (= one epoch) to the next.
        assert history["train_loss"].iloc[1] < history["train_loss"].iloc[0]
        assert history["val_loss"].iloc[1] < history["val_loss"].iloc[0]


def custom_step(trainer, info):
    """Wait (bounded) for the trial's spare to start, then train; report how many are up."""
    deadline = time.monotonic() + 60
    while not trainer.worker_group.spares and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = trainer.train(num_steps=2)
    return {
        "custom_loss": stats["train_loss"],
        "iteration_seen": info["iteration"],
        "spares": len(trainer.worker_group.spares),
    }


@pytest.mark.timeout(150)
def test_override_tune_step_under_tune_run_with_a_spare_in_the_trials_reservation(
    ray_local, tune_storage, nothing_leaked
):
    # tune.run is what RaySGD 1.x's examples call; it still takes a class trainable.
    # A trial's actors can only use the trial's placement group: without a bundle reserved for
    # its spare worker, the spare would wait forever.
    trainable = TorchTrainer.as_trainable(
        override_tune_step=custom_step, **TRAINER_ARGS, **WORKERS, spare_workers=1
    )
    analysis = tune.run(
        trainable,
        config={"lr": 0.1},
        stop={"training_iteration": 2},
        storage_path=tune_storage,
        verbose=0,
    )
    (trial,) = analysis.trials
    assert trial.status == "TERMINATED"
    history = trial.last_result
    assert history["iteration_seen"] == 1  # info["iteration"] counts the iterations done before
    assert "custom_loss" in history and "val_loss" not in history
    # The spare was up in every iteration, the first one included.
    assert list(analysis.trial_dataframes[trial.trial_id]["spares"]) == [1, 1]


@pytest.mark.timeout(120)
def test_save_and_restore_a_trial(ray_local, tmp_path, nothing_leaked):
    trainable = TorchTrainer.as_trainable(**TRAINER_ARGS, **WORKERS)
    first = trainable(config={"lr": 0.1})
    try:
        first.train()
        checkpoint = first.save(str(tmp_path / "checkpoint"))
        expected = {k: v.clone() for k, v in first.trainer.get_model().state_dict().items()}
        epoch = first.trainer.state_dict()["epoch"]
    finally:
        first.stop()
    second = trainable(config={"lr": 0.1})
    try:
        second.restore(checkpoint)
        restored = second.trainer.get_model().state_dict()
        assert restored.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(restored[key], value), key
        assert second.trainer.state_dict()["epoch"] == epoch
        assert second.training_iteration == 1
        assert second.train()["epoch"] == epoch + 1  # training continues after the restored epoch
    finally:
        second.stop()
    with pytest.raises(RuntimeError):
        second.trainer  # noqa: B018 - the trainer is gone after stop()


@pytest.mark.timeout(90)
def test_pytorch_trainable_takes_trainer_arguments_from_the_config(ray_local, nothing_leaked):
    from raysgd.torch import PyTorchTrainable  # the earliest RaySGD's name

    config = {**TRAINER_ARGS, "num_replicas": 1, "use_gpu": False, "batch_size": 32, "lr": 0.1}
    del config["config"]
    assert PyTorchTrainable.default_resource_request(config).bundles == [{"CPU": 1.0}] * 2
    trainable = PyTorchTrainable(config=config)
    try:
        # Trainer arguments were picked out; the rest became the trainer's config.
        assert trainable.trainer.config == {"lr": 0.1, BATCH_SIZE: 32}
        assert "val_loss" in trainable.train()
    finally:
        trainable.stop()
