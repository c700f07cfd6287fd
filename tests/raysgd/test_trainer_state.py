"""TorchTrainer state: save/load across trainers, multi-model GANs, safe loading, auto checkpoints,
TensorBoard files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import BATCH_SIZE, TorchTrainer, TrainingOperator

pytestmark = pytest.mark.timeout(150)


def model_creator(config):
    return nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))


def optimizer_creator(model, config):
    return torch.optim.Adam(model.parameters(), lr=0.05)


def data_creator(config):
    x = torch.linspace(-1, 1, 128).unsqueeze(1)
    data = TensorDataset(x, 2 * x + 5)
    return DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True), DataLoader(data, 32)


def make_trainer(**kwargs) -> TorchTrainer:
    kwargs.setdefault("num_workers", 2)
    return TorchTrainer(
        model_creator=model_creator,
        data_creator=data_creator,
        optimizer_creator=optimizer_creator,
        loss_creator=nn.MSELoss,
        config={BATCH_SIZE: 32},
        **kwargs,
    )


def worker_weights(trainer: TorchTrainer) -> list[dict[str, torch.Tensor]]:
    def get(op):
        model = op.models[0] if isinstance(op.models, (list, tuple)) else op.model
        model = getattr(model, "module", model)
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    return trainer.apply_all_operators(get)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def read_scalars(path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file (TFRecord framing: length, crc, event proto, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def assert_refuses_files_that_are_not_checkpoints(trainer: TorchTrainer, tmp_path: Path) -> None:
    """Loads of files that are not checkpoints (one a pickle that would run code) raise ValueError
    and leave `trainer` as it was, and usable."""
    before = worker_weights(trainer)
    garbage = tmp_path / "not_a_checkpoint.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="not a raysgd checkpoint"):
        trainer.load(str(garbage))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)  # a torch file, but no trainer state
    with pytest.raises(ValueError, match="not a raysgd checkpoint"):
        trainer.load(str(other))

    class Payload:  # a pickle that would run code: never unpickled
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"models": [Payload()]}, evil)
    with pytest.raises(ValueError):
        trainer.load(str(evil))
    # Refused loads change nothing and leave the trainer usable.
    for now, then in zip(worker_weights(trainer), before):
        assert_same(now, then)
    assert trainer.train(num_steps=1)["batch_count"] == 1, "refused loads: trainer not usable"


def test_auto_checkpoints_tensorboard_save_and_load_into_a_new_trainer(ray_local, tmp_path):
    logdir = tmp_path / "tb"
    first = make_trainer(checkpoint_dir=str(tmp_path / "auto"), logdir=str(logdir))
    try:
        first.train(checkpoint="auto")
        written = tmp_path / "auto" / "raysgd_checkpoint.pt"
        assert written.is_file(), "auto checkpoint: no file"
        state = torch.load(written, weights_only=True)
        assert state["epoch"] == 0, "auto checkpoint: not the state from *before* the epoch"
        first.train(checkpoint="auto")
        assert torch.load(written, weights_only=True)["epoch"] == 1, "auto checkpoint: not updated"
        first.validate()
        path = first.save(str(tmp_path / "ckpt" / "trainer.pt"))
        expected = first.get_model().state_dict()
        epoch = first.state_dict()["epoch"]
    finally:
        first.shutdown()
    events = [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")]
    assert events, "tensorboard: no event file"
    scalars = read_scalars(logdir / events[0])
    assert {"train/train_loss", "train/num_samples", "validate/val_loss"} <= set(scalars), scalars
    assert [step for step, _ in scalars["train/train_loss"]] == [1, 2], "tensorboard: steps"
    assert scalars["train/num_samples"][0][1] == 128, "tensorboard: num_samples"
    assert os.path.isfile(path), "save: no file"
    assert not [f for f in os.listdir(tmp_path / "ckpt") if f.startswith(".")]  # no temp leftovers

    second = make_trainer(use_local=True)
    try:
        second.load(path)
        for weights in worker_weights(second):
            assert_same(weights, expected)
        assert second.state_dict()["epoch"] == epoch, "load: another epoch"
        assert second.train()["epoch"] == epoch + 1, "load: training did not go on from it"
        assert_refuses_files_that_are_not_checkpoints(second, tmp_path)
    finally:
        second.shutdown()


class GANOperator(TrainingOperator):
    """Two models and two optimizers trained with a custom train_batch (a DCGAN's shape)."""

    def train_batch(self, batch, batch_info):
        discriminator, generator = self.models
        opt_d, opt_g = self.optimizers
        real = batch[0]
        noise = torch.randn(real.shape[0], 2)
        opt_g.zero_grad()
        g_loss = self.criterion(discriminator(generator(noise)), torch.ones(real.shape[0], 1))
        g_loss.backward()
        opt_g.step()
        opt_d.zero_grad()
        fake = generator(noise).detach()
        d_loss = self.criterion(discriminator(real), torch.ones(real.shape[0], 1))
        d_loss = (d_loss + self.criterion(discriminator(fake), torch.zeros(real.shape[0], 1))) / 2
        d_loss.backward()
        opt_d.step()
        return {"loss_g": g_loss.item(), "loss_d": d_loss.item(), "num_samples": real.shape[0]}


def gan_models(config):
    torch.manual_seed(1)
    return (
        nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid()),
        nn.Linear(2, 1),
    )


def gan_optimizers(models, config):
    return tuple(torch.optim.Adam(m.parameters(), lr=0.01) for m in models)


def gan_data(config):
    return DataLoader(TensorDataset(torch.randn(64, 1) + 3), batch_size=config[BATCH_SIZE])


def test_gan_two_models_state_round_trip(ray_local):
    trainer = TorchTrainer(
        training_operator_cls=GANOperator,
        model_creator=gan_models,
        optimizer_creator=gan_optimizers,
        data_creator=gan_data,
        loss_creator=nn.BCELoss,
        config={BATCH_SIZE: 16},
        num_workers=2,
        use_local=True,
    )
    try:
        result = trainer.train()
        assert {"loss_g", "loss_d", "last_loss_g", "last_loss_d"} <= set(result)
        state = trainer.state_dict()
        assert len(state["models"]) == 2 and len(state["optimizers"]) == 2
        # Copies: rank 0 lives here, and get_model() alone hands back its live models, which
        # the next train() changes.
        models = trainer.get_model(to_cpu=True)
        assert isinstance(models, list) and len(models) == 2
        trainer.train()
        trainer.load_state_dict(state)
        restored = trainer.get_model()
        for old, new in zip(models, restored):
            assert_same(old.state_dict(), new.state_dict())
        assert trainer.state_dict()["epoch"] == state["epoch"]
    finally:
        trainer.shutdown()
