"""Tune trial overhead: trial start to first result, raysgd trainables vs a plain Tune function.

Every side runs the same work per Tune iteration (one epoch of a small regression model on the same
synthetic data, then a validation pass) in `--trials` trials, one at a time, and records for each
trial the wall time from its start (trials run one at a time: when the previous trial completed) to
its first result, with a Tune `Callback` on the driver. The first trial, which also pays for Tune
starting the experiment, is left out of the median when there are three or more. Sides:

- `plain_tune`: a plain Tune function trainable, training in the trial process (the reference);
- `as_trainable`: `TorchTrainer.as_trainable(...)` with `--workers` workers per trial;
- `distributed_creator`: `DistributedTrainableCreator(...)` with `--workers` workers per trial.

The extra time of the raysgd sides is their set-up: starting the workers, the process group, the
operator. Each side runs in a fresh process with its own local Ray cluster.

    hatch run bench:tune                      # the measurement
    hatch run bench:tune --quick --repeats 1  # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from raysgd_examples.bench import _common

__all__ = ["SIDES", "main", "measure"]

SIDES = ("plain_tune", "as_trainable", "distributed_creator")
REFERENCE_SIDE = "plain_tune"
_MODULE = "raysgd_examples.bench.tune_overhead"


def _data(config: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(0)
    n = config["samples"]
    x = torch.rand(n + n // 4, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    bs = config["batch_size"]
    train = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=bs)
    val = DataLoader(TensorDataset(x[n:], y[n:]), batch_size=bs)
    return train, val


def _model(config: dict[str, Any]) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _optimizer(model: Any, config: dict[str, Any]) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.01))


def _epoch(model: Any, optimizer: Any, loaders: tuple[Any, Any]) -> dict[str, float]:
    """One epoch of training and one validation pass, as the trainer's default step does."""
    import torch

    loss_fn = torch.nn.MSELoss()
    train, val = loaders
    for x, y in train:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        val_loss = sum(loss_fn(model(x), y).item() for x, y in val) / max(len(val), 1)
    return {"train_loss": loss.item(), "val_loss": val_loss}


def plain_function(config: dict[str, Any]) -> None:
    """The reference: a plain Tune function doing one epoch per report in the trial process."""
    from ray import tune

    model = _model(config)
    optimizer = _optimizer(model, config)
    loaders = _data(config)
    while True:
        tune.report(_epoch(model, optimizer, loaders))


def ddp_function(config: dict[str, Any], checkpoint_dir: str | None = None) -> None:
    """The same loop under DistributedTrainableCreator (DDP over the trial's workers)."""
    from ray import tune
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model(config))
    optimizer = _optimizer(model, config)
    loaders = _data({**config, "samples": config["samples"] // config["workers"]})
    while True:
        tune.report(_epoch(model, optimizer, loaders))


def _trainable(side: str, args: argparse.Namespace) -> Any:
    if side == "plain_tune":
        from ray import tune

        return tune.with_resources(plain_function, {"cpu": 1})
    if side == "as_trainable":
        from torch import nn

        from raysgd import TorchTrainer
        from raysgd.utils import BATCH_SIZE

        return TorchTrainer.as_trainable(
            model_creator=_model,
            data_creator=_data,
            optimizer_creator=_optimizer,
            loss_creator=nn.MSELoss,
            num_workers=args.workers,
            use_gpu=False,
            config={BATCH_SIZE: args.batch_size * args.workers},
        )
    if side == "distributed_creator":
        from raysgd_tune import DistributedTrainableCreator

        return DistributedTrainableCreator(ddp_function, num_workers=args.workers)
    raise ValueError(f"unknown side {side!r}")


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): median seconds from trial start to first result."""
    from ray import tune

    total_cpus = args.workers + 1

    class FirstResultTimer(tune.Callback):
        """A trial starts when the previous one has completed (trials run one at a time), or when
        fit() began for the first trial, so the previous trial's teardown counts too.

        Tune's own `on_trial_start` comes only after a class trainable's `setup`, which would hide
        exactly the set-up cost measured here, so it is not used.
        """

        def __init__(self) -> None:
            self.ready_at = time.perf_counter()
            self.first: dict[str, float] = {}

        def on_trial_result(
            self, iteration: int, trials: list, trial: Any, result: dict, **info: Any
        ) -> None:
            if trial.trial_id not in self.first:
                self.first[trial.trial_id] = time.perf_counter() - self.ready_at

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.ready_at = time.perf_counter()

    config = {
        "samples": args.samples,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "lr": tune.grid_search([0.01 * (i + 1) for i in range(args.trials)]),
    }
    with _common.local_ray(num_cpus=total_cpus), tempfile.TemporaryDirectory() as storage:
        trainable = _trainable(side, args)
        timer = FirstResultTimer()
        results = tune.Tuner(
            trainable,
            param_space=config,
            # One trial at a time: the timings are not contended by a neighbour's start-up.
            tune_config=tune.TuneConfig(max_concurrent_trials=1),
            run_config=tune.RunConfig(
                storage_path=storage,
                stop={"training_iteration": 1},
                callbacks=[timer],
                verbose=0,
            ),
        ).fit()
        if results.errors:
            raise RuntimeError(f"{side}: {results.errors[0]}")
    values = list(timer.first.values())
    # The first trial also pays for Tune starting the experiment; leave it out when there are
    # enough others for a median.
    steady = values[1:] if len(values) >= 3 else values
    return {"first_result_s": statistics.median(steady), "per_trial_s": values}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/tune_overhead.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=3)
    parser.add_argument("--trials", type=int, default=None, help="trials per run (default 5)")
    parser.add_argument("--workers", type=int, default=2, help="workers per raysgd trial")
    parser.add_argument("--samples", type=int, default=None, help="training samples per epoch")
    parser.add_argument("--batch-size", type=int, default=64, help="per-worker batch")
    args = _common.parse_args(parser, argv, steps=1, quick_steps=1)
    if args.trials is None:
        args.trials = 2 if args.quick else 5
    if args.samples is None:
        args.samples = 512 if args.quick else 8192
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    m = _common.metric(
        "trial start to first result", "s", False, runs, "first_result_s",
        note="no torchrun side here: see overhead_vs_plain_tune",
    )  # fmt: skip
    ref = m["sides"].get(REFERENCE_SIDE, {}).get("median")
    overhead = {
        side: s["median"] - ref
        for side, s in m["sides"].items()
        if side != REFERENCE_SIDE and "median" in s and ref is not None
    }
    _common.print_metric(m)
    for side, extra_s in overhead.items():
        print(f"  {side:<22} +{extra_s:.3f} s per trial over {REFERENCE_SIDE}")
    _common.write_results(args.out, "tune_overhead", [m], args, overhead_vs_plain_tune=overhead)
    return m


if __name__ == "__main__":
    main()
