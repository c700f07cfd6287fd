"""Experiment loggers under Ray Tune: each trial of `TorchTrainer.as_trainable(...)` records its own
run, and the trials of one Tune run are grouped together under the Tune experiment's name (MLflow:
one experiment, the trials' runs nested under one parent run; W&B: one group; CSV: one
subdirectory per trial)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ray import tune
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer
from raysgd.loggers import CSVLogger, MLflowLogger, WandbLogger
from raysgd.utils import BATCH_SIZE


def model_creator(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def optimizer_creator(model: nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config["lr"])


def data_creator(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    x = torch.linspace(0, 1, 64).unsqueeze(1)
    data = TensorDataset(x, 2 * x + 1)
    return DataLoader(data, batch_size=config[BATCH_SIZE]), DataLoader(data, batch_size=32)


@pytest.mark.timeout(150)
def test_each_trial_is_its_own_run_grouped_by_the_experiment(
    ray_local: None,
    tune_storage: str,
    tmp_path: Path,
    nothing_leaked: None,
    read_wandb_run: Callable[[Path], list[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow import MlflowClient

    mlflow_logger = MLflowLogger(tracking_uri=str(tmp_path / "mlruns"))
    trainable = TorchTrainer.as_trainable(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        config={BATCH_SIZE: 16},
        num_workers=1,
        use_local=True,  # the trial process is rank 0: one CPU per trial, two trials at once
        use_gpu=False,
        loggers=[
            CSVLogger(tmp_path / "csv"),
            mlflow_logger,
            WandbLogger(
                project="tune-test", dir=str(tmp_path / "wandb"), settings={"silent": True}
            ),
        ],
    )
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.01, 0.1])},
        run_config=tune.RunConfig(
            storage_path=tune_storage, stop={"training_iteration": 1}, verbose=0
        ),
    ).fit()
    assert not results.errors
    trial_ids = sorted(result.metrics["trial_id"] for result in results)
    assert len(trial_ids) == 2

    # CSV: a subdirectory per trial, named after it, each with its own one-row train.csv.
    trial_dirs = sorted(p for p in (tmp_path / "csv").iterdir() if p.is_dir())
    assert [p.name.rsplit("_", 1)[-1] for p in trial_dirs] == [
        t.rsplit("_", 1)[-1] for t in trial_ids
    ]
    for directory in trial_dirs:
        with open(directory / "train.csv", newline="") as f:
            assert [row["step"] for row in csv.DictReader(f)] == ["1"]
    group = Path(results.experiment_path).name  # the Tune experiment's name

    # MLflow: one experiment named after the Tune experiment, one finished run per trial, both
    # nested under the one parent run of the Tune experiment (created once though the two trials
    # started together). (The trials set MLflow 3's file-store opt-in in their own processes;
    # reading it here needs it too.)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=mlflow_logger.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(group)
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in found if "raysgd.tune.experiment_run" in r.data.tags]
    assert parent.data.tags["raysgd.tune.experiment_run"] == group
    assert parent.info.run_name == group and parent.info.status == "FINISHED"
    runs = [r for r in found if r is not parent]
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}
    assert sorted(r.data.tags["raysgd.tune.trial_id"] for r in runs) == trial_ids
    assert {r.data.tags["raysgd.tune.group"] for r in runs} == {group}
    assert sorted(r.info.run_name for r in runs) == [p.name for p in trial_dirs]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(r.data.params["config/lr"] for r in runs) == ["0.01", "0.1"]

    # W&B: one offline run per trial, grouped under the Tune experiment, named after its trial.
    run_files = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    infos = [
        record.run
        for path in run_files
        for record in read_wandb_run(path)
        if record.WhichOneof("record_type") == "run"
    ]
    assert sorted(info.display_name for info in infos) == [p.name for p in trial_dirs]
    assert {info.run_group for info in infos} == {group}
    assert sorted(
        json.loads(u.value_json)
        for info in infos
        for u in info.config.update
        if u.key == "config/lr"
    ) == [0.01, 0.1]
