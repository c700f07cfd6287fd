"""An LSTM language model with truncated backpropagation through time: a hidden state per worker.

    python -m raysgd_examples.lstm_lm [--num-workers 2] [--epochs 3] [--smoke]

Each worker reads its own contiguous part of the text as parallel streams, a window of
characters at a time, and carries the LSTM's hidden state from one window to the next (detached:
gradients flow through `bptt` characters only). That hidden state differs from worker to worker,
so the operator hands it to raysgd with `rank_state_dict` / `load_rank_state_dict`: it is saved
for every worker in checkpoints, and a worker whose place is restored gets it back. The example
trains, saves, loads the checkpoint into a new trainer and checks that every worker's hidden state
came back, then trains on from it.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.text import VOCAB, corpus

__all__ = ["CharLSTM", "LSTMOperator", "make_trainer", "streams"]


class CharLSTM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(
        self, ids: torch.Tensor, hidden: Optional[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, hidden = self.lstm(self.embed(ids), hidden)
        return self.head(out.reshape(-1, out.shape[-1])), hidden


def streams(tokens: torch.Tensor, rank: int, size: int, count: int, bptt: int) -> TensorDataset:
    """This worker's part of `tokens` as `count` parallel streams, cut into windows of `bptt`
    characters (input, next-character target): item t is every stream's window t."""
    part = len(tokens) // size
    mine = tokens[rank * part : (rank + 1) * part]
    length = (len(mine) - 1) // count
    x = mine[: count * length].view(count, length)
    y = mine[1 : count * length + 1].view(count, length)
    windows = length // bptt
    cut = lambda t: t[:, : windows * bptt].view(count, windows, bptt).transpose(0, 1)  # noqa: E731
    return TensorDataset(cut(x), cut(y))


class LSTMOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = CharLSTM(config["width"])
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
        self.register(models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss())
        data = streams(
            corpus(config["chars"]),
            self.world_rank,
            self.world_size,
            config[BATCH_SIZE],
            config["bptt"],
        )
        # Windows in order, this worker's own: a sampler of the user's, which raysgd leaves as
        # it is (no split over the workers: the data already is).
        self.register_data(
            train_loader=DataLoader(data, batch_size=None, sampler=SequentialSampler(data))
        )
        self.hidden: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, targets = batch
        if batch_info["batch_idx"] == 0:
            self.hidden = None  # each epoch reads the streams from their start
        logits, hidden = self.model(ids, self.hidden)
        loss = self.criterion(logits, targets.reshape(-1))
        self.backward(loss, self.optimizer)
        self.optimizer_step(self.optimizer)
        # Carried to the next window without its graph: backpropagation stops here.
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        return {"train_loss": loss.detach(), "num_samples": ids.shape[0]}

    def rank_state_dict(self) -> Any:
        return None if self.hidden is None else {"h": self.hidden[0], "c": self.hidden[1]}

    def load_rank_state_dict(self, state: Any) -> None:
        self.hidden = None if state is None else (state["h"], state["c"])


def hidden_sum(operator: Any) -> Optional[float]:
    """A fingerprint of this worker's hidden state (None before the first window)."""
    return (
        None if operator.hidden is None else float(sum(t.double().sum() for t in operator.hidden))
    )


def make_trainer(num_workers: int, smoke: bool, **kwargs: Any) -> TorchTrainer:
    size = {"width": 32, "chars": 20_000} if smoke else {"width": 128, "chars": 200_000}
    return TorchTrainer(
        training_operator_cls=LSTMOperator,
        # BATCH_SIZE: the streams of the whole group (each worker reads its share of them).
        config={**size, "bptt": 32, "lr": 3e-3, BATCH_SIZE: 8 * num_workers},
        num_workers=num_workers,
        **kwargs,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a small model, a short run")
    args = parser.parse_args()

    trainer = make_trainer(args.num_workers, args.smoke)
    for _ in range(1 if args.smoke else args.epochs):
        result = trainer.train()
        print(f"epoch {result['epoch']}: train_loss={result['train_loss']:.3f}")
    half = trainer.train(num_steps=10)  # into the next epoch: a hidden state in flight
    print(f"10 steps on: train_loss={half['train_loss']:.3f}")
    before = trainer.apply_all_operators(hidden_sum)
    checkpoint = trainer.save(tempfile.mkdtemp(prefix="raysgd-lstm-") + "/state.pt")
    trainer.shutdown()

    resumed = make_trainer(args.num_workers, args.smoke)
    resumed.load(checkpoint)
    after = resumed.apply_all_operators(hidden_sum)
    print(f"hidden state restored on every worker: {after == before}")
    rest = resumed.train()  # the rest of the epoch, from the windows and hidden states saved
    print(f"epoch {rest['epoch']} finished: train_loss={rest['train_loss']:.3f}")
    resumed.shutdown()
