"""Per-rank state (`TrainingOperator.rank_state_dict`): saved for every rank; after a lost worker
a group that kept its size gives rank r rank r's (a survivor its own, a replacement the lost
rank's: from its ring peer's replica under ddp, from the snapshot under fsdp).

The operator's per-rank state here is where it came from (the rank that first made it) and how
many steps it has seen: a carried state that must follow the steps it belongs to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(180)]

ROWS, GLOBAL_BATCH = 96, 6  # 16 steps an epoch on 3 workers, 24 on 2


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
        death = self.config.get("death")
        if death and self.world_rank == death[0] and batch_info["batch_idx"] == death[1]:
            try:
                os.close(os.open(death[2], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os._exit(1)
            except FileExistsError:
                pass
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


def _arm(trainer: TorchTrainer, rank: int, batch: int, marker: Path) -> None:
    def arm(operator: Any) -> None:
        operator.config["death"] = (rank, batch, str(marker))

    trainer.apply_all_operators(arm)


def test_saved_per_rank_and_loaded_by_rank_on_another_size(tmp_path: Path) -> None:
    trainer = _trainer(3, strategy="ddp")
    try:
        trainer.train(num_steps=5)
        path = trainer.save(tmp_path / "state.pt")
        # Rank 1 is lost: the group goes on at its size, each rank with its rank's state (rank
        # 1's from the replica its ring peer kept), all having counted the same steps.
        _arm(trainer, 1, 8, tmp_path / "died")
        trainer.train()  # to the end of the first epoch: 16 steps
        assert trainer.failures == 1
        assert trainer.apply_all_operators(_carried) == [(0, 16), (1, 16), (2, 16)]
    finally:
        trainer.shutdown()
    smaller = _trainer(2)
    try:
        smaller.load(path)
        # Rank r takes what rank r saved; the third rank's has no worker here.
        assert smaller.apply_all_operators(_carried) == [(0, 5), (1, 5)]
    finally:
        smaller.shutdown()


def test_fsdp_restores_every_ranks_state_with_the_snapshot_a_replacement_the_lost_ones(
    tmp_path: Path,
) -> None:
    trainer = _trainer(3, strategy="fsdp", snapshot_every=2)
    try:
        _arm(trainer, 1, 9, tmp_path / "died")
        result = trainer.train()
        assert trainer.failures == 1 and result["num_samples"] == ROWS
        # Every worker went back to the snapshot, its carried state too, and redid the steps
        # since: each counted each of the epoch's 16 steps once. Each rank took its rank's
        # state: rank 1's (whose worker was lost) from the snapshot's copies.
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
