"""A transformer language model built on the meta device and sharded per block with FSDP2.

    python -m raysgd_examples.transformer_lm [--num-workers 2] [--epochs 3] [--smoke]

The way a model too large for one device is trained: it is built without memory (``with
torch.device("meta"):``), `register()` shards it (``strategy="fsdp"``, every `Block` its own unit)
and only then gives each worker's shards memory, which `init_weights` fills (GPT-2's
initialisation: residual projections scaled down with depth). No worker ever holds the whole
model. It trains in bf16 (`use_fp16="bf16"`: FSDP computes in bf16 and reduces gradients in fp32)
with the gradient norm clipped, on characters of Python's own source (nothing to download), and
prints each worker's share of the parameters, the loss, and a line the model writes.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.text import VOCAB, corpus

__all__ = ["Block", "LMOperator", "TinyGPT", "make_trainer"]


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and the vocabulary head."""

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The next character's scores at every position, one row per position: (batch x
        length, VOCAB). (Flat rows are a fresh tensor; a view returned from a sharded root
        would lose FSDP's hook if modified in place.)"""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).reshape(-1, x.shape[-1]))

    def init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit norms, and the layers
        that write into the residual stream scaled by 1/sqrt(2 x layers)."""
        residual = 0.02 / math.sqrt(2 * len(self.blocks))
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual if name.endswith(("proj", "down")) else 0.02
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def windows(tokens: torch.Tensor, context: int) -> TensorDataset:
    """The corpus cut into (input, next-character target) windows of `context` characters."""
    count = (len(tokens) - 1) // context
    x = tokens[: count * context].view(count, context)
    y = tokens[1 : count * context + 1].view(count, context)
    return TensorDataset(x, y)


class LMOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        with torch.device("meta"):  # shapes only: no worker holds the whole model
            model = TinyGPT(config["width"], config["layers"], config["heads"], config["context"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1)
        self.register(models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss())
        data = windows(corpus(config["chars"]), config["context"])
        self.register_data(
            train_loader=DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True),
            validation_loader=DataLoader(data, batch_size=config[BATCH_SIZE]),
        )

    def init_weights(self, model: nn.Module) -> None:
        # Runs once this worker's shards have memory: each worker fills only its own.
        model.init_weights()

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, targets = batch
        with self.autocast():
            loss = self.criterion(self.model(ids), targets.reshape(-1))
        self.backward(loss, self.optimizer)
        self.optimizer_step(self.optimizer)
        return {"train_loss": loss.detach(), "num_samples": ids.shape[0]}

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, targets = batch
        with torch.no_grad(), self.autocast():
            loss = self.criterion(self.model(ids), targets.reshape(-1))
        return {"val_loss": loss.detach(), "num_samples": ids.shape[0]}


def share_of_parameters(operator: Any) -> float:
    """The share of the model's parameters this worker holds (its shards)."""
    params = list(operator.model.parameters())
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    whole = sum(p.numel() for p in params)
    return held / whole


def generate(model: nn.Module, prompt: str, length: int) -> str:
    """Greedy characters from `model` (a whole model, on the CPU) after `prompt`."""
    ids = torch.tensor([list(prompt.encode("ascii"))])
    with torch.no_grad():
        for _ in range(length):
            logits = model(ids[:, -model.context :])
            ids = torch.cat([ids, logits[-1:].argmax(dim=-1, keepdim=True)], dim=1)
    return bytes(ids[0].tolist()).decode("ascii", errors="replace")


def make_trainer(num_workers: int, smoke: bool, **kwargs: Any) -> TorchTrainer:
    size = (
        {"width": 32, "layers": 2, "heads": 2, "context": 32, "chars": 20_000}
        if smoke
        else {"width": 128, "layers": 4, "heads": 4, "context": 64, "chars": 200_000}
    )
    return TorchTrainer(
        training_operator_cls=LMOperator,
        config={**size, "lr": 3e-3, BATCH_SIZE: 32},
        num_workers=num_workers,
        strategy="fsdp",
        strategy_args={"shard_modules": Block},  # each block gathered for its turn, then freed
        use_fp16="bf16",
        clip_grad_norm=1.0,
        **kwargs,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model for one epoch")
    args = parser.parse_args()

    trainer = make_trainer(args.num_workers, args.smoke)
    shares = trainer.apply_all_operators(share_of_parameters)
    print("share of the parameters per worker: " + ", ".join(f"{s:.2f}" for s in shares))
    for _ in range(1 if args.smoke else args.epochs):
        result = trainer.train()
        print(f"epoch {result['epoch']}: train_loss={result['train_loss']:.3f}")
    print(f"val_loss={trainer.validate()['val_loss']:.3f}")
    print("sample:", repr(generate(trainer.get_model(), "def ", 40)))
    trainer.shutdown()
