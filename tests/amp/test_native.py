"""Native torch.amp backends: bf16 autocast, fp16 with a GradScaler (CPU, and CUDA when present)."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from torch import nn

from raysgd_amp import NativePrecision, get_precision

pytestmark = pytest.mark.timeout(60)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def _setup(precision: NativePrecision, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model,), (opt,) = precision.setup([model], [opt], device)
    return model, opt


def _loss(model: nn.Module, device: str, factor: float = 1.0) -> torch.Tensor:
    x = torch.ones(8, 4, device=device)
    return model(x).float().pow(2).mean() * factor


def test_bf16_autocast_changes_forward_dtype_on_cpu() -> None:
    precision = get_precision("bf16", device="cpu")
    model, _ = _setup(precision, "cpu")
    assert precision.enabled and precision.dtype == torch.bfloat16
    with precision.autocast():
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    assert model(torch.randn(3, 4)).dtype == torch.float32  # only inside the context
    assert precision.scaler is None and precision.state_dict() == {}


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_inf_grads_skip_step_and_lower_scale(device: str) -> None:
    precision = NativePrecision("fp16", device=device)
    model, opt = _setup(precision, device)
    with precision.autocast():
        out = model(torch.randn(3, 4, device=device))
    assert out.dtype == torch.float16

    before = [p.detach().clone() for p in model.parameters()]
    scale = precision.scaler.get_scale()
    with precision.autocast():
        loss = _loss(model, device, factor=1e38)  # times the 2**16 scale: inf in fp32
    precision.backward(loss, opt)
    assert not precision.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert precision.scaler.get_scale() == scale * 0.5
    assert precision.state_dict()["scaler"]["scale"] == scale * 0.5

    opt.zero_grad()
    with precision.autocast():
        loss = _loss(model, device)
    precision.backward(loss, opt)
    assert precision.step(opt)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_unscale_divides_by_the_scale_once(device: str) -> None:
    precision = NativePrecision("fp16", device=device, scaler_kwargs={"init_scale": 2.0**10})
    model, opt = _setup(precision, device)
    with precision.autocast():
        loss = _loss(model, device)
    precision.backward(loss, opt)
    scaled = [p.grad.clone() for p in model.parameters()]
    precision.unscale(opt)
    precision.unscale(opt)  # idempotent: GradScaler itself would raise here
    for raw, p in zip(scaled, model.parameters()):
        torch.testing.assert_close(p.grad, raw / 2.0**10)


def test_two_optimizers_update_the_scale_once_per_iteration() -> None:
    """GAN-style: one backward, both optimizers unscaled (clipped), then stepped one by one."""
    precision = NativePrecision("fp16", device="cpu", scaler_kwargs={"growth_interval": 1000})
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    precision.setup([gen, disc], [opt_g, opt_d], "cpu")
    for _ in range(2):
        opt_g.zero_grad()
        opt_d.zero_grad()
        with precision.autocast():
            loss = disc(gen(torch.randn(8, 4))).float().pow(2).mean()
        precision.backward(loss)
        precision.clip_grad_norm(disc.parameters(), 10.0, opt_d)
        precision.clip_grad_norm(gen.parameters(), 10.0, opt_g)
        assert precision.step(opt_d)
        assert precision.step(opt_g)
    # one scaler update per iteration, not one per optimizer
    assert precision.state_dict()["scaler"]["_growth_tracker"] == 2


def test_fp16_state_loaded_before_setup_reaches_the_scaler() -> None:
    precision = NativePrecision("fp16", device="cpu")
    state = {
        "backend": "fp16",
        "scaler": {
            "scale": 8.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 7,
            "_growth_tracker": 3,
        },
    }
    precision.load_state_dict(state)
    _setup(precision, "cpu")
    assert precision.scaler.get_scale() == 8.0
    assert precision.state_dict() == state


def test_state_of_another_backend_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fp16 = NativePrecision("fp16", device="cpu")
    _setup(fp16, "cpu")
    bf16 = NativePrecision("bf16", device="cpu")
    with caplog.at_level(logging.WARNING, logger="raysgd_amp"):
        bf16.load_state_dict(fp16.state_dict())
    assert bf16.state_dict() == {}
    assert "Ignoring precision state of backend 'fp16'" in caplog.text


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="dtype"):
        NativePrecision("fp8")
    with pytest.raises(ValueError, match="scaler_kwargs"):
        NativePrecision("bf16", scaler_kwargs={"init_scale": 2.0})
    with pytest.raises(TypeError, match="state"):
        NativePrecision("bf16").load_state_dict([("scale", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_norm"):
        NativePrecision("bf16").clip_grad_norm(
            [], 0.0, torch.optim.SGD([nn.Parameter(torch.ones(1))])
        )


def test_backends_pickle_before_and_after_setup() -> None:
    """Backends travel to worker processes by pickle (the trainer ships `use_fp16` instances)."""
    precision = NativePrecision("fp16", device="cpu", scaler_kwargs={"init_scale": 4.0})
    assert pickle.loads(pickle.dumps(precision)).name == "fp16"
    model, opt = _setup(precision, "cpu")
    with precision.autocast():
        loss = _loss(model, "cpu")
    precision.backward(loss, opt)
    precision.step(opt)
    copy = pickle.loads(pickle.dumps(precision))
    assert copy.state_dict() == precision.state_dict()


def test_setup_again_keeps_the_learned_scale() -> None:
    """The trainer may set a backend up again (re-binding after recovery); the scale survives."""
    precision = NativePrecision("fp16", device="cpu")
    model, opt = _setup(precision, "cpu")
    with precision.autocast():
        loss = _loss(model, "cpu", factor=1e38)
    precision.backward(loss, opt)
    assert not precision.step(opt)
    state = precision.state_dict()
    precision.setup([model], [opt], "cpu")
    assert precision.state_dict() == state and state["scaler"]["scale"] == 2.0**15
