"""Tune a plain PyTorch DDP training function: each trial runs it on several workers at once.

    python -m raysgd_examples.tune_ddp --num-workers 2

`DistributedTrainableCreator(train_digits, num_workers=2)` is `torchrun` for every Tune trial: the
function runs on 2 processes whose process group is ready. Inside, it is an ordinary Tune function:
it reports with `tune.report`, checkpoints inside `distributed_checkpoint_dir` (only rank 0 keeps
one) and restores from `checkpoint_dir` when Tune hands one back.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray
import torch
import torch.distributed as dist
from ray import tune
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from raysgd.integration.torch import (
    DistributedTrainableCreator,
    distributed_checkpoint_dir,
    is_distributed_trainable,
)
from raysgd_examples.data import digits_datasets
from raysgd_examples.digits import DigitsCNN

__all__ = ["main", "train_digits"]


def train_digits(config: dict, checkpoint_dir: str | None = None) -> None:
    """One trial's training, written as for `torchrun`: DDP model, sharded data, rank 0 reports."""
    torch.manual_seed(0)
    model = DigitsCNN(width=config.get("width", 32))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    start_epoch = 0
    if checkpoint_dir:  # Tune restores a trial (or PBT copies another one's state)
        state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
    if is_distributed_trainable():
        model = DistributedDataParallel(model)

    train_set, val_set = digits_datasets()
    sampler = DistributedSampler(train_set, shuffle=True) if dist.is_initialized() else None
    train_loader = DataLoader(train_set, batch_size=32, sampler=sampler, shuffle=sampler is None)
    val_loader = DataLoader(val_set, batch_size=256)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(start_epoch, config["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        for images, labels in train_loader:
            optimizer.zero_grad()
            criterion(model(images), labels).backward()
            optimizer.step()

        model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in val_loader:
                correct += (model(images).argmax(dim=1) == labels).sum().item()
        accuracy = correct / len(val_set)

        # Every rank enters the block; only rank 0's directory is kept and attached to its report.
        with distributed_checkpoint_dir(step=epoch) as path:
            unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
            torch.save(
                {
                    "model": unwrapped.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                },
                os.path.join(path, "checkpoint.pt"),
            )
        tune.report({"mean_accuracy": accuracy, "epoch": epoch + 1})


def main(argv: list[str] | None = None) -> float:
    """Run the search; returns the best trial's accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--address",
        default="local",
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: start a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="1 trial of 1 epoch, for CI")
    args = parser.parse_args(argv)

    if args.address != "local":
        ray.init(address=args.address)  # the cluster's own CPUs decide how many trials run at once
    else:
        ray.init(address="local", num_cpus=2 * args.num_workers, include_dashboard=False)

    trainable = DistributedTrainableCreator(train_digits, num_workers=args.num_workers)
    epochs, learning_rates = (1, [3e-3]) if args.smoke else (args.epochs, [1e-3, 3e-3])
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(learning_rates), "epochs": epochs},
        tune_config=tune.TuneConfig(metric="mean_accuracy", mode="max"),
        run_config=tune.RunConfig(
            storage_path=tempfile.mkdtemp(prefix="raysgd-tune-ddp-"), verbose=1
        ),
    )
    best = tuner.fit().get_best_result()
    print(
        f"best lr: {best.config['lr']}  mean_accuracy={best.metrics['mean_accuracy']:.4f}  "
        f"checkpoint: {best.checkpoint}"
    )
    ray.shutdown()
    return best.metrics["mean_accuracy"]


if __name__ == "__main__":
    main()
