"""DistributedTrainableCreator: a Tune function run data-parallel over a WorkerGroup per trial."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from ray import tune
from ray.tune.schedulers import PopulationBasedTraining

from raysgd_core.scratch import SCRATCH_PREFIX
from raysgd_tune import (
    DistributedTrainableCreator,
    distributed_checkpoint_dir,
    is_distributed_trainable,
)


def _run_config(storage: str, **kwargs) -> tune.RunConfig:
    return tune.RunConfig(storage_path=storage, verbose=0, **kwargs)


def _all_ranks_agree(flag: bool) -> bool:
    """True when `flag` holds on every rank (a collective: every rank must call it)."""
    t = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(t)
    return t.item() == 0.0


def report_and_checkpoint(config, checkpoint_dir=None):
    """Three steps; every rank reports and writes a checkpoint, as a user's DDP loop would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        with distributed_checkpoint_dir(step=step) as path:
            with open(os.path.join(path, f"written_by_rank{rank}"), "w") as f:
                f.write(str(step))
        # Non-zero ranks got a throw-away folder, removed when the block ended. Each is in its
        # worker's scratch folder, which goes with the process if it is killed first.
        others_cleaned = _all_ranks_agree(rank == 0 or not os.path.exists(path))
        in_scratch = _all_ranks_agree(
            os.path.basename(os.path.dirname(path)).startswith(SCRATCH_PREFIX)
        )
        tune.report(
            {
                "step": step,
                "rank": rank,
                "world_size": world,
                "distributed": is_distributed_trainable(),
                "others_cleaned": others_cleaned,
                "in_scratch": in_scratch,
                "lr": config["lr"],
                "trial_name": tune.get_context().get_trial_name(),
            }
        )


def test_bad_arguments():
    def no_checkpoint_dir(config):
        pass

    with pytest.raises(ValueError, match="checkpoint_dir"):
        DistributedTrainableCreator(no_checkpoint_dir)
    with pytest.raises(ValueError, match="num_workers_per_host"):
        DistributedTrainableCreator(report_and_checkpoint, num_workers=3, num_workers_per_host=2)
    with pytest.raises(ValueError, match="num_workers"):
        DistributedTrainableCreator(report_and_checkpoint, num_workers=0)
    assert not is_distributed_trainable()


@pytest.mark.timeout(120)
def test_reports_and_checkpoint_reach_tune(ray_local, tune_storage, nothing_leaked):
    trainable = DistributedTrainableCreator(
        report_and_checkpoint, num_workers=2, num_cpus_per_worker=1
    )
    results = tune.Tuner(
        trainable, param_space={"lr": 0.5}, run_config=_run_config(tune_storage)
    ).fit()
    result = results[0]
    assert result.error is None
    metrics = result.metrics
    assert metrics["training_iteration"] == 3
    assert (metrics["step"], metrics["rank"], metrics["world_size"]) == (2, 0, 2)
    assert metrics["distributed"] and metrics["others_cleaned"] and metrics["in_scratch"]
    assert metrics["lr"] == 0.5
    # tune.get_context() works on the workers too: it names this trial (its folder's prefix).
    assert metrics["trial_name"].startswith("Distributed_report_and_checkpoint")
    assert os.path.basename(result.path).startswith(metrics["trial_name"])
    # Only rank 0's folder became the checkpoint, with the last step in it.
    with result.checkpoint.as_directory() as path:
        assert os.listdir(path) == ["written_by_rank0"]
        with open(os.path.join(path, "written_by_rank0")) as f:
            assert f.read() == "2"
    # One checkpoint per report reached the trial's storage.
    assert len(result.best_checkpoints) == 3


def pbt_function(config, checkpoint_dir=None):
    """Score grows by `lr` per step; the state travels in rank 0's checkpoints."""
    step, score, restored = 0, 0.0, False
    if checkpoint_dir:
        with open(os.path.join(checkpoint_dir, "state.json")) as f:
            state = json.load(f)
        step, score, restored = state["step"] + 1, state["score"], True
    while True:
        score += config["lr"]
        with distributed_checkpoint_dir(step=step) as path:
            with open(os.path.join(path, "state.json"), "w") as f:
                json.dump({"step": step, "score": score}, f)
        tune.report({"score": score, "restored": restored})
        step += 1


@pytest.mark.timeout(150)
def test_population_based_training(ray_local, tune_storage, nothing_leaked):
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [0.1, 1.0]},
        quantile_fraction=0.5,
        resample_probability=0.0,
        # Synchronous: both trials meet at every perturbation, so the exploit does not depend on
        # which trial happens to be ahead on a busy machine.
        synch=True,
    )
    # One worker per trial keeps this test affordable; the two-worker path is tested above.
    trainable = DistributedTrainableCreator(pbt_function, num_workers=1, num_cpus_per_worker=1)
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([0.1, 1.0])},
        tune_config=tune.TuneConfig(scheduler=pbt, metric="score", mode="max"),
        run_config=_run_config(tune_storage, stop={"training_iteration": 4}),
    ).fit()
    assert not results.errors
    # The trial that started with lr 0.1 (its directory name keeps the starting lr) lost at
    # iteration 2 and cloned the other trial's checkpoint: it ends restored, its score carried on from
    # the donor's 2.0, beyond its own reach (4 x 0.1). Its last result is the driver's own record;
    # the history is read back from files Tune syncs to storage, whose newest rows can lag behind
    # a restart, so only the rows it has are checked there.
    (weak,) = [r for r in results if "lr=0.1000" in os.path.basename(r.path)]
    assert weak.metrics["training_iteration"] == 4
    assert weak.metrics["restored"] and weak.metrics["score"] > 2.0
    history = weak.metrics_dataframe.set_index("training_iteration")
    assert (history.loc[history["restored"], "score"] > 2.0).all()
    assert (history.loc[~history["restored"]].index <= 2).all()


def dies_once(config, checkpoint_dir=None):
    """Rank 1's process dies at step 1 of the first attempt, once Tune has the step-0 checkpoint
    (rank 0 reports it concurrently: on a busy machine the loss could otherwise be seen first);
    the retry resumes from step 0."""
    start = 0
    if checkpoint_dir:
        with open(os.path.join(checkpoint_dir, "step")) as f:
            start = int(f.read()) + 1
    for step in range(start, 3):
        if step == 1 and dist.get_rank() == 1 and not os.path.exists(config["marker"]):
            until = time.monotonic() + 60
            storage = pathlib.Path(config["storage"])
            while not any(storage.rglob("checkpoint_000000")) and time.monotonic() < until:
                time.sleep(0.05)
            open(config["marker"], "w").close()
            os._exit(1)  # a lost worker: no exception, no goodbye
        dist.barrier()
        with distributed_checkpoint_dir(step=step) as path:
            with open(os.path.join(path, "step"), "w") as f:
                f.write(str(step))
        tune.report({"step": step, "resumed_from": start})


@pytest.mark.timeout(150)
def test_lost_worker_fails_the_trial_and_tune_retries(
    ray_local, tune_storage, tmp_path, nothing_leaked
):
    trainable = DistributedTrainableCreator(dies_once, num_workers=2, num_cpus_per_worker=1)
    config = {"marker": str(tmp_path / "died"), "storage": tune_storage}
    # Called as RaySGD 1.x's docs call it: tune.run with resources_per_trial=None.
    analysis = tune.run(
        trainable,
        config=config,
        resources_per_trial=None,
        max_failures=1,
        storage_path=tune_storage,
        verbose=0,
    )
    trial = analysis.trials[0]
    assert os.path.exists(config["marker"])  # the worker did die once
    assert trial.status == "TERMINATED"
    assert trial.last_result["step"] == 2
    assert trial.last_result["resumed_from"] == 1  # restarted from the step-0 checkpoint


def raises_on_rank1(config, checkpoint_dir=None):
    if dist.get_rank() == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever if nobody noticed rank 1's error


@pytest.mark.timeout(120)
def test_user_error_fails_the_trial(ray_local, tune_storage, nothing_leaked):
    trainable = DistributedTrainableCreator(raises_on_rank1, num_workers=2, num_cpus_per_worker=1)
    result = tune.Tuner(trainable, run_config=_run_config(tune_storage)).fit()[0]
    assert result.error is not None
    assert "boom on rank 1" in str(result.error)
