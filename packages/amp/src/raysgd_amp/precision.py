"""The precision interface that every backend implements.

A training loop talks to one `Precision` object and never to `torch.amp` or Apex directly::

    models, optimizers = precision.setup(models, optimizers, device)
    with precision.autocast():            # forward pass and loss
        loss = criterion(model(x), y)
    precision.backward(loss, optimizer)   # scaled backward where the backend scales
    precision.clip_grad_norm(model.parameters(), 1.0, optimizer)  # optional; unscales first
    applied = precision.step(optimizer)   # false when the backend skipped an overflowing step

The base class is itself a complete backend: full precision (fp32), no scaling, nothing to save.
Subclasses override only what differs, as the backends in `native` and `apex` do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ContextManager, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from raysgd_base import check_number

__all__ = ["Parameters", "Precision", "StepOutcome"]

logger = logging.getLogger("raysgd_amp")

#: What `clip_grad_norm` accepts: one tensor or an iterable of tensors (`model.parameters()`).
Parameters = Union[torch.Tensor, Iterable[torch.Tensor]]


class StepOutcome:
    """What `Precision.step` returns when whether the step was taken is known only on the
    device (fp16's inf/NaN check): true when the update was applied, false when it was skipped.
    The device's answer is read (a host synchronisation) only when the truth value is asked, so
    a loop that does not look at it waits for nothing more than the step itself does.

    Args:
        found_inf: The tensors whose sum is non-zero when an inf or NaN was found.
    """

    def __init__(self, found_inf: Sequence[torch.Tensor]) -> None:
        self._found_inf = list(found_inf)
        self._applied: Optional[bool] = None

    def __bool__(self) -> bool:
        if self._applied is None:
            self._applied = not any(t.item() for t in self._found_inf)
            self._found_inf = []
        return self._applied

    def __repr__(self) -> str:
        state = "unread" if self._applied is None else ("applied" if self._applied else "skipped")
        return f"StepOutcome({state})"


class Precision:
    """A precision backend; the defaults implement plain full precision (fp32).

    Method contract (the trainer and `TrainingOperator` rely on it):

    - `setup(models, optimizers, device)` is called once, after the models are on `device` and the
      optimizers are built, before DDP wrapping. It returns the (possibly replaced) models and
      optimizers; callers must use what it returns.
    - `autocast()` wraps the forward pass and the loss, not the backward pass.
    - `backward(loss, optimizer)` replaces `loss.backward()`.
    - `unscale(optimizer)` turns scaled gradients into true ones; calling it twice in one step is
      harmless. Call it before reading or clipping gradients.
    - `step(optimizer)` replaces `optimizer.step()` and returns whether the update was applied
      (a truth value: a bool, or a `StepOutcome` read from the device only when asked).
    - `state_dict()` holds only strings, numbers and tensors, so `torch.load(weights_only=True)`
      reads a checkpoint holding it. `load_state_dict()` may be called before or after `setup`.
    """

    #: Short name used in logs and in the state dict ("full", "bf16", "fp16", "apex", ...).
    name: str = "full"

    @property
    def enabled(self) -> bool:
        """Whether this backend computes in reduced precision (False for full precision)."""
        return False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype that `autocast()` computes in (`torch.float32` when not reduced)."""
        return torch.float32

    def param_dtypes(self) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
        """`(param_dtype, reduce_dtype)` for wrappers that cast parameters themselves (FSDP2).

        The one rule for sharded training: full precision keeps everything as it is
        (`(None, None)`); a reduced-precision backend computes in its `dtype` and reduces
        gradients in fp32, so that summing many workers' gradients loses no precision.
        """
        if not self.enabled:
            return None, None
        return self.dtype, torch.float32

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Optimizer],
        device: Union[torch.device, str, None],
    ) -> tuple[list[nn.Module], list[Optimizer]]:
        """Prepare models and optimizers for this backend; returns them as lists."""
        return list(models), list(optimizers)

    def autocast(self) -> ContextManager[Any]:
        """A context manager for the forward pass and loss computation."""
        return contextlib.nullcontext()

    def backward(
        self, loss: torch.Tensor, optimizer: Optional[Optimizer] = None, **kwargs: Any
    ) -> None:
        """Back-propagate `loss` (scaled where the backend scales); `kwargs` go to `Tensor.backward`.

        `optimizer` names the optimizer whose parameters receive these gradients; backends that
        track scaling per optimizer (Apex) need it when there are several.
        """
        loss.backward(**kwargs)

    def unscale(self, optimizer: Optimizer) -> None:
        """Divide `optimizer`'s gradients by the loss scale; a no-op without scaling."""

    def step(self, optimizer: Optimizer) -> Union[bool, StepOutcome]:
        """Apply `optimizer`'s update; returns a truth value, false if the backend skipped it
        (inf/NaN grads): a bool, or a `StepOutcome` that reads the device only when asked."""
        optimizer.step()
        return True

    def clip_grad_norm(
        self,
        parameters: Parameters,
        max_norm: float,
        optimizer: Optimizer,
        *,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale `optimizer`'s gradients, then clip `parameters` to `max_norm`.

        Returns the total gradient norm before clipping, as `torch.nn.utils.clip_grad_norm_` does.
        It is inf or NaN when the gradients overflowed; the next `step` then skips the update.
        """
        check_number("max_norm", max_norm, above=0)
        self.unscale(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def state_dict(self) -> dict[str, Any]:
        """The backend's own state (loss scale and such); empty when there is none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict()` returned; a state of another backend is ignored, with a log."""
        self._own_state(state)

    def _own_state(self, state: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """Validate `state`; return it if it belongs to this backend, else None.

        Resuming a checkpoint with another precision (say fp16 → bf16) is legitimate, and the old
        scaler state means nothing to the new backend, so it is dropped rather than raising.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if not state:
            return None
        if state.get("backend") != self.name:
            logger.warning(
                "Ignoring precision state of backend %r: the current backend is %r.",
                state.get("backend"),
                self.name,
            )
            return None
        return dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dtype={self.dtype})"
