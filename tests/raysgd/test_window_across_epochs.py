"""An accumulation window that spans two epochs, interrupted in the second: the recovery goes back
to the window's start in the first, and every batch done again says which epoch it is in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_fault import DefaultPolicy

pytestmark = pytest.mark.usefixtures("ray_local")

#: 8 steps an epoch, windows of 3: the window of steps 6-8 spans epochs 0 and 1.
ROWS, GLOBAL_BATCH, K = 64, 8, 3


class LabelledOperator(TrainingOperator):
    """Writes every batch's epoch, place and step as it starts; rank 1 exits at step 8 once."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1))
        loader = DataLoader(
            TensorDataset(x, x.sum(1, keepdim=True)), batch_size=config[BATCH_SIZE], shuffle=True
        )
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        folder, step = Path(self.config["folder"]), batch_info["global_step"]
        with open(folder / f"batches-{os.getpid()}.txt", "a") as log:
            print(batch_info["epoch_idx"], batch_info["epoch_batch_idx"], step, file=log)
        if step == 8 and self.world_rank == 1:
            try:
                os.close(os.open(folder / "exited", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().train_batch(batch, batch_info)


def test_a_window_across_two_epochs_is_done_again_with_each_batch_in_its_epoch(
    tmp_path: Path,
) -> None:
    trainer = TorchTrainer(
        training_operator_cls=LabelledOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "folder": str(tmp_path)},
        num_workers=2,
        accumulate_grad_batches=K,
        spare_workers=1,
        failure_policy=DefaultPolicy(replace_in_background=False),
    )
    try:
        epochs = [trainer.train(max_retries=1)["epoch"] for _ in range(3)]
        [resize] = [e for e in trainer.recovery_events if e.kind == "resize"]
    finally:
        trainer.shutdown()
    assert epochs == [1, 2, 3] and (tmp_path / "exited").exists()
    # Back to the window's start, after step 5 (in epoch 0): steps 6 and 7 of epoch 0 again.
    assert "at step 6" in resize.source and not resize.inexact
    seen = [
        tuple(int(v) for v in line.split())
        for path in tmp_path.glob("batches-*.txt")
        for line in path.read_text().splitlines()
    ]
    steps_per_epoch = ROWS // GLOBAL_BATCH
    assert {step for _, _, step in seen} == set(range(3 * steps_per_epoch))
    # Every attempt at a step, the redone ones included, names the step's own epoch and place
    # (the steps of epoch 1 after the recovery were said to be epoch 0's).
    wrong = [
        (epoch, place, step)
        for epoch, place, step in seen
        if (epoch, place) != divmod(step, steps_per_epoch)
    ]
    assert not wrong, wrong
