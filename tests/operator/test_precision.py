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
    torch.save(runner.state.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["precision"]  # the scaler's state travels with the checkpoint
    other = OperatorRunner(RecordingOperator, {}, use_fp16="fp16", device=device, use_gpu=True)
    other.state.load_state_dict(state)
    assert other.precision.state_dict() == runner.precision.state_dict()


def test_a_default_loop_step_reads_the_device_no_more_often_than_a_plain_loop() -> None:
    # A host read (`.item()`, `bool()` of a tensor) waits for the device: on a GPU, every one the
    # hot path adds is time the GPU idles while the next batch is launched. Counted here on the
    # CPU, at the op every such read goes through: raysgd's fp16 step reads what GradScaler's own
    # step reads (once), its answer (skipped or not) only when asked; bf16 reads nothing.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.data import DataLoader, TensorDataset

    from raysgd_amp import NativePrecision

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    class Op(TrainingOperator):
        def setup(self, config: dict) -> None:
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
            data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
            self.register_data(train_loader=DataLoader(data, batch_size=8))

    def reads_per_step(use_fp16: object) -> float:
        runner = OperatorRunner(Op, {}, use_fp16=use_fp16)
        runner.train_epoch(num_steps=2)
        with Reads() as reads:
            runner.train_epoch(num_steps=4)
        return reads.count / 4

    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    with Reads() as plain:
        for _ in range(4):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert plain.count / 4 == 1
    assert reads_per_step(NativePrecision("fp16", device="cpu")) == 1
    assert reads_per_step("bf16") == 0
    assert reads_per_step(False) == 0
