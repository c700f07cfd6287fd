"""raysgd-operator alone (torch and raysgd-amp, no Ray): one process trains, validates, saves and
loads its state; an operator from creator functions (their data under a file lock) trains too."""

import os
import tempfile

import torch
from _smoke import import_every_module, report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import BATCH_SIZE, OperatorRunner, TrainingOperator


def line_data(n: int = 256) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=generator) * 2 - 1
    return TensorDataset(x, 2 * x + 5)


class LinearOperator(TrainingOperator):
    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.1))
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        data = line_data()
        self.register_data(
            train_loader=DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True),
            validation_loader=DataLoader(data, batch_size=config[BATCH_SIZE]),
        )


runner = OperatorRunner(LinearOperator, {"lr": 0.1, BATCH_SIZE: 32}, use_tqdm=True)
epochs = [runner.train_epoch() for _ in range(20)]
validation = runner.validate()
model = runner.get_models()[0]
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "state.pt")
    torch.save(runner.state.state_dict(), path)
    fresh = OperatorRunner(LinearOperator, {"lr": 0.1, BATCH_SIZE: 32})
    fresh.state.load_state_dict(torch.load(path, weights_only=True))
    reloaded = fresh.validate()

Creator = TrainingOperator.from_creators(
    model_creator=lambda config: nn.Linear(1, 1),
    optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.2),
    data_creator=lambda config: DataLoader(line_data(), batch_size=config[BATCH_SIZE]),
    loss_creator=nn.MSELoss,
)
created = OperatorRunner(Creator, {BATCH_SIZE: 64})
created_epochs = [created.train_epoch() for _ in range(3)]

report(
    "raysgd_operator",
    imported=import_every_module("raysgd_operator"),
    first=epochs[0],
    last=epochs[-1],
    validation=validation,
    reloaded=reloaded,
    weight=model.weight.item(),
    bias=model.bias.item(),
    created=[e["train_loss"] for e in created_epochs],
    created_batches=created_epochs[0]["batch_count"],
)
