"""What the driver process itself can hold (Ray is started by `raysgd_core.ensure_ray`)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["available_memory_bytes", "driver_has_cuda"]


def driver_has_cuda() -> bool:
    """Whether this (driver) process can hold CUDA tensors; without it, models trained on GPUs
    must come back from the workers as CPU copies."""
    return torch.cuda.is_available()


def available_memory_bytes() -> Optional[int]:
    """Memory this machine can still give a process (Linux's MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
