"""Throughput in the results: each worker's loop time and rates, the group's from the workers',
tokens against rows, FLOPs per sample counted, MFU against a given or known peak, and a call
that went on after a failure counting the time of the steps it kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import (
    OperatorRunner,
    TrainingOperator,
    TrainingOptions,
    measure_flops_per_sample,
    peak_flops_per_s,
    reduce_worker_results,
)
from raysgd_operator.progress import CallRecord
from raysgd_operator.throughput import group_throughput, worker_throughput

# -- one worker ----------------------------------------------------------------------------------


def test_a_worker_reports_its_count_over_its_loop_time() -> None:
    assert worker_throughput(200, 4.0) == {"loop_s": 4.0, "samples_per_s": 50.0}
    assert worker_throughput(200, 4.0, counts_rows=False) == {"loop_s": 4.0, "tokens_per_s": 50.0}
    with_flops = worker_throughput(200, 4.0, flops_per_sample=6e6, peak=1e9)
    assert with_flops["flops_per_s"] == pytest.approx(3e8)
    assert with_flops["mfu"] == pytest.approx(0.3)
    # Without a peak there is no MFU; without a count or a time, no rate at all.
    assert "mfu" not in worker_throughput(200, 4.0, flops_per_sample=6e6)
    assert worker_throughput(None, 4.0) == {"loop_s": 4.0}
    assert worker_throughput(200, 0.0, flops_per_sample=1.0, peak=1.0) == {"loop_s": 0.0}


# -- the group -------------------------------------------------------------------------------------


def _worker(n: int, loop_s: float, **kwargs: Any) -> dict[str, Any]:
    return {"num_samples": n, "train_loss": 1.0, **worker_throughput(n, loop_s, **kwargs)}


def test_the_group_rate_is_the_summed_count_over_the_slowest_loop() -> None:
    results = [
        _worker(300, 2.0, flops_per_sample=10.0, peak=1e4),
        _worker(100, 4.0, flops_per_sample=10.0, peak=1e4),
    ]
    reduced = reduce_worker_results(results)
    assert reduced["num_samples"] == 400
    assert reduced["loop_s"] == 4.0
    assert reduced["samples_per_s"] == pytest.approx(100.0)
    assert reduced["flops_per_s"] == pytest.approx(1000.0)  # 10 FLOPs x 400 samples / 4 s
    # Each worker's FLOPs over the group's time and its peak, averaged: 750/1e4 and 250/1e4.
    assert reduced["mfu"] == pytest.approx(0.05)
    # The same as the group's FLOPs over the summed peaks, when the devices are alike.
    assert reduced["mfu"] == pytest.approx(reduced["flops_per_s"] / (2 * 1e4))
    # The keys stay where the workers had them; other numbers are reduced as before.
    assert list(reduced) == list(results[0])
    assert reduced["train_loss"] == 1.0


def test_a_group_count_given_by_the_caller_drives_the_rates() -> None:
    """A call that lost a worker: the rows the whole group trained (the lost worker's too)
    are its num_samples, and the rates and FLOPs follow them."""
    results = [_worker(100, 2.0, flops_per_sample=1.0, peak=100.0) for _ in range(2)]
    reduced = reduce_worker_results(results, num_samples=300)
    assert reduced["num_samples"] == 300
    assert reduced["samples_per_s"] == pytest.approx(150.0)
    assert reduced["flops_per_s"] == pytest.approx(150.0)
    assert reduced["mfu"] == pytest.approx(0.75)  # 150 FLOP/s over two devices of 100


def test_tokens_name_the_group_rate_when_any_worker_counted_them() -> None:
    results = [_worker(512, 2.0, counts_rows=False), _worker(4, 2.0)]
    reduced = reduce_worker_results(results)
    assert reduced["tokens_per_s"] == pytest.approx(258.0)
    assert "samples_per_s" not in reduced
    assert group_throughput([{"num_samples": 3}]) == {}  # no loop time: nothing


def test_results_without_a_loop_time_keep_such_keys_as_metrics() -> None:
    """A validation result (no loop time) with a custom metric that happens to be named like a
    rate is averaged like any metric."""
    results = [{"num_samples": 1, "mfu": 0.2}, {"num_samples": 3, "mfu": 0.6}]
    assert reduce_worker_results(results)["mfu"] == pytest.approx(0.5)


# -- FLOPs and peaks -------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


def _step_flops(rows: int) -> int:
    # Forward: two products of 2*rows*in*out FLOPs. Backward: the second layer's gradients of
    # its input and weight, the first layer's of its weight only (the batch needs none).
    forward = 2 * rows * (10 * 20 + 20 * 5)
    backward = 2 * rows * 20 * 5 * 2 + 2 * rows * 10 * 20
    return forward + backward


def test_flops_per_sample_are_counted_on_one_batch_and_leave_no_gradient() -> None:
    model = _mlp()
    batch = (torch.randn(4, 10), torch.randn(4, 5))
    flops = measure_flops_per_sample(model, batch, criterion=nn.MSELoss())
    assert flops == _step_flops(4) / 4
    assert all(p.grad is None for p in model.parameters())
    # Per token: the caller says what a step counts.
    assert measure_flops_per_sample(model, batch, criterion=nn.MSELoss(), num_samples=8) == (
        _step_flops(4) / 8
    )
    # On the meta device nothing is computed or allocated, and the count is the same.
    with torch.device("meta"):
        meta_model = _mlp()
        meta_batch = (torch.randn(4, 10), torch.randn(4, 5))
    assert measure_flops_per_sample(meta_model, meta_batch, criterion=nn.MSELoss()) == flops


class _OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.body(x)
        return out, nn.functional.mse_loss(out, y)


def test_a_model_that_returns_its_own_loss_is_measured_without_a_criterion() -> None:
    batch = (torch.randn(6, 10), torch.randn(6, 5))
    assert measure_flops_per_sample(_OwnLoss(), batch) == _step_flops(6) / 6
    with pytest.raises(TypeError, match="its own loss"):
        measure_flops_per_sample(_mlp(), (torch.randn(2, 10),))


def test_peaks_come_from_the_table_by_device_name_and_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert peak_flops_per_s("cpu", torch.bfloat16) is None
    names = {"name": ""}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names["name"])

    def peak(name: str, dtype: torch.dtype = torch.float32) -> float | None:
        names["name"] = name
        return peak_flops_per_s("cuda:0", dtype)

    assert peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak("NVIDIA H100 PCIe", torch.float16) == pytest.approx(756e12)
    assert peak("NVIDIA H200", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak("NVIDIA A100-SXM4-80GB") == pytest.approx(19.5e12)
    assert peak("NVIDIA L4", torch.bfloat16) == pytest.approx(121e12)
    assert peak("NVIDIA L40S", torch.bfloat16) == pytest.approx(362.1e12)
    assert peak("Tesla V100-SXM2-16GB", torch.float16) == pytest.approx(125e12)
    # No bf16 tensor cores before Ampere; unknown or uncertain devices: no guess.
    assert peak("Tesla V100-SXM2-16GB", torch.bfloat16) is None
    assert peak("NVIDIA A10G", torch.bfloat16) is None
    assert peak("NVIDIA H100 NVL", torch.bfloat16) is None
    # fp32 matmuls in tf32 where torch is allowed to.
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak("NVIDIA A100-SXM4-80GB") == pytest.approx(156e12)
        assert peak("Tesla T4") == pytest.approx(8.1e12)  # no tf32 there
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_options_are_positive_numbers() -> None:
    options = TrainingOptions(flops_per_sample=6e9, peak_flops_per_s=1e12)
    assert (options.flops_per_sample, options.peak_flops_per_s) == (6e9, 1e12)
    for name in ("flops_per_sample", "peak_flops_per_s"):
        with pytest.raises(ValueError, match=name):
            TrainingOptions(**{name: 0})
        with pytest.raises(TypeError, match=name):
            TrainingOptions(**{name: "1e12"})


# -- the runner ------------------------------------------------------------------------------------


class _Regression(TrainingOperator):
    """48 rows in batches of 4; counts tokens (4 per row) with ``config["tokens"]``, and fails
    once at ``config["fail_at"]``."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        x = torch.randn(48, 3)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=DataLoader(TensorDataset(x, x.sum(1, True)), batch_size=4))
        self.tokens = config.get("tokens", False)
        self.fail_at = config.get("fail_at")

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if batch_info["global_step"] == self.fail_at:
            self.fail_at = None  # once
            raise ConnectionError("a peer went away")
        metrics = super().train_batch(batch, batch_info)
        if self.tokens:
            metrics["num_samples"] = 4 * len(batch[0])
        return metrics


def test_a_runner_reports_its_rate_and_mfu_from_its_count_and_time() -> None:
    runner = OperatorRunner(_Regression, {}, flops_per_sample=30.0, peak_flops_per_s=1e9)
    result = runner.train_epoch()
    assert result["num_samples"] == 48 and result["loop_s"] > 0
    assert result["samples_per_s"] == pytest.approx(48 / result["loop_s"])
    assert result["flops_per_s"] == pytest.approx(30.0 * result["samples_per_s"])
    assert result["mfu"] == pytest.approx(result["flops_per_s"] / 1e9)
    # On a CPU without a given peak there is no MFU (and nothing is logged about it).
    plain = OperatorRunner(_Regression, {}, flops_per_sample=30.0).train_epoch()
    assert "flops_per_s" in plain and "mfu" not in plain
    assert "flops_per_s" not in OperatorRunner(_Regression, {}).train_epoch()


def test_a_runner_whose_batches_count_tokens_reports_tokens_per_second() -> None:
    result = OperatorRunner(_Regression, {"tokens": True}).train_epoch()
    assert result["num_samples"] == 4 * 48
    assert result["tokens_per_s"] == pytest.approx(4 * 48 / result["loop_s"])
    assert "samples_per_s" not in result


def test_the_progress_bar_shows_the_rate_by_what_the_batches_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    OperatorRunner(_Regression, {}, use_tqdm=True).train_epoch()
    assert "samples/s=" in capsys.readouterr().err
    OperatorRunner(_Regression, {"tokens": True}, use_tqdm=True).train_epoch()
    err = capsys.readouterr().err
    assert "tokens/s=" in err and "samples/s=" not in err


def test_a_call_that_went_on_after_a_failure_counts_the_time_of_the_steps_it_kept() -> None:
    runner = OperatorRunner(_Regression, {"fail_at": 5}, world_size=2, distributed=True)
    kept: list[float] = []
    runner.add_step_hook(lambda: kept.append(runner.position.call.loop_s))  # type: ignore[union-attr]
    with pytest.raises(ConnectionError):
        runner.train_epoch(call_id=1)
    progress = runner.position.progress()
    assert progress.call is not None and progress.call.steps == 5
    # Back at its last finished step, the call holds the loop time up to that step: the time of
    # the step that failed is not counted.
    assert kept == sorted(kept) and progress.call.loop_s == kept[-1] > 0
    runner.position.adopt(runner.position.position_state(), progress.call)
    again = runner.train_epoch(call_id=1)
    assert again["num_samples"] == 24  # this worker's half of every row, once
    assert again["loop_s"] >= kept[-1]
    assert again["samples_per_s"] == pytest.approx(24 / again["loop_s"])


def test_call_records_keep_the_loop_time_of_their_own_steps() -> None:
    record = CallRecord(call_id=1, num_steps=None, start_step=10)
    stepped = record.after_step(4, 1.5)
    assert stepped.loop_s == 1.5
    assert stepped.resumed_at(11, 4, 1.5).loop_s == 1.5
    # Resumed from before the call began: none of its own steps is kept.
    assert stepped.resumed_at(8, 4, 1.5).loop_s == 0.0
