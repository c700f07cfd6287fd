"""`TorchTrainer.as_trainable(datasets=...)`: a Tune trial splits a Ray Data dataset over its workers."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from ray import tune
from torch import nn

from raysgd import DatasetOptions, TorchTrainer
from raysgd.utils import BATCH_SIZE

NUM_ROWS = 96


def model_creator(config):
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))


def _line(batch):
    x = (batch["data"].astype(np.float32) / NUM_ROWS).reshape(-1, 1)
    return {"x": x, "y": 2 * x + 1}


@pytest.mark.timeout(180)
def test_a_trial_trains_on_its_split_of_the_dataset(ray_local, tune_storage, nothing_leaked):
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_numpy(np.arange(NUM_ROWS)).map_batches(_line)
    trainable = TorchTrainer.as_trainable(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        config={BATCH_SIZE: 16},
        # Two workers of half a CPU plus the trial's CPU leave 2 of the 4 CPUs to Ray Data.
        num_workers=2,
        num_cpus_per_worker=0.5,
        use_gpu=False,
        datasets={"train": ds, "validation": ds},
        dataset_options=DatasetOptions(columns=("x", "y")),
    )
    results = tune.Tuner(
        trainable,
        run_config=tune.RunConfig(
            storage_path=tune_storage, stop={"training_iteration": 2}, verbose=0
        ),
    ).fit()
    assert not results.errors
    history = results[0].metrics_dataframe
    # One Tune iteration is one epoch over the whole dataset, over both workers together.
    assert list(history["epoch"]) == [1, 2]
    assert list(history["num_samples"]) == [NUM_ROWS, NUM_ROWS]
    assert history["val_loss"].iloc[1] < history["val_loss"].iloc[0]
