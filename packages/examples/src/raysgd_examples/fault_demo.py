"""Kill a worker in the middle of an epoch and watch the trainer recover.

    python -m raysgd_examples.fault_demo --num-workers 2

Rank 1 ends its own process (`os._exit`, as a pre-empted machine would) partway through the first
epoch. `train(max_retries=3)` notices the dead worker at once, drops the broken process group, starts
a replacement (keeping the healthy worker where it can), restores the state held before the epoch and
redoes it. The log shows each step; `trainer.failures` counts what happened. The losses and
accuracies printed are the same as those of a run without the failure
(`python -m raysgd_examples.digits --smoke`): the redone epoch sees the same data in the same order.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import ray

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.digits import DigitsOperator

__all__ = ["CrashingOperator", "main"]


class CrashingOperator(DigitsOperator):
    """The digits operator, except that rank 1 dies once, at batch `crash_at_batch`."""

    def train_batch(self, batch: tuple, batch_info: dict) -> dict:
        marker = self.config["crash_marker"]
        if (
            self.world_rank == 1
            and batch_info["batch_idx"] == self.config["crash_at_batch"]
            and not os.path.exists(marker)
        ):
            # The marker file (on this machine) makes this a one-off: the replacement trains on.
            open(marker, "w").close()
            print(
                f"rank 1 (pid {os.getpid()}): exiting at batch {batch_info['batch_idx']}",
                flush=True,
            )
            os._exit(1)
        return super().train_batch(batch, batch_info)


def main(argv: list[str] | None = None) -> int:
    """Train through one injected failure; returns the number of failures the trainer saw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--address",
        default=None,
        help='Ray cluster to join: "auto" (the one `ray start` runs here) or host:port; '
        "default: the trainer starts a private local one",
    )
    parser.add_argument("--smoke", action="store_true", help="two epochs, for CI")
    args = parser.parse_args(argv)
    if args.num_workers < 2:
        parser.error("--num-workers must be at least 2 (rank 1 is the one that dies)")

    # raysgd logs every failure, decision and resize at INFO.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.address:
        ray.init(address=args.address)  # else TorchTrainer starts a local Ray of its own
    marker = os.path.join(tempfile.mkdtemp(prefix="raysgd-fault-"), "crashed")
    trainer = TorchTrainer(
        training_operator_cls=CrashingOperator,
        num_workers=args.num_workers,
        config={BATCH_SIZE: 64, "crash_marker": marker, "crash_at_batch": 5},
    )
    for _ in range(2 if args.smoke else args.epochs):
        stats = trainer.train(max_retries=3)
        val = trainer.validate()
        print(
            f"epoch {stats['epoch']}: train_loss={stats['train_loss']:.4f} "
            f"val_accuracy={val['val_accuracy']:.4f} workers={trainer.num_workers}"
        )
    failures = trainer.failures
    print(f"failures survived: {failures}")
    trainer.shutdown()
    ray.shutdown()
    return failures


if __name__ == "__main__":
    main()
