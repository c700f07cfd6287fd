"""Search learning rates for the digits CNN: every Tune trial is a distributed TorchTrainer.

    python -m raysgd_examples.tune_example --num-workers 2

`TorchTrainer.as_trainable(...)` takes the trainer's arguments and returns a Tune trainable class. Each
trial builds its own trainer with the trial's config merged over `config`, runs `train()` and
`validate()` per Tune iteration, reports both, and reserves a CPU for itself plus one per worker.
"""

from __future__ import annotations

import argparse
import tempfile

import ray
from ray import tune

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.digits import DigitsOperator

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Run the search; returns the best trial's config."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=4, help="epochs per trial")
    parser.add_argument(
        "--address",
        default="local",
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: start a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="2 trials of 1 iteration, for CI")
    args = parser.parse_args(argv)

    if args.address != "local":
        ray.init(address=args.address)  # the cluster's own CPUs decide how many trials run at once
    else:
        # A trial holds 1 + num_workers CPUs; Ray is told of enough for two trials at once.
        ray.init(address="local", num_cpus=2 * (1 + args.num_workers), include_dashboard=False)

    DigitsTrainable = TorchTrainer.as_trainable(
        training_operator_cls=DigitsOperator,
        num_workers=args.num_workers,
        use_gpu=False,
        config={BATCH_SIZE: 64},  # each trial's config["lr"] is merged over this
    )
    learning_rates = [1e-3, 5e-3] if args.smoke else [3e-4, 1e-3, 3e-3, 1e-2]
    tuner = tune.Tuner(
        DigitsTrainable,
        param_space={"lr": tune.grid_search(learning_rates)},
        tune_config=tune.TuneConfig(metric="val_accuracy", mode="max"),
        run_config=tune.RunConfig(
            stop={"training_iteration": 1 if args.smoke else args.iterations},
            storage_path=tempfile.mkdtemp(prefix="raysgd-tune-"),
            verbose=1,
        ),
    )
    results = tuner.fit()
    for result in results:
        print(
            f"trial: lr={result.config['lr']:.0e}  val_accuracy={result.metrics['val_accuracy']:.4f}"
        )
    best = results.get_best_result()
    print(f"best config: {best.config}  val_accuracy={best.metrics['val_accuracy']:.4f}")
    ray.shutdown()
    return best.config


if __name__ == "__main__":
    main()
