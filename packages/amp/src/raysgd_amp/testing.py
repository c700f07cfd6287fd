"""`PrecisionConformance`: the checks every precision backend must pass, for subclassing in tests.

A backend's test module subclasses it under a `Test*` name and says how to build the backend::

    class TestMyPrecision(PrecisionConformance):
        def make_precision(self) -> Precision:
            return MyPrecision()

pytest then runs every `test_*` method below against that backend. This module imports neither
pytest nor anything beyond torch, so it is safe to import from library code; the checks use plain
asserts, which pytest rewrites only in test modules, so each carries its own message.
"""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

from .precision import Precision

__all__ = ["PrecisionConformance"]


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = x @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1) + 0.5  # a learnable linear target
    return x, y


class PrecisionConformance:
    """Behaviour every `Precision` promises; subclass it and implement `make_precision`.

    Class attributes a subclass may change: `device` (where the model runs), `grad_rtol` (how far
    unscaled gradients may drift from fp32 ones, relative to their norm; reduced precision rounds).
    """

    device: torch.device = torch.device("cpu")
    grad_rtol: float = 0.05

    def make_precision(self) -> Precision:
        """Return a fresh backend under test (one per call)."""
        raise NotImplementedError("subclasses of PrecisionConformance implement make_precision()")

    # --- helpers ---------------------------------------------------------------------------

    def _model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(self.device)

    def _prepared(self, lr: float = 0.05) -> tuple[Precision, nn.Module, torch.optim.Optimizer]:
        precision = self.make_precision()
        model = self._model()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        models, optimizers = precision.setup([model], [optimizer], self.device)
        assert isinstance(models, list) and isinstance(optimizers, list), "setup must return lists"
        assert len(models) == 1 and len(optimizers) == 1, "setup must keep one model per model"
        return precision, models[0], optimizers[0]

    def _backward(self, precision: Precision, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        x, y = (t.to(self.device) for t in _data())
        opt.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        precision.backward(loss, opt)

    def _fp32_grads(self) -> list[torch.Tensor]:
        model = self._model()
        x, y = (t.to(self.device) for t in _data())
        nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    # --- the contract ----------------------------------------------------------------------

    def test_describes_itself(self) -> None:
        precision = self.make_precision()
        assert isinstance(precision, Precision), f"{precision!r} is not a Precision"
        assert isinstance(precision.name, str) and precision.name, "name must be a non-empty str"
        assert isinstance(precision.enabled, bool), "enabled must be a bool"
        assert isinstance(precision.dtype, torch.dtype), "dtype must be a torch.dtype"
        if not precision.enabled:
            assert precision.dtype == torch.float32, "a full-precision backend computes in fp32"

    def test_loss_goes_down(self) -> None:
        precision, model, opt = self._prepared()
        x, y = (t.to(self.device) for t in _data())

        def eval_loss() -> float:
            with torch.no_grad():
                return nn.functional.mse_loss(model(x).float(), y).item()

        first = eval_loss()
        for _ in range(40):
            opt.zero_grad(set_to_none=True)
            with precision.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            precision.backward(loss, opt)
            precision.step(opt)
        last = eval_loss()
        assert last < 0.5 * first, f"loss did not go down: {first:.4f} -> {last:.4f}"

    def test_step_returns_true_on_finite_grads(self) -> None:
        precision, model, opt = self._prepared()
        before = [p.detach().clone() for p in model.parameters()]
        self._backward(precision, model, opt)
        assert precision.step(opt), "step must return a true value when it applied the update"
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert changed, "step returned True but no parameter changed"

    def test_unscaled_grads_match_fp32(self) -> None:
        precision, model, opt = self._prepared()
        self._backward(precision, model, opt)
        precision.unscale(opt)
        precision.unscale(opt)  # a second call in the same step must change nothing
        for got, want in zip((p.grad.float() for p in model.parameters()), self._fp32_grads()):
            err = (got - want).norm() / want.norm().clamp_min(1e-12)
            assert err <= self.grad_rtol, f"unscaled grad differs from fp32 by {err:.3g} (relative)"

    def test_clip_after_unscale_matches_manual(self) -> None:
        max_norm = 0.05  # far below the initial gradient norm, so clipping really happens
        clipped_prec, clipped_model, clipped_opt = self._prepared()
        self._backward(clipped_prec, clipped_model, clipped_opt)
        norm = clipped_prec.clip_grad_norm(clipped_model.parameters(), max_norm, clipped_opt)

        manual_prec, manual_model, manual_opt = self._prepared()
        self._backward(manual_prec, manual_model, manual_opt)
        manual_prec.unscale(manual_opt)  # unscale by hand, then clip by the textbook formula
        grads = [p.grad.detach().float().clone() for p in manual_model.parameters()]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)

        assert torch.allclose(norm.float().cpu(), total.cpu(), rtol=1e-4), f"norm {norm} != {total}"
        assert total > max_norm, "test set-up: gradients should have needed clipping"
        for p, g in zip(clipped_model.parameters(), grads):
            assert torch.allclose(p.grad.float(), g * coef, rtol=1e-4, atol=1e-7), (
                "clipped grads differ"
            )
        assert clipped_prec.step(clipped_opt), "a clipped finite step must be applied"

    def test_state_round_trip(self) -> None:
        precision, model, opt = self._prepared()
        for _ in range(3):
            self._backward(precision, model, opt)
            precision.step(opt)
        state = precision.state_dict()
        assert isinstance(state, dict), "state_dict must return a dict"

        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)  # plain values only: a safe load reads it

        after_setup, _, _ = self._prepared()
        after_setup.load_state_dict(copy.deepcopy(loaded))
        assert after_setup.state_dict() == state, "state lost when loaded after setup"

        before_setup = self.make_precision()
        before_setup.load_state_dict(copy.deepcopy(loaded))
        model = self._model()
        before_setup.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)], self.device)
        assert before_setup.state_dict() == state, "state lost when loaded before setup"
