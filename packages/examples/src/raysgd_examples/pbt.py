"""Population-based training of the digits CNN: trials copy the best ones' weights and perturb the lr.

    python -m raysgd_examples.pbt --num-workers 2 --population 4 --iterations 8

Every 2 epochs the trials wait for each other; the worst quarter of the population then takes the
best quarter's state and continues from it with a perturbed `lr`. This works because the trainable
from `TorchTrainer.as_trainable` saves and restores its whole trainer (models, optimizers, epoch).
"""

from __future__ import annotations

import argparse
import tempfile

import ray
from ray import tune
from ray.tune.schedulers import PopulationBasedTraining

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.digits import DigitsOperator

__all__ = ["main"]


def main(argv: list[str] | None = None) -> float:
    """Run PBT; returns the best trial's validation accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=8, help="epochs per trial")
    parser.add_argument(
        "--address",
        default="local",
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: start a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="2 trials of 4 epochs, for CI")
    args = parser.parse_args(argv)
    population, iterations = (2, 4) if args.smoke else (args.population, args.iterations)

    if args.address != "local":
        ray.init(address=args.address)  # the cluster's own CPUs decide how many trials run at once
    else:
        # A trial holds 1 + num_workers CPUs; PBT wants the whole population running together.
        ray.init(
            address="local", num_cpus=population * (1 + args.num_workers), include_dashboard=False
        )

    DigitsTrainable = TorchTrainer.as_trainable(
        training_operator_cls=DigitsOperator,
        num_workers=args.num_workers,
        use_gpu=False,
        config={BATCH_SIZE: 64},
    )
    scheduler = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,  # every 2 epochs the worst quarter clones the best quarter
        synch=True,  # the population waits for each other there: a small one always exploits
        hyperparam_mutations={"lr": tune.loguniform(1e-4, 1e-2)},
    )
    tuner = tune.Tuner(
        DigitsTrainable,
        param_space={"lr": tune.loguniform(1e-4, 1e-2)},
        tune_config=tune.TuneConfig(
            scheduler=scheduler, metric="val_accuracy", mode="max", num_samples=population
        ),
        run_config=tune.RunConfig(
            stop={"training_iteration": iterations},
            storage_path=tempfile.mkdtemp(prefix="raysgd-pbt-"),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            verbose=1,
        ),
    )
    results = tuner.fit()
    for result in results:  # each trial's lr is its last one, after any exploit/explore
        print(
            f"trial: lr={result.config['lr']:.2e}  val_accuracy={result.metrics['val_accuracy']:.4f}"
        )
    best = results.get_best_result()
    accuracy = best.metrics["val_accuracy"]
    print(f"best trial: lr={best.config['lr']:.2e}  val_accuracy={accuracy:.4f}")
    ray.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
