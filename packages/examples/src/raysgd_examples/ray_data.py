"""Train on Ray Data: a Parquet file read and featurized by Ray Data, split over the workers.

python -m raysgd_examples.ray_data --num-workers 2

The script writes a small Parquet file (y = 2x + 5 with noise), reads it back with
``ray.data.read_parquet``, adds features with ``map_batches`` and hands the dataset to
``TorchTrainer(datasets=...)``. ``DatasetOptions(columns=("x", "y"))`` turns each dict batch into the
``(features, target)`` tuple that the default ``train_batch`` unpacks. Needs ``raysgd[data]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import ray
import torch
from torch import nn

from raysgd import DatasetOptions, TorchTrainer
from raysgd.utils import BATCH_SIZE

__all__ = ["featurize", "model_creator", "optimizer_creator", "write_parquet"]


def write_parquet(path: str, num_rows: int, seed: int = 0) -> str:
    """A Parquet file with columns ``raw`` (x in [0, 1)) and ``label`` (2x + 5 + noise)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    raw = rng.random(num_rows, dtype=np.float32)
    label = 2 * raw + 5 + rng.normal(0, 0.01, num_rows).astype(np.float32)
    pq.write_table(pa.table({"raw": raw, "label": label}), path, row_group_size=1024)
    return path


def featurize(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a Ray Data preprocessing step looks like: columns in, model-ready columns out."""
    return {"x": batch["raw"].reshape(-1, 1), "y": batch["label"].reshape(-1, 1)}


def model_creator(config: dict) -> nn.Module:
    return nn.Linear(1, 1)


def optimizer_creator(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description="Fit y = 2x + 5 from a Ray Data pipeline.")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="fewer rows and epochs, for CI")
    parser.add_argument(
        "--address",
        default="local",
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: start a private local one",
    )
    args = parser.parse_args()
    epochs, rows = (2, 4096) if args.smoke else (args.epochs, args.rows)

    if args.address != "local":
        ray.init(address=args.address)
    else:
        # Ray Data runs its read and map tasks on CPUs the workers leave free: ask for two more.
        # address="local": a new instance even where another process left a cluster running.
        ray.init(address="local", num_cpus=args.num_workers + 2, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory() as folder:
        path = write_parquet(os.path.join(folder, "line.parquet"), rows)
        train = ray.data.read_parquet(path).map_batches(featurize)
        validation = ray.data.read_parquet(path).map_batches(featurize).limit(rows // 4)
        trainer = TorchTrainer(
            model_creator=model_creator,
            optimizer_creator=optimizer_creator,
            loss_creator=nn.MSELoss,
            config={BATCH_SIZE: 128},
            num_workers=args.num_workers,
            use_gpu=False,
            datasets={"train": train, "validation": validation},
            dataset_options=DatasetOptions(columns=("x", "y"), dtypes=torch.float32),
        )
        for _ in range(epochs):
            stats = trainer.train()
            print(
                f"epoch {stats['epoch']}: {stats['num_samples']} rows, loss {stats['train_loss']:.4f}"
            )
        print(trainer.validate())
        model = trainer.get_model()
        print(f"learned y = {model.weight.item():.3f} x + {model.bias.item():.3f}")
        trainer.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
