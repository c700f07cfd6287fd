"""Starting (or joining) Ray and checking what the cluster offers, on the driver."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import torch

from raysgd_core import local_ray_options

__all__ = ["LOCAL_RAY_OPTIONS", "driver_has_cuda", "ensure_ray"]

logger = logging.getLogger("raysgd")

#: Options of the local instance raysgd starts when Ray is not initialised: raysgd_core's (no
#: dashboard, no metrics export). Worker logs are still forwarded to the driver (RaySGD users read
#: their prints there).
LOCAL_RAY_OPTIONS: dict[str, Any] = {**local_ray_options(), "log_to_driver": True}


def ensure_ray() -> bool:
    """Start a local Ray instance unless one is initialised; True when this call started it.

    `ray.init(address="auto")` before constructing the trainer joins a running cluster instead.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        # Set by `ray job submit` and by users who mean a cluster: join it, as ray.init() would.
        logger.info("Ray is not initialised: joining RAY_ADDRESS=%s", os.environ["RAY_ADDRESS"])
        ray.init(log_to_driver=True)
        return True
    logger.info(
        "Ray is not initialised: starting a local instance (call ray.init first to join a cluster)"
    )
    # address="local": a plain ray.init() would silently join any cluster some other process
    # started on this machine with `ray start`, which is not what an embedded default means.
    ray.init(address="local", **LOCAL_RAY_OPTIONS)
    return True


def driver_has_cuda() -> bool:
    """Whether this (driver) process can hold CUDA tensors; without it, models trained on GPUs
    must come back from the workers as CPU copies."""
    return torch.cuda.is_available()
