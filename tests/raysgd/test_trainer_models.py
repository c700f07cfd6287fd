"""`get_model()`: what comes back to the driver can be used and saved there."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer
from raysgd._internal.driver.cluster import driver_has_cuda

pytestmark = pytest.mark.timeout(120)


def loaders(config):
    x = torch.linspace(-1, 1, 32).unsqueeze(1)
    return DataLoader(TensorDataset(x, 3 * x), batch_size=8)


def trainer(**kwargs) -> TorchTrainer:
    return TorchTrainer(
        model_creator=lambda config: nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1)),
        data_creator=loaders,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=nn.MSELoss,
        num_workers=1,
        **kwargs,
    )


def test_driver_has_cuda_is_what_torch_sees():
    assert driver_has_cuda() is torch.cuda.is_available()


def test_get_model_is_usable_and_savable_on_the_driver(ray_local):
    t = trainer()
    try:
        t.train(num_steps=2)
        trained = t.apply_all_operators(lambda op: op.model[0].weight.detach().clone())[0]
        model = t.get_model()
        # The README's get_model row: the model comes back where it trained (use_gpu="auto" on
        # a driver with CUDA: its GPU), and as a CPU copy on a driver without CUDA.
        expected = "cuda" if driver_has_cuda() else "cpu"
        device = model[0].weight.device
        assert all(p.device.type == expected for p in model.parameters())
        assert torch.equal(model[0].weight, trained.to(device))
        assert model(torch.ones(3, 1, device=device)).shape == (3, 1)
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        assert buffer.tell() > 0
        # to_cpu=True gives CPU copies on either kind of driver.
        assert all(p.device.type == "cpu" for p in t.get_model(to_cpu=True).parameters())
    finally:
        t.shutdown()


def test_use_local_get_model_is_the_live_model_when_on_the_cpu(ray_local):
    t = trainer(use_local=True)
    try:
        t.train(num_steps=1)
        # Rank 0 lives here: a model already on the CPU is not copied (as before).
        assert t.get_model() is t.get_local_operator().model
        assert t.get_model(to_cpu=True) is not t.get_local_operator().model
    finally:
        t.shutdown()
