"""Every built-in backend (and a third-party one) passes raysgd_amp.testing.PrecisionConformance."""

from __future__ import annotations

import pytest
import torch

from raysgd_amp import FullPrecision, NativePrecision, Precision, get_precision
from raysgd_amp.testing import PrecisionConformance

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 on CUDA needs a GPU")

pytestmark = pytest.mark.timeout(60)

# GradScaler's default initial scale (2**16) overflows fp16 on this toy model's first gradients,
# so its first step is (correctly) skipped; these checks want a step that applies, so start lower.
# Skipping on overflow is tested on its own in test_native.py.
FP16_SCALER = {"init_scale": 2.0**8}


class TestFull(PrecisionConformance):
    grad_rtol = 1e-5

    def make_precision(self) -> Precision:
        return FullPrecision()


class TestBaseIsFullPrecision(PrecisionConformance):
    """The interface's own defaults are a working full-precision backend."""

    grad_rtol = 1e-5

    def make_precision(self) -> Precision:
        return Precision()


class TestBf16Cpu(PrecisionConformance):
    grad_rtol = 0.05  # bf16 keeps ~3 significant digits

    def make_precision(self) -> Precision:
        return get_precision("bf16", device="cpu")


class TestFp16CpuExplicit(PrecisionConformance):
    """fp16 + GradScaler on CPU: not what get_precision picks there, but available when asked."""

    grad_rtol = 0.01

    def make_precision(self) -> Precision:
        return NativePrecision("fp16", device="cpu", scaler_kwargs=FP16_SCALER)


@requires_cuda
class TestFp16Cuda(PrecisionConformance):
    device = torch.device("cuda")
    grad_rtol = 0.01

    def make_precision(self) -> Precision:
        return NativePrecision("fp16", device="cuda", scaler_kwargs=FP16_SCALER)


@pytest.mark.usefixtures("apex_standin")
class TestApexStandIn(PrecisionConformance):
    """Apex backend against tests/amp/apex_standin, a STAND-IN for NVIDIA Apex's documented `amp`
    calls: NVIDIA Apex cannot be installed here. It scales and skips like Apex but does not cast."""

    grad_rtol = 1e-5

    def make_precision(self) -> Precision:
        return get_precision("apex", apex_args={"opt_level": "O1"})


@pytest.mark.usefixtures("installed_plugin")
class TestEntryPointBackend(PrecisionConformance):
    """A third-party backend found through a real `raysgd.amp` entry point of an installed dist."""

    grad_rtol = 1e-5

    def make_precision(self) -> Precision:
        return get_precision("static_scale", device="cpu")
