"""Smoke tests of the benchmark harness, tiny sizes: the torchrun side of the throughput benchmark
and the asynchronous raysgd side of the checkpoint benchmark.

They check that the harness runs end to end (child process, torchrun or a raysgd trainer, the
shared loop, the JSON) and yields a usable number; they assert no time. One worker each: the
harness is the same at any size, and a worker process fewer to start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysgd_examples.bench import throughput


@pytest.mark.timeout(120)
def test_throughput_torchrun_side_quick(tmp_path: Path) -> None:
    args = ["--quick", "--repeats", "1", "--sides", "torchrun", "--workers", "1"]
    throughput.main([*args, "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "throughput.json").read_text())
    (metric,) = payload["metrics"]
    assert metric["unit"] == "samples/s" and metric["higher_is_better"] is True
    torchrun = metric["sides"]["torchrun"]
    assert "error" not in torchrun, torchrun
    assert len(torchrun["values"]) == 1 and torchrun["median"] > 0
    assert payload["machine"]["cpu_count"] >= 1
    assert payload["workload"]["workload"]["batch_size"] == 8  # --quick sizes were used


@pytest.mark.timeout(120)
def test_checkpoint_raysgd_async_side_quick(tmp_path: Path) -> None:
    from raysgd_examples.bench import checkpoint

    checkpoint.main(
        ["--quick", "--sides", "raysgd_async_local", "--workers", "1", "--out", str(tmp_path)]
    )
    payload = json.loads((tmp_path / "checkpoint.json").read_text())
    assert (tmp_path / "checkpoint.png").exists()
    blocked = next(m for m in payload["metrics"] if m["metric"] == "blocked per checkpoint, 0.1M")
    side = blocked["sides"]["raysgd_async_local"]
    assert "error" not in side, side
    assert side["median"] > 0  # the copy to host memory takes some time
    (run,) = payload["runs"]["raysgd_async_local@0.1M"]
    assert run["checkpoints"] == 2 and run["samples_per_s"] > 0  # 40 steps, one every 20
