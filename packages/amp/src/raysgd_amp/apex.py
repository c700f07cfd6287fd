"""NVIDIA Apex AMP (`apex.amp`), kept for RaySGD scripts that used `use_fp16="apex"`.

Apex is imported only when an `ApexPrecision` is constructed. It is not on PyPI: the PyPI project
named `apex` is unrelated, and raysgd never depends on it. `apex.amp` itself was deprecated in
favour of `torch.amp` and left NVIDIA Apex after its 25.04 release; new code should use the
native backend (`use_fp16="fp16"`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, ContextManager, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from .apex_args import check_apex_args
from .precision import Parameters, Precision

__all__ = ["ApexNotAvailableError", "ApexPrecision"]


_BUILD_HINT = (
    "NVIDIA Apex is not on PyPI: `pip install apex` installs an unrelated project of the same "
    "name. Build it from source instead (a CUDA toolkit matching your torch is needed):\n"
    "    git clone https://github.com/NVIDIA/apex && cd apex\n"
    "    pip install -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
    "--config-settings '--build-option=--cuda_ext' ./\n"
    "apex.amp was removed after Apex 25.04 (check out that tag). Or use PyTorch's own mixed "
    "precision instead: use_fp16='fp16' (or True)."
)


class ApexNotAvailableError(ImportError):
    """Raised when `use_fp16="apex"` is asked for but `apex.amp` cannot be imported."""


def _import_amp() -> ModuleType:
    try:
        import apex
    except ImportError as exc:
        raise ApexNotAvailableError(
            f"use_fp16='apex' needs NVIDIA Apex, which is not installed. {_BUILD_HINT}"
        ) from exc
    try:
        from apex import amp
    except ImportError as exc:
        where = getattr(apex, "__file__", None) or "an unknown location"
        raise ApexNotAvailableError(
            f"An `apex` module is importable (from {where}) but it has no `amp`: it is either the "
            f"unrelated PyPI project called apex or an NVIDIA Apex newer than 25.04. {_BUILD_HINT}"
        ) from exc
    return amp


class ApexPrecision(Precision):
    """Mixed precision through `apex.amp.initialize` and `apex.amp.scale_loss`.

    Args:
        apex_args: keyword arguments for `amp.initialize` (e.g. `{"opt_level": "O2"}`); Apex's
            default opt level is "O1". RaySGD passed them the same way.

    Apex casts and patches by itself (O1 patches torch functions, O2/O3 cast the model), so
    `autocast()` is a no-op. Gradients come out of `backward` already unscaled, and Apex skips an
    overflowing step inside `optimizer.step()`; `step` reports that skip. Apex keeps global
    state, so use one `ApexPrecision` per process.
    """

    name = "apex"

    def __init__(self, apex_args: Optional[Mapping[str, Any]] = None) -> None:
        check_apex_args(apex_args)
        self.apex_args: dict[str, Any] = dict(apex_args or {})
        self._amp = _import_amp()  # fail at construction, not in the middle of training
        self._optimizers: list[Optimizer] = []
        self._pending_state: Optional[dict[str, Any]] = None
        self._overflowed: set[int] = set()

    # Derived from `apex_args` on every read: callers may add options (RaySGD's
    # `register(apex_args=...)`) after construction, up to `setup`.
    @property
    def _opt_level(self) -> str:
        return str(self.apex_args.get("opt_level", "O1")).upper()

    @property
    def _master_weights(self) -> bool:
        # O2 keeps fp32 master weights inside the optimizer; their grads are the ones to clip.
        return bool(self.apex_args.get("master_weights", self._opt_level == "O2"))

    @property
    def enabled(self) -> bool:
        return bool(self.apex_args.get("enabled", True)) and self._opt_level != "O0"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.enabled else torch.float32

    def setup(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Optimizer],
        device: Union[torch.device, str, None],
    ) -> tuple[list[nn.Module], list[Optimizer]]:
        new_models, new_optimizers = self._amp.initialize(
            list(models), list(optimizers), **self.apex_args
        )
        self._optimizers = list(new_optimizers)
        if self._pending_state is not None:  # Apex can only load its state after initialize
            self._amp.load_state_dict(self._pending_state["amp"])
            self._pending_state = None
        return list(new_models), list(new_optimizers)

    def autocast(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def _loss_scales(self) -> list[float]:
        return [float(s["loss_scale"]) for s in self._amp.state_dict().values()]

    def backward(
        self, loss: torch.Tensor, optimizer: Optional[Optimizer] = None, **kwargs: Any
    ) -> None:
        if not self._optimizers:
            raise RuntimeError("ApexPrecision.backward called before setup (amp.initialize)")
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        before = self._loss_scales()
        with self._amp.scale_loss(loss, optimizers) as scaled_loss:
            scaled_loss.backward(**kwargs)
        # A dynamic loss scaler halves its scale exactly when it found inf/NaN and arranged for
        # the next optimizer.step() to be skipped; amp.state_dict() is Apex's documented view.
        if any(after < prev for after, prev in zip(self._loss_scales(), before)):
            self._overflowed.update(id(o) for o in optimizers)

    def step(self, optimizer: Optimizer) -> bool:
        stash = getattr(optimizer, "_amp_stash", None)  # real Apex marks a patched, skipping step
        skipped = id(optimizer) in self._overflowed or bool(
            getattr(stash, "already_patched", False)
        )
        optimizer.step()  # Apex's patched step does the skipping
        self._overflowed.discard(id(optimizer))
        return not skipped

    def clip_grad_norm(
        self,
        parameters: Parameters,
        max_norm: float,
        optimizer: Optimizer,
        *,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        if self._master_weights:  # Apex's advice: clip the fp32 master grads the optimizer applies
            parameters = list(self._amp.master_params(optimizer))
        return super().clip_grad_norm(parameters, max_norm, optimizer, norm_type=norm_type)

    def state_dict(self) -> dict[str, Any]:
        if not self._optimizers:
            return dict(self._pending_state or {})
        amp_state = {k: dict(v) for k, v in self._amp.state_dict().items()}
        return {"backend": self.name, "amp": amp_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        own = self._own_state(state)
        if own is None:
            return
        if not isinstance(own.get("amp"), Mapping):
            raise ValueError(f"apex precision state has no 'amp' dict: {own!r}")
        if self._optimizers:
            self._amp.load_state_dict(dict(own["amp"]))
        else:
            self._pending_state = own

    def __repr__(self) -> str:
        return f"ApexPrecision(apex_args={self.apex_args!r})"
