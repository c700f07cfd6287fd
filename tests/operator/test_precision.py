"""The operator drives raysgd_amp backends: bf16 autocast on CPU, fp16 + GradScaler on CUDA."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import OperatorRunner, TrainingOperator


class RecordingOperator(TrainingOperator):
    """The default train_batch, plus a record of the dtype the forward pass computed in."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.register(
            models=model,
            optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
            criterion=nn.MSELoss(),
        )
        x = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
        )
        self.dtypes: set[torch.dtype] = set()

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        with self.autocast():
            self.dtypes.add(self.model(batch[0].to(self.device)).dtype)
        return super().train_batch(batch, batch_info)


@pytest.mark.parametrize(
    ("use_fp16", "dtype"),
    [(False, torch.float32), ("bf16", torch.bfloat16), (True, torch.bfloat16)],
)
def test_cpu_precisions_train(use_fp16: Any, dtype: torch.dtype) -> None:
    runner = OperatorRunner(RecordingOperator, {}, use_fp16=use_fp16, clip_grad_norm=10.0)
    losses = [runner.train_epoch()["train_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert runner.operator.dtypes == {dtype}
    assert runner.operator.use_fp16 == use_fp16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 with a GradScaler needs CUDA")
def test_cuda_fp16_scaler_trains_and_checkpoints() -> None:
    device = torch.device("cuda", 0)
    runner = OperatorRunner(
        RecordingOperator,
        {},
        use_fp16="fp16",
        device=device,
        use_gpu=True,
        clip_grad_norm=1.0,
        accumulate_grad_batches=2,
    )
    losses = [runner.train_epoch()["train_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert runner.operator.dtypes == {torch.float16}
    buffer = io.BytesIO()
    torch.save(runner.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["precision"]  # the scaler's state travels with the checkpoint
    other = OperatorRunner(RecordingOperator, {}, use_fp16="fp16", device=device, use_gpu=True)
    other.load_state_dict(state)
    assert other.precision.state_dict() == runner.precision.state_dict()
