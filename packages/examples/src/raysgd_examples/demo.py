"""The raysgd demo: train a digit classifier on 2 workers of a local Ray cluster in under a minute.

    hatch run demo                      # same as: python -m raysgd_examples.demo
    hatch run demo --address auto       # on a running Ray cluster (`ray start --head` first)

It trains `raysgd_examples.digits.DigitsOperator` (a small CNN on scikit-learn's bundled 8x8 digits),
shows a progress bar, prints a metrics table per epoch, writes TensorBoard logs and a checkpoint to a
printed directory, and ends with the validation accuracy (the accuracy and time to expect: the
raysgd-examples README).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import ray
import torch

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.data import digits_datasets
from raysgd_examples.digits import DigitsOperator

__all__ = ["main"]

_COLUMNS = ("epoch", "train_loss", "val_loss", "val_accuracy", "samples/s")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch, split over workers"
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--address",
        default=None,
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: the trainer starts a private local one",
    )
    parser.add_argument("--fp16", action="store_true", help="mixed precision (bf16 on CPU)")
    parser.add_argument("--out-dir", default=None, help="where logs and checkpoint go")
    parser.add_argument("--smoke", action="store_true", help="two epochs, for CI")
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.epochs < 1:
        parser.error("--num-workers and --epochs must be at least 1")
    if args.smoke:
        args.epochs = min(args.epochs, 2)
    if args.out_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.out_dir = os.path.join(tempfile.gettempdir(), "raysgd-demo", stamp)
    return args


def _row(cells: tuple[str, ...]) -> str:
    return "".join(f"{cell:>14}" for cell in cells)


def _accuracy_here(model: torch.nn.Module) -> float:
    """Score the trained model in this process, as a user would after `get_model()`."""
    _, val_set = digits_datasets()
    images, labels = val_set.tensors
    model.eval()
    with torch.no_grad():
        return (model(images).argmax(dim=1) == labels).float().mean().item()


def main(argv: list[str] | None = None) -> float:
    """Run the demo; returns the final validation accuracy."""
    began = time.perf_counter()
    args = _parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    # raysgd says at INFO how long the workers took to start and which precision runs.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(
        f"raysgd demo: {args.num_workers} workers, {args.epochs} epochs, output in {args.out_dir}"
    )

    if args.address:
        ray.init(address=args.address)  # else TorchTrainer starts a local Ray of its own
    trainer = TorchTrainer(
        training_operator_cls=DigitsOperator,
        num_workers=args.num_workers,
        config={"lr": args.lr, BATCH_SIZE: args.batch_size},
        use_fp16=args.fp16,
        use_tqdm=True,  # a bar per epoch from rank 0
        use_local=True,  # rank 0 runs in this process, so its bar draws on this terminal
        logdir=os.path.join(args.out_dir, "tensorboard"),  # scalars of every train/validate
    )
    try:
        print(_row(_COLUMNS))
        for _ in range(args.epochs):
            start = time.perf_counter()
            train_stats = trainer.train()
            samples_per_s = train_stats["num_samples"] / (time.perf_counter() - start)
            val_stats = trainer.validate()
            row = (
                str(train_stats["epoch"]),
                f"{train_stats['train_loss']:.4f}",
                f"{val_stats['val_loss']:.4f}",
                f"{val_stats['val_accuracy']:.4f}",
                f"{samples_per_s:.0f}",
            )
            print(_row(row), flush=True)

        checkpoint = os.path.join(args.out_dir, "checkpoint.pt")
        trainer.save(checkpoint)  # models, optimizers, epoch: `trainer.load(checkpoint)` resumes
        model = trainer.get_model(to_cpu=True)
    finally:
        trainer.shutdown()
        ray.shutdown()

    accuracy = val_stats["val_accuracy"]
    print(f"checkpoint:  {checkpoint}")
    # TensorBoard is in the repository's hatch environment; elsewhere: pip install tensorboard.
    print(
        f"tensorboard: hatch run tensorboard --logdir {os.path.join(args.out_dir, 'tensorboard')}"
    )
    print(f"the trained model scores {_accuracy_here(model):.4f} when evaluated in this process")
    print(f"final validation accuracy: {accuracy:.4f} ({time.perf_counter() - began:.0f} s in all)")
    return accuracy


if __name__ == "__main__":
    main()
