"""A RaySGD 1.x training script, migrated to raysgd by changing its imports and nothing else.

    python -m raysgd_examples.migrate --num-workers 2

Everything below the imports is written as for Ray 1.12's `ray.util.sgd`: a `TrainingOperator` with
`setup`, `register` and `register_data`, the global `BATCH_SIZE`, `scheduler_step_freq`, `backend`,
`train()` / `validate()` once per epoch, `get_model()`, `save()` and `load()` into a second trainer.
"""

import argparse
import os
import tempfile

import numpy as np
import ray
import torch
import torch.nn as nn

# Before (Ray <= 1.12):
#   from ray.util.sgd import TorchTrainer
#   from ray.util.sgd.torch import TrainingOperator
#   from ray.util.sgd.utils import BATCH_SIZE
# After:
from raysgd import TorchTrainer
from raysgd.torch import TrainingOperator
from raysgd.utils import BATCH_SIZE

__all__ = ["LinearDataset", "LinearOperator", "train_example"]


class LinearDataset(torch.utils.data.Dataset):
    """y = a * x + b"""

    def __init__(self, a, b, size=1000):
        x = np.linspace(-1, 1, size, dtype=np.float32)
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(a * x + b)

    def __getitem__(self, index):
        return self.x[index, None], self.y[index, None]

    def __len__(self):
        return len(self.x)


class LinearOperator(TrainingOperator):
    def setup(self, config):
        train_dataset = LinearDataset(2, 5, config.get("data_size", 1000))
        val_dataset = LinearDataset(2, 5, config.get("val_size", 400))
        train_loader = torch.utils.data.DataLoader(
            train_dataset, batch_size=config[BATCH_SIZE], shuffle=True
        )
        validation_loader = torch.utils.data.DataLoader(val_dataset, batch_size=config[BATCH_SIZE])

        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss(), schedulers=scheduler
        )
        self.register_data(train_loader=train_loader, validation_loader=validation_loader)


def train_example(num_workers=1, use_gpu=False, epochs=5):
    trainer1 = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=num_workers,
        use_gpu=use_gpu,
        config={"lr": 0.3, BATCH_SIZE: 64},
        backend="gloo",
        scheduler_step_freq="epoch",
    )
    for _ in range(epochs):
        stats = trainer1.train()
        print(stats)

    print(trainer1.validate())
    model = trainer1.get_model()
    print(f"trained weight: {model.weight.item():.2f}, bias: {model.bias.item():.2f}")

    checkpoint = os.path.join(tempfile.mkdtemp(), "checkpoint")
    trainer1.save(checkpoint)
    trainer1.shutdown()

    trainer2 = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=num_workers,
        use_gpu=use_gpu,
        config={"lr": 0.3, BATCH_SIZE: 64},
        scheduler_step_freq="epoch",
    )
    trainer2.load(checkpoint)
    print("restored:", trainer2.validate())
    trainer2.shutdown()
    print("success!")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=False, type=str, help="the address to use for Ray")
    parser.add_argument("--num-workers", "-n", type=int, default=1, help="Sets number of workers")
    parser.add_argument("--use-gpu", action="store_true", default=False, help="Enables GPU")
    parser.add_argument(
        "--smoke", "--smoke-test", dest="smoke", action="store_true", help="Finish quickly"
    )
    args, _ = parser.parse_known_args()

    ray.init(address=args.address)
    train_example(num_workers=args.num_workers, use_gpu=args.use_gpu, epochs=2 if args.smoke else 5)
    ray.shutdown()
