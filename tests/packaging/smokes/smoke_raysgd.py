"""raysgd, the meta package, without extras: a TorchTrainer of two workers trains a small model,
validates, and saves and loads its state; the Tune names say which extra they need."""

import os
import tempfile

import ray
import torch
from _smoke import import_every_module, report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import raysgd.compat
import raysgd.torch
from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE


def data_creator(config):
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(512, 1, generator=generator) * 2 - 1
    data = TensorDataset(x, 2 * x + 5)
    return (
        DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True),
        DataLoader(data, batch_size=config[BATCH_SIZE]),
    )


# RaySGD's bound on the workers' start: a loaded machine may start Ray's workers slowly, and this
# smoke is about what is installed.
os.environ["SGD_PLACEMENT_GROUP_TIMEOUT_S"] = "120"
ray.init(address="local", num_cpus=4, include_dashboard=False)
trainer = TorchTrainer(
    model_creator=lambda config: nn.Linear(1, 1),
    data_creator=data_creator,
    optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.3),
    loss_creator=nn.MSELoss,
    num_workers=2,
    backend="gloo",
    config={BATCH_SIZE: 64},
)
epochs = [trainer.train() for _ in range(4)]
validation = trainer.validate()
model = trainer.get_model()
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "trainer.pt")
    trainer.save(path)
    trainer.load(path)
    reloaded = trainer.validate()
workers = trainer.num_workers
trainer.shutdown()
ray.shutdown()
tune_names = []
for module, name in [(raysgd.torch, "BaseTorchTrainable"), (raysgd.compat, "PyTorchTrainable")]:
    try:
        getattr(module, name)
    except ImportError as error:
        tune_names.append(str(error))

report(
    "raysgd",
    # The module of the Tune trainable is imported only with the tune extra installed.
    imported=import_every_module("raysgd", skip=("raysgd._internal.legacy.trainable",)),
    first=epochs[0],
    last=epochs[-1],
    validation=validation,
    reloaded=reloaded,
    weight=model.weight.item(),
    bias=model.bias.item(),
    workers=workers,
    tune_names=tune_names,
)
