"""Fit y = 2x + 5 with creator functions, RaySGD's first example.

python -m raysgd_examples.linear --num-workers 2
"""

from __future__ import annotations

import argparse

import ray
import torch
from torch import nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.data import LinearDataset

__all__ = ["data_creator", "model_creator", "optimizer_creator", "scheduler_creator"]


def model_creator(config: dict) -> nn.Module:
    return nn.Linear(1, 1)


def optimizer_creator(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))


def scheduler_creator(
    optimizer: torch.optim.Optimizer, config: dict
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def data_creator(config: dict) -> tuple[DataLoader, DataLoader]:
    # config[BATCH_SIZE] is this worker's share of the global batch.
    train = DataLoader(LinearDataset(2, 5), batch_size=config[BATCH_SIZE], shuffle=True)
    val = DataLoader(LinearDataset(2, 5, size=400), batch_size=config[BATCH_SIZE])
    return train, val


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fit y = 2x + 5 with creator functions.")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--address",
        default=None,
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: the trainer starts a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="fewer epochs, for CI")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)  # else TorchTrainer starts a local Ray of its own
    trainer = TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        scheduler_creator=scheduler_creator,
        scheduler_step_freq="epoch",
        config={"lr": 0.3, BATCH_SIZE: 64},
        num_workers=args.num_workers,
    )
    for _ in range(3 if args.smoke else args.epochs):
        stats = trainer.train()
    print(stats)
    print(trainer.validate())
    model = trainer.get_model()
    print(f"learned y = {model.weight.item():.3f} x + {model.bias.item():.3f}")
    trainer.shutdown()
    ray.shutdown()
