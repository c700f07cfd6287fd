"""Choosing a backend: `get_precision(use_fp16)`, named backends and the `raysgd.amp` entry points.

Resolution order: a `Precision` instance (or subclass) is used as given; booleans and built-in names
map to the built-in backends; other names are looked up among `register_precision` registrations,
then, lazily, among the entry points of group `raysgd.amp` of the installed distributions::

    [project.entry-points."raysgd.amp"]
    my_fp8 = "my_package.precision:Fp8Precision"

A factory (or class) is called with those of the keyword arguments `device` and `apex_args` that
its signature accepts, so a `Precision` subclass whose `__init__` takes no arguments works as is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

from raysgd_base import Registry, call_with_accepted

from .apex_args import check_apex_args
from .full import FullPrecision
from .native import NativePrecision, resolve_device
from .precision import Precision

__all__ = [
    "ENTRY_POINT_GROUP",
    "PrecisionFactory",
    "available_precisions",
    "check_precision",
    "get_precision",
    "register_precision",
]

logger = logging.getLogger("raysgd_amp")

ENTRY_POINT_GROUP = "raysgd.amp"

#: Builds a backend; called with the subset of `device=`, `apex_args=` that it accepts.
PrecisionFactory = Callable[..., Precision]


def _fp16(device: Optional[torch.device] = None) -> Precision:
    device = resolve_device(device)
    if device.type == "cpu":
        # Asking for fp16 where there is no GPU runs rather than fails. bf16 is the reduced
        # precision CPUs compute fast and it needs no loss scaling; fp16 on CPU stays available
        # as NativePrecision("fp16", device="cpu") for whoever wants exactly that.
        logger.warning("use_fp16='fp16' on CPU: running bf16 autocast instead (fp16 is for CUDA).")
        return NativePrecision("bf16", device)
    return NativePrecision("fp16", device)


def _auto(device: Optional[torch.device] = None) -> Precision:
    device = resolve_device(device)
    if device.type == "cpu":
        logger.info("use_fp16=True: no CUDA device, using native bf16 autocast on CPU.")
        return NativePrecision("bf16", device)
    logger.info("use_fp16=True: using native fp16 autocast with a GradScaler on %s.", device)
    return NativePrecision("fp16", device)


def _bf16(device: Optional[torch.device] = None) -> Precision:
    return NativePrecision("bf16", device)


def _apex(apex_args: Optional[Mapping[str, Any]] = None) -> Precision:
    from .apex import ApexPrecision  # imported when asked for: `import raysgd_amp` stays free of it

    return ApexPrecision(apex_args)


_registry = Registry(
    "precision backend",
    ENTRY_POINT_GROUP,
    {"full": FullPrecision, "fp32": FullPrecision, "fp16": _fp16, "bf16": _bf16, "apex": _apex},
    instance_type=Precision,  # an entry point may name a ready instance
)


def register_precision(
    name: str,
    factory: PrecisionFactory,
    *,
    overwrite: bool = False,
) -> None:
    """Make `get_precision(name)` build a backend with `factory` (a `Precision` subclass or callable).

    Names are case-insensitive. Registering a name that exists raises ValueError unless
    `overwrite` (the keyword every raysgd registry uses).
    """
    _registry.register(name, factory, overwrite=overwrite)


def available_precisions() -> list[str]:
    """Every name `get_precision` accepts: built-in, registered and entry-point backends."""
    return _registry.names()


def _build(name: str, factory: Any, device: Any, apex_args: Any) -> Precision:
    if isinstance(factory, Precision):  # an entry point may name a ready instance
        return factory
    backend = call_with_accepted(factory, {"device": device, "apex_args": apex_args})
    if not isinstance(backend, Precision):
        raise TypeError(
            f"precision backend {name!r} built {type(backend).__name__}, not a Precision"
        )
    return backend


_INTERFACE = (
    "setup",
    "autocast",
    "backward",
    "unscale",
    "step",
    "clip_grad_norm",
    "state_dict",
    "load_state_dict",
)


def _implements_interface(obj: Any) -> bool:
    """Duck typing for backends that do not subclass `Precision` but provide all of it."""
    if isinstance(obj, (type, str, bool)) or obj is None:
        return False
    has_methods = all(callable(getattr(obj, m, None)) for m in _INTERFACE)
    return has_methods and all(hasattr(obj, a) for a in ("name", "enabled", "dtype"))


def _choices() -> str:
    return f"False, True, a Precision instance, or one of {available_precisions()}"


def check_precision(use_fp16: Any, *, apex_args: Optional[Mapping[str, Any]] = None) -> None:
    """Raise as `get_precision(use_fp16, apex_args=apex_args)` would for a bad choice, without
    building a backend (so it runs on a machine without the backend's device or library).

    This is the one rule for what `use_fp16` may be; the trainer calls it on the driver.
    """
    check_apex_args(apex_args)
    if (
        use_fp16 is None
        or isinstance(use_fp16, (bool, Precision))
        or _implements_interface(use_fp16)
    ):
        return
    if isinstance(use_fp16, type) and issubclass(use_fp16, Precision):
        return
    if isinstance(use_fp16, str) and use_fp16 in _registry:
        return
    raise ValueError(f"use_fp16 must be {_choices()}; got {use_fp16!r}")


def get_precision(
    use_fp16: Union[bool, str, Precision, type, None],
    *,
    device: Union[torch.device, str, None] = None,
    apex_args: Optional[Mapping[str, Any]] = None,
) -> Precision:
    """Map RaySGD's `use_fp16` argument to a precision backend.

    - `False` / `None` / "full" / "fp32": full precision.
    - `True`: fp16 with a GradScaler on CUDA, bf16 autocast on CPU (one INFO log line says which).
    - "fp16": native fp16 with a GradScaler; on CPU it runs bf16 instead, with a WARNING line.
    - "bf16": native bf16 autocast, no loss scaling (CPU and CUDA).
    - "apex": NVIDIA Apex with `apex_args` for `amp.initialize`.
    - a `Precision` instance or subclass (or an object with the whole `Precision` interface);
      any other name: `register_precision` or entry points.

    `device` is where the model will run (default: CUDA if present, else CPU); call this where the
    model lives or pass it. Bad values raise ValueError listing the choices; a missing Apex raises
    `ApexNotAvailableError` (an ImportError).
    """
    check_apex_args(apex_args)
    if isinstance(use_fp16, Precision) or _implements_interface(use_fp16):
        return use_fp16  # type: ignore[return-value]
    if isinstance(use_fp16, type) and issubclass(use_fp16, Precision):
        return _build(use_fp16.__name__, use_fp16, device, apex_args)
    if use_fp16 is None or use_fp16 is False:
        return FullPrecision()
    if use_fp16 is True:
        return _auto(None if device is None else resolve_device(device))
    if not isinstance(use_fp16, str):
        raise ValueError(f"use_fp16 must be {_choices()}; got {use_fp16!r}")
    if use_fp16 not in _registry:
        # The message speaks of the trainer's argument: a name is only one of its choices.
        raise ValueError(f"use_fp16 must be {_choices()}; got {use_fp16!r}")
    key = use_fp16.strip().lower()
    dev = None if device is None else resolve_device(device)
    return _build(key, _registry.lookup(key), dev, apex_args)
