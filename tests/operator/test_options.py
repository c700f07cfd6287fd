"""`TrainingOptions`: one frozen object, checked once with errors that name the option, taken whole
by `OperatorRunner` and `TrainingOperator`."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_amp import ApexArgsError
from raysgd_operator import SCHEDULER_STEP_FREQS, OperatorRunner, TrainingOperator, TrainingOptions


class LinearOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(8, 1)
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, x), batch_size=4),
            validation_loader=DataLoader(TensorDataset(x, x), batch_size=8),
        )


def test_frozen_and_independent_of_the_callers_objects() -> None:
    apex_args = {"opt_level": "O1"}
    options = TrainingOptions(use_fp16="bf16", apex_args=apex_args, use_tqdm=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.use_fp16 = False  # type: ignore[misc]
    apex_args["opt_level"] = "O2"
    assert options.apex_args == {"opt_level": "O1"}
    assert options.use_tqdm is True


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"use_fp16": "fp8"}, ValueError, "use_fp16 must be"),
        # An object with only part of the Precision interface: the worker could not use it.
        (
            {"use_fp16": type("Half", (), {"setup": 0, "backward": 0, "step": 0})()},
            ValueError,
            "use_fp16",
        ),
        ({"apex_args": "O2"}, ApexArgsError, "apex_args must be a dict"),
        ({"scheduler_step_freq": "sometimes"}, ValueError, "scheduler_step_freq"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches"),
        ({"accumulate_grad_batches": 1.5}, TypeError, "accumulate_grad_batches"),
        ({"clip_grad_norm": True}, ValueError, "clip_grad_norm"),
        ({"clip_grad_norm": 0}, ValueError, "clip_grad_norm must be a number > 0"),
        ({"num_threads": 0}, ValueError, "num_threads"),
    ],
)
def test_bad_values_name_the_option(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TrainingOptions(**kwargs)


def test_apex_args_error_is_both_type_and_value_error() -> None:
    # One exception type for every place that checks apex_args, catchable as either.
    assert issubclass(ApexArgsError, TypeError) and issubclass(ApexArgsError, ValueError)


def test_build_applies_keywords_and_refuses_unknown_ones() -> None:
    base = TrainingOptions(scheduler_step_freq="epoch")
    assert TrainingOptions.build(base) is base
    changed = TrainingOptions.build(base, clip_grad_norm=2.0)
    assert (changed.scheduler_step_freq, changed.clip_grad_norm) == ("epoch", 2.0)
    with pytest.raises(TypeError, match="use_fp32"):
        TrainingOptions.build(use_fp32=True)
    with pytest.raises(TypeError, match="options must be a TrainingOptions"):
        TrainingOptions.build({"use_fp16": True})  # type: ignore[arg-type]
    assert set(SCHEDULER_STEP_FREQS) == {"batch", "epoch", "manual"}


def test_travels_whole_to_the_operator() -> None:
    options = TrainingOptions(use_fp16="bf16", scheduler_step_freq="manual", num_threads=1)
    shipped = pickle.loads(pickle.dumps(options))
    assert shipped == options
    threads = torch.get_num_threads()
    try:
        runner = OperatorRunner(LinearOperator, {}, options=shipped)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    op = runner.operator
    assert op.options is shipped
    assert (op.use_fp16, op.scheduler_step_freq, op.use_gpu) == ("bf16", "manual", False)
    assert runner.precision.dtype == torch.bfloat16
    assert len(op.train_loader) == 2
    assert len(op.validation_loader) == 1
