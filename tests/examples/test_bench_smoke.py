"""Smoke test of the benchmark harness: the torchrun side of the throughput benchmark, tiny sizes.

It checks that the harness runs end to end (child process, torchrun, the shared loop, the JSON) and
yields a usable number; it asserts no time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysgd_examples.bench import throughput


@pytest.mark.timeout(120)
def test_throughput_torchrun_side_quick(tmp_path: Path) -> None:
    throughput.main(["--quick", "--repeats", "1", "--sides", "torchrun", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "throughput.json").read_text())
    (metric,) = payload["metrics"]
    assert metric["unit"] == "samples/s" and metric["higher_is_better"] is True
    torchrun = metric["sides"]["torchrun"]
    assert "error" not in torchrun, torchrun
    assert len(torchrun["values"]) == 1 and torchrun["median"] > 0
    assert payload["machine"]["cpu_count"] >= 1
    assert payload["workload"]["workload"]["batch_size"] == 8  # --quick sizes were used
