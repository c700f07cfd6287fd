"""`train(checkpoint="auto")`: the state before each epoch lands on disk, atomically, in the
directory the user chose, and a new trainer (a restarted driver) can `load` it and carry on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = pytest.mark.usefixtures("ray_local")

NUM_SAMPLES = 64


class LinearOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(NUM_SAMPLES, 4, generator=gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        model = nn.Linear(4, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        loader = DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE])
        self.register_data(train_loader=loader, validation_loader=loader)


def _make(checkpoint_dir: Path | None = None) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=1,  # what is asserted is rank-free: one worker shows it
        config={BATCH_SIZE: 16},
        checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
    )


def _weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.get_model(to_cpu=True).state_dict().items()}


def _only_checkpoint(folder: Path) -> Path:
    files = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert len(files) == 1, files  # one file, no temp file left behind
    return files[0]


@pytest.mark.timeout(120)
def test_auto_checkpoint_is_written_before_each_epoch_and_loads_in_a_new_trainer(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    trainer = _make(folder)
    try:
        initial = _weights(trainer)
        trainer.train(checkpoint="auto")
        path = _only_checkpoint(folder)
        written = torch.load(path, map_location="cpu", weights_only=True)
        assert written["epoch"] == 0  # the state from *before* the epoch
        after_first = _weights(trainer)

        trainer.train(checkpoint="auto")
        assert _only_checkpoint(folder) == path  # replaced in place
        expected_next = trainer.train()  # epoch 3, from the state after epoch 2
        state_before_epoch2 = torch.load(path, map_location="cpu", weights_only=True)
        assert state_before_epoch2["epoch"] == 1
    finally:
        trainer.shutdown()
    assert any(not torch.equal(initial[k], after_first[k]) for k in initial)

    # A restarted driver: a new trainer loads the file and continues exactly where it was written.
    resumed = _make()
    try:
        resumed.load(path)
        for name, tensor in _weights(resumed).items():
            torch.testing.assert_close(tensor, after_first[name])
        redo = resumed.train()
        assert redo["epoch"] == 2
        again = resumed.train()
        assert again["epoch"] == expected_next["epoch"]
        assert again["train_loss"] == pytest.approx(expected_next["train_loss"], rel=1e-5)
    finally:
        resumed.shutdown()
