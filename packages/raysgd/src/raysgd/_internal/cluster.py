"""What the driver process itself can hold (Ray is started by `raysgd_core.ensure_ray`)."""

from __future__ import annotations

import torch

__all__ = ["driver_has_cuda"]


def driver_has_cuda() -> bool:
    """Whether this (driver) process can hold CUDA tensors; without it, models trained on GPUs
    must come back from the workers as CPU copies."""
    return torch.cuda.is_available()
