"""The random generators a worker's training draws from, as part of its state.

A run resumed from a checkpoint (or a worker that took another's state) goes on drawing the same
random numbers (dropout masks, random augmentations) as the run it continues: torch's CPU and CUDA
generators, Python's `random` and NumPy's global one. Kept in plain tensors, ints and lists, which
`torch.load(weights_only=True)` reads back.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's generator states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (the generators it lacks are left as they are)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
