"""Native PyTorch mixed precision: `torch.autocast`, plus a `GradScaler` for fp16.

bf16 has fp32's exponent range, so gradients do not underflow and no loss scaling is needed; fp16
does need it, so the fp16 backend owns a `torch.amp.GradScaler` (created in `setup`, when the device
is known). Both work on CPU and CUDA; `get_precision` prefers bf16 on CPU and fp16 on CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ContextManager, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from .precision import Precision, StepOutcome

__all__ = ["NativePrecision", "resolve_device"]

_DTYPES: dict[Any, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    torch.float16: torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    torch.bfloat16: torch.bfloat16,
}


def resolve_device(device: Union[torch.device, str, int, None]) -> torch.device:
    """`device` as a `torch.device`; None means the current CUDA device if there is one, else CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be a torch.device, a device string or None, got {device!r}"
        ) from exc


def _make_scaler(device_type: str, kwargs: Mapping[str, Any]) -> Any:
    if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3: one scaler class for every device type
        return torch.amp.GradScaler(device_type, **kwargs)
    if device_type == "cuda":
        return torch.cuda.amp.GradScaler(**kwargs)
    raise ValueError(f"fp16 loss scaling on {device_type!r} needs torch >= 2.3")


class NativePrecision(Precision):
    """`torch.autocast` in fp16 (with a `GradScaler`) or bf16 (without one).

    Args:
        dtype: "fp16" / "float16" / `torch.float16`, or "bf16" / "bfloat16" / `torch.bfloat16`.
        device: where autocast runs. `setup`'s device takes precedence; None means CUDA if present.
        scaler_kwargs: keyword arguments for `torch.amp.GradScaler` (fp16 only), e.g.
            `{"init_scale": 2.0**10, "growth_interval": 100}`.

    With several optimizers in one iteration, the scaler is updated once, after the last
    optimizer that was unscaled has stepped (as PyTorch's GradScaler documentation asks), or at
    the latest before the next `backward`.
    """

    def __init__(
        self,
        dtype: Union[str, torch.dtype] = "bf16",
        device: Union[torch.device, str, int, None] = None,
        *,
        scaler_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> None:
        key = dtype.lower() if isinstance(dtype, str) else dtype
        if key not in _DTYPES:
            raise ValueError(f"dtype must be 'fp16' or 'bf16' (or the torch dtypes), got {dtype!r}")
        self._dtype = _DTYPES[key]
        self.name = "fp16" if self._dtype == torch.float16 else "bf16"
        if scaler_kwargs is not None and not isinstance(scaler_kwargs, Mapping):
            raise TypeError(f"scaler_kwargs must be a dict, got {type(scaler_kwargs).__name__}")
        if scaler_kwargs and self._dtype != torch.float16:
            raise ValueError("scaler_kwargs only apply to fp16; bf16 uses no loss scaling")
        self._scaler_kwargs = dict(scaler_kwargs or {})
        self._device = None if device is None else resolve_device(device)
        self._scaler: Any = None
        self._pending_state: Optional[dict[str, Any]] = None
        # ids of optimizers unscaled this iteration; GradScaler refuses a second unscale_.
        self._unscaled: set[int] = set()
        self._update_pending = False

    @property
    def enabled(self) -> bool:
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The device autocast runs on (fixed by `setup`)."""
        if self._device is None:
            self._device = resolve_device(None)
        return self._device

    @property
    def scaler(self) -> Any:
        """The `torch.amp.GradScaler` (fp16 after `setup`), else None."""
        return self._scaler

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Optimizer],
        device: Union[torch.device, str, None],
    ) -> tuple[list[nn.Module], list[Optimizer]]:
        if device is not None:
            self._device = resolve_device(device)
        device_type = self.device.type
        is_available = getattr(torch.amp.autocast_mode, "is_autocast_available", None)
        if is_available is not None and not is_available(device_type):
            raise ValueError(f"torch.autocast does not support device type {device_type!r}")
        if self._dtype == torch.float16:
            if self._scaler is not None and self._pending_state is None:
                # set up again (the trainer re-binds after recovery): keep the learned scale
                self._flush_update()
                self._pending_state = {"backend": self.name, "scaler": self._scaler.state_dict()}
            self._scaler = _make_scaler(device_type, self._scaler_kwargs)
            self._unscaled.clear()
            if self._pending_state is not None:
                self._scaler.load_state_dict(self._pending_state["scaler"])
                self._pending_state = None
        return list(models), list(optimizers)

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(device_type=self.device.type, dtype=self._dtype)

    def backward(
        self, loss: torch.Tensor, optimizer: Optional[Optimizer] = None, **kwargs: Any
    ) -> None:
        if self._scaler is None:
            loss.backward(**kwargs)
            return
        self._flush_update()  # a new iteration starts: apply the last one's scale update
        self._scaler.scale(loss).backward(**kwargs)

    def unscale(self, optimizer: Optimizer) -> None:
        if self._scaler is None or id(optimizer) in self._unscaled:
            return
        self._scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Optimizer) -> Union[bool, StepOutcome]:
        if self._scaler is None:
            optimizer.step()
            return True
        # GradScaler.step returns optimizer.step()'s value (usually None) whether or not it
        # skipped; the per-optimizer inf record that unscale_ fills is the only direct answer.
        # It is kept, not read: a loop that asks (`bool(...)`) waits for the device then, one
        # that does not (the default loop) pays no host synchronisation beyond the step's own
        # (GradScaler waits for it unless the optimizer takes the scaling itself: a fused one).
        self.unscale(optimizer)
        found_inf = list(self._scaler._found_inf_per_device(optimizer).values())
        self._scaler.step(optimizer)  # skips the update on inf/NaN
        self._unscaled.discard(id(optimizer))
        self._update_pending = True
        if not self._unscaled:  # no other optimizer waits for its step in this iteration
            self._flush_update()
        return StepOutcome(found_inf)

    def _flush_update(self) -> None:
        if self._update_pending:
            self._scaler.update()
            self._update_pending = False
            self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        if self._scaler is not None:
            self._flush_update()
            return {"backend": self.name, "scaler": dict(self._scaler.state_dict())}
        return dict(self._pending_state or {})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        own = self._own_state(state)
        if own is None:
            return
        if not isinstance(own.get("scaler"), Mapping):
            raise ValueError(f"{self.name} precision state has no 'scaler' dict: {own!r}")
        if self._scaler is not None:
            self._scaler.load_state_dict(dict(own["scaler"]))
        else:  # before setup: the scaler does not exist yet
            self._pending_state = own

    def __repr__(self) -> str:
        device = self._device if self._device is not None else "auto"
        return f"NativePrecision(dtype={self.name!r}, device={str(device)!r})"
