"""raysgd-tune alone (with raysgd-core and Ray Tune, no trainer): a Tune trial runs a function on
two workers of one process group, reports twice, and rank 0's last report carries its checkpoint."""

import os
import sys
import tempfile

import ray
import torch
import torch.distributed as dist
from _smoke import import_every_module, report
from ray import tune

from raysgd_core import local_ray_options
from raysgd_tune import (
    DistributedTrainableCreator,
    distributed_checkpoint_dir,
    is_distributed_trainable,
)


def train_fn(config, checkpoint_dir=None):
    for step in range(2):
        t = torch.tensor([float(dist.get_rank() + 1) * config["scale"]])
        dist.all_reduce(t)
        with distributed_checkpoint_dir(step=step) as path:
            with open(os.path.join(path, "step.txt"), "w") as f:
                f.write(str(step))
        tune.report(
            {
                "sum": t.item(),
                "world_size": dist.get_world_size(),
                "distributed": is_distributed_trainable(),
                "step": step,
            }
        )


ray.init(address="local", num_cpus=4, **local_ray_options())
storage = tempfile.mkdtemp()
trainable = DistributedTrainableCreator(train_fn, num_workers=2, num_cpus_per_worker=1)
results = tune.Tuner(
    trainable,
    param_space={"scale": 10.0},
    run_config=tune.RunConfig(
        storage_path=storage,
        name="smoke",
        verbose=0,
        # On a loaded machine the trial's workers may not start within the group's start
        # timeout (30 s); Tune then restarts the trial, as it would for a user.
        failure_config=tune.FailureConfig(max_failures=2),
    ),
).fit()
trials = []
for result in results:
    assert result.error is None, result.error
    with result.checkpoint.as_directory() as folder:
        checkpoint_step = open(os.path.join(folder, "step.txt")).read()
    trials.append(
        {
            "scale": result.config["scale"],
            "sum": result.metrics["sum"],
            "world_size": result.metrics["world_size"],
            "distributed": result.metrics["distributed"],
            "iterations": result.metrics["training_iteration"],
            "checkpoint_step": checkpoint_step,
        }
    )
ray.shutdown()

report(
    "raysgd_tune",
    imported=import_every_module("raysgd_tune"),
    trials=trials,
    outside_a_trial=is_distributed_trainable(),
)
sys.stdout.flush()
