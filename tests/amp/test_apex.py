"""The Apex backend. NVIDIA Apex cannot be installed here, so these tests run it against a
STAND-IN (tests/amp/apex_standin) that implements Apex's documented `amp` calls; they check
raysgd-amp's use of those calls, not Apex itself. The error for a missing Apex needs no stand-in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from raysgd_amp import ApexNotAvailableError, get_precision

pytestmark = pytest.mark.timeout(60)


def _setup(apex_args: dict | None = None) -> tuple:
    precision = get_precision("apex", apex_args=apex_args)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model,), (opt,) = precision.setup([model], [opt], "cpu")
    return precision, model, opt


def test_apex_args_reach_amp_initialize(apex_standin: ModuleType) -> None:
    precision, _, _ = _setup({"opt_level": "O2", "loss_scale": 128.0})
    assert apex_standin._state["opt_level"] == "O2" and apex_standin._state["loss_scale"] == 128.0
    assert precision.enabled and precision.dtype == torch.float16
    assert precision.state_dict() == {
        "backend": "apex",
        "amp": {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}},
    }


def test_o0_is_full_precision(apex_standin: ModuleType) -> None:
    precision, _, _ = _setup({"opt_level": "O0"})
    assert not precision.enabled and precision.dtype == torch.float32


def test_overflow_skips_the_step_and_halves_the_scale(apex_standin: ModuleType) -> None:
    precision, model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    precision.backward(model(torch.ones(2, 4)).sum() * 1e38, opt)  # x 2**16: inf
    assert not precision.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert precision.state_dict()["amp"]["loss_scaler0"]["loss_scale"] == 2.0**15

    opt.zero_grad()
    precision.backward(model(torch.ones(2, 4)).sum(), opt)
    assert precision.step(opt)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_backward_before_setup_is_an_error(apex_standin: ModuleType) -> None:
    precision = get_precision("apex")
    with pytest.raises(RuntimeError, match="before setup"):
        precision.backward(torch.ones(1, requires_grad=True).sum())


def test_missing_apex_says_how_to_build_it(no_apex: None) -> None:
    with pytest.raises(ImportError) as info:
        get_precision("apex")
    assert isinstance(info.value, ApexNotAvailableError)
    message = str(info.value)
    assert "not on PyPI" in message and "unrelated" in message
    assert "https://github.com/NVIDIA/apex" in message and "use_fp16='fp16'" in message


def test_unrelated_pypi_apex_is_recognised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An `apex` without `amp` (the PyPI project of that name) gets its own explanation."""
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text('"""Not NVIDIA Apex."""\n', encoding="utf-8")
    saved = {
        k: sys.modules.pop(k) for k in list(sys.modules) if k == "apex" or k.startswith("apex.")
    }
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ApexNotAvailableError, match="has no `amp`") as info:
            get_precision("apex")
        assert "unrelated PyPI project" in str(info.value) and str(tmp_path) in str(info.value)
    finally:
        for key in [k for k in sys.modules if k == "apex" or k.startswith("apex.")]:
            del sys.modules[key]
        sys.modules.update(saved)


def test_importing_raysgd_amp_imports_neither_apex_nor_ray() -> None:
    code = (
        "import sys, raysgd_amp; raysgd_amp.get_precision(True, device='cpu'); "
        "print(sorted(m for m in ('apex', 'ray', 'raysgd_amp.apex') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_apex_args_added_after_construction_count(apex_standin: ModuleType) -> None:
    """The operator merges `register(apex_args=...)` into `apex_args` before `setup`."""
    precision = get_precision("apex")
    precision.apex_args.update(opt_level="O0")
    assert not precision.enabled
    model = nn.Linear(2, 1)
    precision.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)], "cpu")
    assert apex_standin._state["opt_level"] == "O0"
