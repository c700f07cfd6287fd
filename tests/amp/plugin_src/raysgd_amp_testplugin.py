"""A third-party precision backend, installed by the tests through a real `raysgd.amp` entry point.

Static loss scaling in fp32: a different behaviour from the built-ins, written only against the
public `raysgd_amp.Precision` interface, as an outside package would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from raysgd_amp import Precision

__all__ = ["StaticScalePrecision"]


class StaticScalePrecision(Precision):
    """Multiply the loss by a fixed power of two; skip steps whose grads are not finite."""

    name = "static_scale"

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device  # accepted to show that factories receive get_precision's device
        self.scale = 1024.0
        self.skipped = 0
        self._unscaled: set[int] = set()

    def backward(
        self, loss: torch.Tensor, optimizer: Optional[Optimizer] = None, **kwargs: Any
    ) -> None:
        (loss * self.scale).backward(**kwargs)

    def unscale(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Optimizer) -> bool:
        self.unscale(optimizer)
        self._unscaled.discard(id(optimizer))
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.skipped += 1
            return False
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"backend": self.name, "scale": self.scale, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        own = self._own_state(state)
        if own is not None:
            self.scale, self.skipped = float(own["scale"]), int(own["skipped"])
