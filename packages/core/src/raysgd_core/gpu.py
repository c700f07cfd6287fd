"""Whether workers use GPUs: RaySGD's `use_gpu` argument turned into a bool, one rule for every
caller (the trainer and the Tune adapters)."""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["require_cluster_gpus", "resolve_use_gpu"]


def resolve_use_gpu(use_gpu: Any) -> bool:
    """`use_gpu` ("auto" | None | bool | 0 | 1) as a bool; anything else raises ValueError.

    "auto" (and None) mean "CUDA is visible in this process" (RaySGD's rule, applied where the
    trainer or the Tune trial is built). Needs no Ray: pair it with `require_cluster_gpus` where the
    workers are about to be placed.
    """
    if use_gpu is None or use_gpu == "auto":
        # Imported here: `import raysgd_core` stays light for frameworks that only want the pool.
        import torch

        return torch.cuda.is_available()
    if isinstance(use_gpu, bool):
        return use_gpu
    if isinstance(use_gpu, int) and use_gpu in (0, 1):
        return bool(use_gpu)
    raise ValueError(f"use_gpu must be 'auto', True or False, got {use_gpu!r}")


def require_cluster_gpus() -> None:
    """Raise ValueError when the connected Ray cluster has no GPU at all.

    Without this check a GPU worker would wait for a placement that can never happen.
    """
    if ray.cluster_resources().get("GPU", 0) < 1:
        raise ValueError(
            "use_gpu=True, but the Ray cluster has no GPUs: pass use_gpu=False (or 'auto'), "
            "or start Ray on machines with GPUs"
        )
