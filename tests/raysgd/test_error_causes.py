"""Errors that name their cause: which creator failed and how it is called, the worker's traceback,
a loss instance taken as the criterion, a too-small batch refused on the driver, and checkpoint
files refused with a reason (never torch's advice to load them unsafely)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import BATCH_SIZE, TorchTrainer
from raysgd_core import WorkerError

pytestmark = pytest.mark.timeout(120)


def model_creator(config):
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def data_creator(config):
    torch.manual_seed(0)
    x = torch.randn(64, 1)
    data = TensorDataset(x, 3 * x + 1)
    return DataLoader(data, batch_size=config.get(BATCH_SIZE, 16)), DataLoader(data, batch_size=64)


def make(**overrides) -> TorchTrainer:
    kwargs = {
        "model_creator": model_creator,
        "optimizer_creator": optimizer_creator,
        "data_creator": data_creator,
        "loss_creator": nn.MSELoss,
        "num_workers": 1,
        **overrides,
    }
    return TorchTrainer(**kwargs)


@pytest.mark.parametrize(
    ("name", "bad", "expected"),
    [
        ("optimizer_creator", lambda model: None, r"optimizer_creator\(models, config\)"),
        ("model_creator", lambda: None, r"model_creator\(config\)"),
        ("data_creator", lambda config, extra: None, r"data_creator\(config\)"),
        ("scheduler_creator", lambda config: None, r"scheduler_creator\(optimizers, config\)"),
    ],
)
def test_creator_with_a_wrong_signature_is_named_on_the_driver(name, bad, expected):
    # No cluster: the signature is checked before any worker starts.
    with pytest.raises(TypeError, match=expected) as info:
        make(**{name: bad})
    assert "lambda" in str(info.value)  # and which function was given


def test_error_inside_a_creator_names_it_and_keeps_the_worker_traceback(ray_local):
    def data_creator_with_a_typo(config):
        x = torch.randn(8, 1)
        return DataLoader(TensorDataset(x, x), batch_sz=4)  # no such argument

    with pytest.raises(TypeError, match="batch_sz") as info:
        make(data_creator=data_creator_with_a_typo)
    error = info.value
    assert any("data_creator" in note for note in getattr(error, "__notes__", []))
    assert isinstance(error.__cause__, WorkerError)
    assert "data_creator_with_a_typo" in error.__cause__.remote_traceback


def test_batch_smaller_than_the_workers_is_refused_on_the_driver():
    with pytest.raises(ValueError, match="smaller than num_workers=3") as info:
        make(num_workers=3, config={BATCH_SIZE: 2})
    # Raised by the driver itself, not brought back from a worker.
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_loss_instance_trains_and_bad_checkpoints_are_refused_with_a_reason(ray_local, tmp_path):
    # One trainer for both checks (a trainer costs seconds to start).
    trainer = make(loss_creator=nn.MSELoss())  # an instance: the criterion itself
    try:
        first = trainer.validate()["val_loss"]
        for _ in range(5):
            trainer.train()
        assert trainer.validate()["val_loss"] < first / 4

        good = trainer.save(tmp_path / "good.pt")
        umask = os.umask(0)
        os.umask(umask)
        assert os.stat(good).st_mode & 0o777 == 0o666 & ~umask  # as any new file, not 0600
        assert os.listdir(tmp_path) == ["good.pt"]  # no temp file left behind
        empty = tmp_path / "empty.pt"
        empty.write_bytes(b"")
        with pytest.raises(ValueError, match="empty"):
            trainer.load(empty)
        truncated = tmp_path / "truncated.pt"
        with open(good, "rb") as handle:
            truncated.write_bytes(handle.read()[:200])
        with pytest.raises(ValueError, match="not a raysgd checkpoint") as info:
            trainer.load(truncated)
        assert "weights_only" not in str(info.value)

        class Payload:
            def __reduce__(self):
                return (os.system, ("echo pwned",))

        evil = tmp_path / "evil.pt"
        torch.save({"models": [Payload()]}, evil)
        with pytest.raises(ValueError, match="safe loader") as info:
            trainer.load(evil)
        assert "weights_only" not in str(info.value) and "system" in str(info.value)
        trainer.load(good)  # still usable
    finally:
        trainer.shutdown()
