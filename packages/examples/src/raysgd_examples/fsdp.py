"""Shard a small transformer over the workers with FSDP2 (`strategy="fsdp"`), checkpoint it, resume.

python -m raysgd_examples.fsdp --num-workers 2

Each worker holds 1/N of the parameters, gradients and optimizer state. `save()` writes a sharded
checkpoint directory (each worker its own part); `load()` reads it with any number of workers and
with any strategy ("ddp", "none", "fsdp").
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

__all__ = ["Classifier", "SequenceOperator"]


class Classifier(nn.Module):
    """A transformer encoder over token embeddings, mean-pooled into class scores."""

    def __init__(self, vocab: int = 64, width: int = 64, layers: int = 4, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class SequenceOperator(TrainingOperator):
    def setup(self, config: dict) -> None:
        torch.manual_seed(0)
        model = Classifier()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))
        # Class = the most frequent of the first four token ids in the sequence.
        tokens = torch.randint(0, 64, (1024, 16), generator=torch.Generator().manual_seed(1))
        labels = torch.stack([(tokens == i).sum(dim=1) for i in range(4)], dim=1).argmax(dim=1)
        data = TensorDataset(tokens, labels)
        self.register(models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss())
        self.register_data(
            train_loader=DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True),
            validation_loader=DataLoader(data, batch_size=config[BATCH_SIZE]),
        )


def make_trainer(num_workers: int, **kwargs: object) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=SequenceOperator,
        config={BATCH_SIZE: 64},
        num_workers=num_workers,
        strategy="fsdp",
        # every encoder layer is its own unit: gathered for its forward/backward, then freed
        strategy_args={"shard_modules": nn.TransformerEncoderLayer},
        use_fp16="bf16",  # FSDP computes in bf16 and reduces gradients in fp32
        clip_grad_norm=1.0,
        **kwargs,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="fewer epochs, for CI")
    args = parser.parse_args()
    epochs = 1 if args.smoke else args.epochs

    trainer = make_trainer(args.num_workers)
    for _ in range(epochs):
        print(trainer.train())
    print(trainer.validate())
    checkpoint = trainer.save(tempfile.mkdtemp(prefix="raysgd-fsdp-") + "/ckpt")
    trainer.shutdown()

    # Resume on one worker fewer (or one, at least): the checkpoint is resharded on load.
    resumed = make_trainer(max(1, args.num_workers - 1))
    resumed.load(checkpoint)
    print("resumed:", resumed.validate())
    resumed.shutdown()
