"""A STAND-IN for `apex.amp` implementing the documented calls raysgd-amp uses, in fp32 on CPU.

What it reproduces from Apex's documentation (https://nvidia.github.io/apex/amp.html): `initialize`
returns the models and optimizers in the shape they were given; `scale_loss` yields
`loss.float() * loss_scale`, and on exit unscales the gradients and checks them for inf/NaN; on
overflow the dynamic scaler halves its scale and the next `optimizer.step()` is skipped; the scale
doubles after 2000 clean steps; `state_dict` is `{"loss_scaler0": {"loss_scale", "unskipped"}}`;
`master_params(optimizer)` yields the parameters the optimizer updates. It does NOT cast to fp16
(real O1/O2 do); what is tested through it is raysgd-amp's plumbing, not Apex's numerics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_state: dict[str, Any] = {"initialized": False}


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Any = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Record the options and a fresh loss scaler; return models/optimizers unchanged."""
    if opt_level not in _OPT_LEVELS:
        raise RuntimeError(f"Unexpected optimization level {opt_level}")
    dynamic = loss_scale in (None, "dynamic")
    _state.update(
        initialized=True,
        enabled=enabled and opt_level != "O0",
        opt_level=opt_level,
        dynamic=dynamic,
        loss_scale=2.0**16 if dynamic else float(loss_scale),
        unskipped=0,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )
    return models if optimizers is None else (models, optimizers)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters `optimizer` steps (fp32 master weights in real O2)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def _skip_next_step(optimizer: torch.optim.Optimizer) -> None:
    original = optimizer.step

    def skip_step(closure: Any = None) -> None:
        optimizer.step = original  # skip once, as Apex's patched step does

    optimizer.step = skip_step


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor, optimizers: Any, loss_id: int = 0, **kwargs: Any
) -> Iterator[torch.Tensor]:
    """Yield the scaled loss; on exit unscale the grads, detect overflow, update the scale."""
    if not _state["initialized"]:
        raise RuntimeError("amp.initialize must be called before amp.scale_loss")
    if not _state["enabled"]:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    scale = _state["loss_scale"]
    yield loss.float() * scale
    overflow = False
    for optimizer in optimizers:
        for p in master_params(optimizer):
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)
                overflow = overflow or not bool(torch.isfinite(p.grad).all())
    if overflow and _state["dynamic"]:
        _state["loss_scale"] = max(scale / 2.0, _state["min_loss_scale"] or 0.0)
        _state["unskipped"] = 0
        for optimizer in optimizers:
            _skip_next_step(optimizer)
    elif _state["dynamic"]:
        _state["unskipped"] += 1
        if _state["unskipped"] == 2000:
            _state["loss_scale"] = min(scale * 2.0, _state["max_loss_scale"])
            _state["unskipped"] = 0


def state_dict() -> dict[str, dict[str, Any]]:
    return {"loss_scaler0": {"loss_scale": _state["loss_scale"], "unskipped": _state["unskipped"]}}


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    _state["loss_scale"] = float(state["loss_scaler0"]["loss_scale"])
    _state["unskipped"] = int(state["loss_scaler0"]["unskipped"])
