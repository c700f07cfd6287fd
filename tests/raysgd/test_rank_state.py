"""Per-rank state (`TrainingOperator.rank_state_dict`): `save` keeps every rank's, in a whole
file (ddp) or a sharded folder (fsdp), and `load` on a group of another size gives rank r what rank
r saved. (After a lost worker, rank r's state is rank r's: test_exact_recovery's job feeds its
per-rank state into its inputs, so its equality with the uninterrupted job depends on it.)

The operator's per-rank state here is where it came from (the rank that first made it) and how
many steps it has seen: a carried state that must follow the steps it belongs to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(180)]

ROWS, GLOBAL_BATCH = 96, 6  # 16 steps an epoch


class CarryOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 1))
        x = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(1))
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
            criterion=nn.MSELoss(),
        )
        self.register_data(
            train_loader=DataLoader(
                TensorDataset(x, x.sum(1, keepdim=True)), batch_size=config[BATCH_SIZE]
            )
        )
        self.carried: Optional[dict[str, Any]] = {
            "origin": self.world_rank,
            "steps": torch.tensor(0),
        }

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.carried is not None:
            self.carried["steps"] += 1
        return super().train_batch(batch, batch_info)

    def rank_state_dict(self) -> Any:
        return self.carried

    def load_rank_state_dict(self, state: Any) -> None:
        self.carried = state


def _carried(operator: Any) -> Optional[tuple[int, int]]:
    c = operator.carried
    return None if c is None else (c["origin"], int(c["steps"]))


def _trainer(num_workers: int, **kwargs: Any) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=CarryOperator,
        config={BATCH_SIZE: GLOBAL_BATCH},
        num_workers=num_workers,
        num_cpus_per_worker=0.5,
        **kwargs,
    )


def test_saved_per_rank_and_loaded_by_rank_on_another_size(tmp_path: Path) -> None:
    trainer = _trainer(3, strategy="ddp")
    try:
        trainer.train(num_steps=5)
        assert trainer.apply_all_operators(_carried) == [(0, 5), (1, 5), (2, 5)]
        path = trainer.save(tmp_path / "state.pt")
    finally:
        trainer.shutdown()
    smaller = _trainer(2)
    try:
        smaller.load(path)
        # Rank r takes what rank r saved; the third rank's has no worker here.
        assert smaller.apply_all_operators(_carried) == [(0, 5), (1, 5)]
    finally:
        smaller.shutdown()


def test_fsdp_saves_per_rank_into_a_sharded_folder_loaded_by_rank_on_another_size(
    tmp_path: Path,
) -> None:
    trainer = _trainer(3, strategy="fsdp")
    try:
        assert trainer.train()["num_samples"] == ROWS  # the first epoch: 16 steps
        assert trainer.apply_all_operators(_carried) == [(0, 16), (1, 16), (2, 16)]
        path = trainer.save(tmp_path / "sharded")
    finally:
        trainer.shutdown()
    smaller = _trainer(2, strategy="fsdp")
    try:
        smaller.load(path)  # a sharded folder: each rank's per-rank state with the rest
        assert smaller.apply_all_operators(_carried) == [(0, 16), (1, 16)]
    finally:
        smaller.shutdown()
