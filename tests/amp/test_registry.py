"""get_precision: the use_fp16 choices, their log lines, registration, entry points, bad values."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

import raysgd_amp
from raysgd_amp import FullPrecision, NativePrecision, Precision, get_precision, register_precision
from raysgd_amp import registry as registry_module

pytestmark = pytest.mark.timeout(60)


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "raysgd_amp" and r.levelno == level]


@pytest.mark.parametrize("value", [False, None, "full", "FP32"])
def test_off_values_give_full_precision(value: object) -> None:
    precision = get_precision(value)  # type: ignore[arg-type]
    assert isinstance(precision, FullPrecision) and not precision.enabled


def test_true_on_cpu_picks_bf16_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raysgd_amp"):
        precision = get_precision(True, device="cpu")
    assert isinstance(precision, NativePrecision) and precision.dtype == torch.bfloat16
    infos = _records(caplog, logging.INFO)
    assert len(infos) == 1 and "bf16" in infos[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_true_on_cuda_picks_fp16_with_a_scaler(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raysgd_amp"):
        precision = get_precision(True)
    precision.setup([], [], "cuda")
    assert precision.dtype == torch.float16 and precision.scaler is not None
    assert len(_records(caplog, logging.INFO)) == 1


def test_fp16_on_cpu_runs_bf16_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="raysgd_amp"):
        precision = get_precision("fp16", device="cpu")
    assert precision.dtype == torch.bfloat16 and precision.name == "bf16"
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "bf16" in warnings[0]


def test_instances_and_classes_are_used_as_given() -> None:
    mine = NativePrecision("bf16")
    assert get_precision(mine) is mine
    assert isinstance(get_precision(FullPrecision), FullPrecision)


@pytest.mark.parametrize("bad", ["fp8", "yes", 1, 0, 1.5, ["fp16"]])
def test_bad_values_list_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match="use_fp16 must be") as info:
        get_precision(bad)  # type: ignore[arg-type]
    for choice in ("True", "'fp16'", "'bf16'", "'apex'", "Precision instance"):
        assert choice in str(info.value)


def test_apex_args_must_be_a_dict() -> None:
    with pytest.raises(TypeError, match="apex_args"):
        get_precision("apex", apex_args="O2")  # type: ignore[arg-type]


def test_register_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_registry", registry_module._registry.copy())

    class Tagged(Precision):
        name = "tagged"

        def __init__(self, device: torch.device | None = None) -> None:
            self.device = device

    register_precision("Tagged", Tagged)
    built = get_precision("TAGGED", device="cpu")
    assert isinstance(built, Tagged) and built.device == torch.device("cpu")
    assert "tagged" in raysgd_amp.available_precisions()
    with pytest.raises(ValueError, match="already registered"):
        register_precision("tagged", Tagged)
    with pytest.raises(ValueError, match="already registered"):
        register_precision("fp16", Tagged)
    register_precision("bad", lambda: object())
    with pytest.raises(TypeError, match="not a Precision"):
        get_precision("bad")
    with pytest.raises(TypeError, match="factory"):
        register_precision("x", "not callable")  # type: ignore[arg-type]


def test_entry_point_backend_is_found_by_name(installed_plugin: Path) -> None:
    assert "static_scale" in raysgd_amp.available_precisions()
    precision = get_precision("static_scale", device="cpu")
    assert type(precision).__module__ == "raysgd_amp_testplugin"
    assert precision.device == torch.device("cpu")  # the factory received get_precision's device
    assert Path(sys.modules["raysgd_amp_testplugin"].__file__).parent == installed_plugin


def test_entry_point_backend_skips_nonfinite_steps(installed_plugin: Path) -> None:
    precision = get_precision("static_scale")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.setup([model], [opt], "cpu")
    precision.backward(model(torch.ones(1, 2)).sum() * float("inf"), opt)
    assert not precision.step(opt)
    assert precision.state_dict()["skipped"] == 1


def test_unknown_name_without_the_plugin_installed() -> None:
    with pytest.raises(ValueError, match="static_scale"):
        get_precision("static_scale")


def test_broken_entry_point_names_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[raysgd.amp]\nbroken = no_such_module_xyz:Thing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"'broken'.*no_such_module_xyz"):
        get_precision("broken")


def test_a_duck_typed_backend_is_used_as_given() -> None:
    """An object with the whole interface passes, as the trainer's own validation allows."""

    class Duck:
        name, enabled, dtype = "duck", False, torch.float32
        setup = autocast = backward = unscale = step = clip_grad_norm = staticmethod(print)
        state_dict = load_state_dict = staticmethod(print)

    duck = Duck()
    assert get_precision(duck) is duck  # type: ignore[arg-type]
    del Duck.unscale
    with pytest.raises(ValueError, match="use_fp16 must be"):
        get_precision(Duck())  # type: ignore[arg-type]


def test_register_keyword_is_overwrite_like_the_fault_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry_module, "_registry", registry_module._registry.copy())
    register_precision("mine", FullPrecision)
    register_precision("mine", NativePrecision, overwrite=True)
    assert isinstance(get_precision("mine", device="cpu"), NativePrecision)
    with pytest.raises(TypeError, match="replace"):
        register_precision("mine", FullPrecision, replace=True)  # type: ignore[call-arg]
    assert isinstance(get_precision("mine", device="cpu"), NativePrecision)
