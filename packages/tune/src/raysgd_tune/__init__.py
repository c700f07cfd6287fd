"""Ray Tune adapters for raysgd.

- `make_trainable` / `BaseTorchTrainable`: a Tune class trainable that runs one raysgd `TorchTrainer`
  per trial (what `TorchTrainer.as_trainable` returns).
- `current_trial()`: which Tune trial this process runs (None outside Tune), for the experiment
  loggers of a trainer built in a trial.
- `DistributedTrainableCreator`: runs a plain Tune function data-parallel on several workers per trial,
  with `distributed_checkpoint_dir` and `is_distributed_trainable` for use inside it.

It uses raysgd_core only and never imports the trainer: the trainer class is an argument
(`make_trainable(trainer_cls, ...)`). The RaySGD names bound to raysgd's trainer
(`raysgd.torch.PyTorchTrainable`, ...) live in the `raysgd` package.
"""

from raysgd_tune.distributed import (
    DistributedTrainableCreator,
    distributed_checkpoint_dir,
    is_distributed_trainable,
)
from raysgd_tune.trainable import BaseTorchTrainable, current_trial, make_trainable

__version__ = "0.1.0"
__all__ = [
    "BaseTorchTrainable",
    "DistributedTrainableCreator",
    "current_trial",
    "distributed_checkpoint_dir",
    "is_distributed_trainable",
    "make_trainable",
]
