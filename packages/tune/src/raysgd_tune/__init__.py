"""Ray Tune adapters for raysgd.

- `make_trainable` / `BaseTorchTrainable`: a Tune class trainable that runs one raysgd `TorchTrainer`
  per trial (what `TorchTrainer.as_trainable` returns).
- `DistributedTrainableCreator`: runs a plain Tune function data-parallel on several workers per trial,
  with `distributed_checkpoint_dir` and `is_distributed_trainable` for use inside it.
- `PyTorchTrainable`: the earliest RaySGD's trainable, configured entirely through the Tune config.
"""

from raysgd_tune.distributed import (
    DistributedTrainableCreator,
    distributed_checkpoint_dir,
    is_distributed_trainable,
)
from raysgd_tune.legacy import PyTorchTrainable
from raysgd_tune.trainable import BaseTorchTrainable, make_trainable

__version__ = "0.1.0"
__all__ = [
    "BaseTorchTrainable",
    "DistributedTrainableCreator",
    "PyTorchTrainable",
    "distributed_checkpoint_dir",
    "is_distributed_trainable",
    "make_trainable",
]
