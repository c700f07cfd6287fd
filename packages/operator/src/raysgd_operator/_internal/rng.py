"""The random generators a worker's training draws from, as part of its state.

A run resumed from a checkpoint (or a worker that took another's state) goes on drawing the same
random numbers (dropout masks, random augmentations) as the run it continues: torch's CPU and CUDA
generators, Python's `random` and NumPy's global one. Kept as bytes, ints and tuples: cheap to
copy at every accumulation window's start and to send to a peer, and what
`torch.load(weights_only=True)` reads back. States saved as tensors (by earlier versions) are
read too.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

__all__ = ["generator_state", "rng_state", "set_generator_state", "set_rng_state"]


def generator_state(generator: torch.Generator) -> bytes:
    """`generator`'s state as bytes."""
    return generator.get_state().numpy().tobytes()


def set_generator_state(generator: torch.Generator, state: Any) -> None:
    """Put `generator` in `state` (what `generator_state` returned, or its tensor)."""
    generator.set_state(_as_tensor(state))


def rng_state() -> dict[str, Any]:
    """This process's generator states."""
    state: dict[str, Any] = {
        "torch": generator_state(torch.default_generator),
        "python": random.getstate(),
    }
    if torch.cuda.is_initialized():  # (cheap: no CUDA call; False without CUDA)
        state["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tobytes(), pos, has_gauss, cached]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (the generators it lacks are left as they are)."""
    if "torch" in state:
        torch.set_rng_state(_as_tensor(state["torch"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_as_tensor(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        if isinstance(keys, torch.Tensor):
            words = keys.numpy().astype("uint32")
        else:
            words = np.frombuffer(keys, dtype=np.uint32).copy()
        np.random.set_state((kind, words, pos, has_gauss, cached))


def _as_tensor(state: Any) -> Optional[torch.Tensor]:
    """A generator state as the uint8 tensor torch takes (from bytes or a tensor)."""
    if isinstance(state, torch.Tensor):
        return state
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)
