"""Classify handwritten digits with a small CNN on a Ray worker pool, operator style.

    python -m raysgd_examples.digits --num-workers 2 --epochs 10

The operator says what to train (model, optimizer, loss, data); the trainer runs one copy per worker,
splits the global batch, shards the data and averages the gradients. `raysgd_examples.demo` runs this
same operator with a progress bar, TensorBoard logs and a checkpoint.
"""

from __future__ import annotations

import argparse

import ray
import torch
from torch import nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.data import DIGITS_CLASSES, digits_datasets

__all__ = ["DigitsCNN", "DigitsOperator", "main"]


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a small classifier head for 1x8x8 images."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, DIGITS_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsOperator(TrainingOperator):
    """Everything one worker needs; the default train/validate loops do the rest."""

    def setup(self, config: dict) -> None:
        # Same seed on every worker: the runs are repeatable (DDP also copies rank 0's weights).
        torch.manual_seed(config.get("seed", 0))
        model = DigitsCNN(width=config.get("width", 32))
        optimizer = torch.optim.Adam(model.parameters(), lr=config.get("lr", 2e-3))
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss()
        )
        # config[BATCH_SIZE] here is this worker's share of the global batch.
        train_set, val_set = digits_datasets(config.get("data_dir"))
        self.register_data(
            train_loader=DataLoader(train_set, batch_size=config[BATCH_SIZE], shuffle=True),
            validation_loader=DataLoader(val_set, batch_size=config[BATCH_SIZE]),
        )


def main(argv: list[str] | None = None) -> None:
    """Train the digits CNN; prints the metrics of every epoch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--address",
        default=None,
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: the trainer starts a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="two epochs, for CI")
    args = parser.parse_args(argv)

    if args.address:
        ray.init(address=args.address)  # else TorchTrainer starts a local Ray of its own
    trainer = TorchTrainer(
        training_operator_cls=DigitsOperator,
        num_workers=args.num_workers,
        config={"lr": args.lr, BATCH_SIZE: 64},  # 64 in all, split over the workers
    )
    for epoch in range(2 if args.smoke else args.epochs):
        train_stats = trainer.train()
        val_stats = trainer.validate()
        print(
            f"epoch {epoch + 1}: train_loss={train_stats['train_loss']:.4f} "
            f"val_loss={val_stats['val_loss']:.4f} val_accuracy={val_stats['val_accuracy']:.4f}"
        )
    trainer.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
