"""Metric averaging, reduction across workers, timers and the BATCH_SIZE split."""

from __future__ import annotations

import math
import time

import pytest

from raysgd_operator import (
    BATCH_SIZE,
    AverageMeter,
    AverageMeterCollection,
    BatchSplit,
    TimerCollection,
    reduce_worker_results,
)


def test_average_meter_is_sample_weighted() -> None:
    meter = AverageMeter()
    meter.update(1.0, n=1)
    meter.update(4.0, n=3)
    assert meter.val == 4.0
    assert meter.count == 4
    assert meter.avg == pytest.approx((1 + 12) / 4)


def test_collection_summary_keys_and_values() -> None:
    meters = AverageMeterCollection()
    meters.update({"loss": 2.0, "score": 1.0}, n=2)
    meters.update({"loss": 5.0, "score": 0.0}, n=6)
    summary = meters.summary()
    assert summary == {
        "batch_count": 2,
        "num_samples": 8,
        "loss": pytest.approx((4 + 30) / 8),
        "last_loss": 5.0,
        "score": pytest.approx(2 / 8),
        "last_score": 0.0,
    }


def test_collection_nan_propagates_to_mean_only() -> None:
    meters = AverageMeterCollection()
    meters.update({"loss": float("nan")}, n=1)
    meters.update({"loss": 0.0}, n=1)
    summary = meters.summary()
    assert math.isnan(summary["loss"])
    assert summary["last_loss"] == 0.0


def test_reduce_worker_results_numbers() -> None:
    results = [
        {
            "epoch": 3,
            "batch_count": 4,
            "num_samples": 10,
            "loss": 1.0,
            "last_loss": 2.0,
            "name": "w0",
            "profile": {"mean_fwd_s": 1.0},
        },
        {
            "epoch": 3,
            "batch_count": 2,
            "num_samples": 30,
            "loss": 3.0,
            "last_loss": 4.0,
            "name": "w1",
            "profile": {"mean_fwd_s": 9.0},
        },
    ]
    reduced = reduce_worker_results(results)
    assert reduced["num_samples"] == 40
    assert reduced["epoch"] == 3
    assert reduced["batch_count"] == pytest.approx(3.0)
    assert reduced["loss"] == pytest.approx((10 * 1 + 30 * 3) / 40)
    assert reduced["last_loss"] == pytest.approx((10 * 2 + 30 * 4) / 40)
    assert reduced["name"] == "w0"
    assert reduced["profile"] == {"mean_fwd_s": 1.0}


def test_reduce_worker_results_nan_on_one_worker() -> None:
    reduced = reduce_worker_results(
        [{"num_samples": 1, "score": float("nan")}, {"num_samples": 1, "score": 1.0}]
    )
    assert math.isnan(reduced["score"])
    assert reduced["num_samples"] == 2
    with pytest.raises(ValueError, match="at least one"):
        reduce_worker_results([])


def test_timer_collection_records_only_when_enabled() -> None:
    timers = TimerCollection()
    with timers.record("fwd"):
        pass
    assert timers.stats() == {}
    timers.enabled = True
    for _ in range(2):
        with timers.record("fwd"):
            time.sleep(0.001)
    stats = timers.stats()
    assert set(stats) == {"mean_fwd_s"}
    assert stats["mean_fwd_s"] > 0
    timers.reset()
    assert timers.stats() == {}


def _split(config: dict, num_workers: int) -> tuple[dict, int | None]:
    """A worker's config and the global batch trained with, as the driver makes them."""
    split = BatchSplit.of(config, num_workers)
    split.warn_if_uneven()
    return split.worker_config(config), split.global_size


def test_a_batch_split_divides() -> None:
    config = {BATCH_SIZE: 20, "lr": 0.1}
    worker, total = _split(config, 2)
    assert worker == {BATCH_SIZE: 10, "lr": 0.1}
    assert total == 20
    assert config[BATCH_SIZE] == 20  # the caller's dict is not modified


def test_a_batch_split_rounds_down_with_warning() -> None:
    with pytest.warns(UserWarning, match="does not divide"):
        worker, total = _split({BATCH_SIZE: 21}, 2)
    assert worker[BATCH_SIZE] == 10
    assert total == 20


def test_a_batch_split_without_key_and_bad_input() -> None:
    assert _split({"lr": 1}, 4) == ({"lr": 1}, None)
    with pytest.raises(ValueError, match="num_workers"):
        _split({}, 0)
    with pytest.raises(ValueError, match="smaller than num_workers"):
        _split({BATCH_SIZE: 1}, 2)
    with pytest.raises(ValueError, match="positive int"):
        _split({BATCH_SIZE: "8"}, 2)
    with pytest.raises(ValueError, match=r"config\[BATCH_SIZE\] must be a positive int \(>= 1\)"):
        _split({BATCH_SIZE: 0}, 2)


def test_uneven_batch_is_reported_once(
    caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    _split({BATCH_SIZE: 21}, 2)
    said = [str(w.message) for w in recwarn] + [r.getMessage() for r in caplog.records]
    assert len([text for text in said if "does not divide" in text]) == 1, said


def test_a_batch_split_gives_each_worker_its_share_and_says_what_is_trained() -> None:
    split = BatchSplit.of({BATCH_SIZE: 22, "lr": 1}, 4)
    assert (split.asked, split.share, split.global_size, split.uneven) == (22, 5, 20, True)
    assert split.worker_config({BATCH_SIZE: 22, "lr": 1}) == {BATCH_SIZE: 5, "lr": 1}
    with pytest.warns(UserWarning, match="using 5 per worker, a global batch of 20"):
        split.warn_if_uneven()
    even = BatchSplit.of({BATCH_SIZE: 24}, 4)
    assert (even.share, even.global_size, even.uneven) == (6, 24, False)
    absent = BatchSplit.of({"lr": 1}, 4)
    assert (absent.share, absent.global_size, absent.uneven) == (None, None, False)
    assert absent.worker_config({"lr": 1}) == {"lr": 1}
    with pytest.raises(ValueError, match="smaller than num_workers"):
        BatchSplit.of({BATCH_SIZE: 3}, 4)
