"""Distributed PyTorch training on Ray: the RaySGD TorchTrainer, back on today's Ray and PyTorch.

A RaySGD script migrates by replacing ``ray.util.sgd`` with ``raysgd`` in its imports::

    from raysgd import TorchTrainer
    from raysgd.torch import TrainingOperator
    from raysgd.utils import BATCH_SIZE

Importing raysgd does not import Ray Tune; the Tune names (``raysgd.torch.BaseTorchTrainable``, ...)
load it when first used.
"""

from raysgd._internal.state.plan import StateLostError
from raysgd.compat import PyTorchTrainer
from raysgd.trainer import TorchTrainer
from raysgd_operator import (
    BATCH_SIZE,
    DatasetOptions,
    TrainingOperator,
    measure_flops_per_sample,
    peak_flops_per_s,
)

__version__ = "0.1.0"
__all__ = [
    "BATCH_SIZE",
    "DatasetOptions",
    "PyTorchTrainer",
    "StateLostError",
    "TorchTrainer",
    "TrainingOperator",
    "__version__",
    "measure_flops_per_sample",
    "peak_flops_per_s",
]
