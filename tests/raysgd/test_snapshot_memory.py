"""fsdp's in-memory snapshots in host memory: two copies of a worker's part between snapshots,
given back whole when dropped, and `snapshot_memory_mb` choosing none when four do not fit, a
loss then going back to the checkpoint with the same result."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc"),
]

#: 8 layers of 1024 x 1024 with Adam: a part of about 48 MB per worker of 2, large enough that
#: its copies are measured to a few percent in a process's resident memory.
WIDTH, LAYERS = 1024, 8


class WideOperator(TrainingOperator):
    """A stack of wide layers; rank 1 exits at its third step when the config names a marker."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1))
        self.register(
            models=model,
            optimizers=torch.optim.Adam(model.parameters(), lr=1e-4),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=DataLoader(TensorDataset(x, x.flip(1)), batch_size=8))

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        marker = self.config.get("marker")
        if marker and batch_info["global_step"] == 2 and self.world_rank == 1:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
        return super().train_batch(batch, batch_info)


def _trainer(**kwargs: Any) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=WideOperator,
        num_workers=2,
        strategy="fsdp",
        snapshot_every=1,
        **kwargs,
    )


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory() -> dict[str, Any]:
    """On a worker: its part's bytes, the snapshots it holds, and its resident memory with them
    and after dropping them."""
    from raysgd._internal.worker.objects import worker_state
    from raysgd._internal.worker.snapshots import nbytes

    state = worker_state()
    snapshots = state.snapshots
    snapshots.join()
    held = [(g.step, sorted(g.parts)) for g in snapshots.held.values()]
    part = nbytes(state.runner.state.sharded_parts()[0])
    gc.collect()
    with_them = _resident_bytes()
    snapshots.forget()
    gc.collect()
    return {"part": part, "held": held, "given_back": with_them - _resident_bytes()}


def _weights(operator: Any) -> list[torch.Tensor]:
    return [p.detach().full_tensor() for p in operator.model.parameters()]


def test_snapshots_hold_two_copies_and_a_budget_for_fewer_keeps_none_exactly(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _trainer(config={BATCH_SIZE: 16})
    try:
        trainer.train()
        clean = trainer.apply_all_operators(_weights)[0]
        memory = trainer.apply_all_workers(_memory)
    finally:
        trainer.shutdown()
    for worker in memory:
        # One snapshot (its own part and its peer's), each copy one buffer: dropping them gives
        # back exactly two copies of the part (a few pages more or less).
        assert worker["held"] == [(4, [0, 1])]  # 64 rows in 4 steps of 16
        assert 1.95 <= worker["given_back"] / worker["part"] <= 2.05, worker

    # A budget for three copies of the part, not the four a snapshot needs while it is taken:
    # none is kept, and a lost worker goes back to the newest checkpoint (the one written at the
    # call's start, or a periodic one, each written from a copy of its own).
    part_mb = max(worker["part"] for worker in memory) / 2**20
    caplog.set_level("INFO", logger="raysgd")
    trainer = _trainer(
        config={BATCH_SIZE: 16, "marker": str(tmp_path / "exited")},
        snapshot_memory_mb=3 * part_mb,
        checkpoint_dir=str(tmp_path / "periodic"),
        checkpoint_every=1,
    )
    try:
        assert "no fsdp snapshots in host memory" in caplog.text
        assert "more than snapshot_memory_mb=" in caplog.text
        trainer.train(max_retries=1, checkpoint=str(tmp_path / "start"))
        assert trainer.failures == 1 and os.path.exists(tmp_path / "exited")
        [resize] = [e for e in trainer.recovery_events if e.kind == "resize"]
        assert "checkpoint" in resize.source and not resize.inexact
        assert [w["held"] for w in trainer.apply_all_workers(_memory)] == [[], []]
        for mine, theirs in zip(trainer.apply_all_operators(_weights)[0], clean):
            assert torch.equal(mine, theirs)
    finally:
        trainer.shutdown()
