"""`hatch run gpu-check`: without a GPU it says so and succeeds; its placements, its table and its
exit status follow the checks' outcomes; and a few checks pass on CPU workers (`--cpu-dry-run`),
which runs the same code as on a GPU with the devices swapped."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raysgd_examples import gpu_check
from raysgd_examples._gpu_checks import Check, CheckFailed, Placement, Skipped

pytestmark = pytest.mark.timeout(240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.gpu_count() == 0
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no GPU here" in out and "nothing was checked" in out


def test_placements_share_one_gpu_over_gloo_and_give_fsdp_its_own() -> None:
    cpu = gpu_check.placements(0)
    assert cpu["ddp"] == cpu["fsdp"]
    assert (cpu["ddp"].num_workers, cpu["ddp"].use_gpu, cpu["ddp"].backend) == (2, False, "gloo")
    one = gpu_check.placements(1)
    # Two ranks on one device: NCCL refuses them, gloo carries ddp's all-reduce and broadcast.
    assert one["ddp"].trainer_kwargs() == {
        "num_workers": 2,
        "use_gpu": True,
        "num_gpus_per_worker": 0.5,
        "backend": "gloo",
    }
    # fsdp's reduce-scatter and all-gather need NCCL: one worker on the one GPU.
    assert (one["fsdp"].num_workers, one["fsdp"].num_gpus_per_worker) == (1, 1)
    assert one["fsdp"].backend == "nccl"
    for gpus in (2, 8):
        many = gpu_check.placements(gpus)
        assert many["ddp"] == many["fsdp"]
        assert many["ddp"].trainer_kwargs()["num_gpus_per_worker"] == 1
        assert many["ddp"].backend == "nccl" and many["ddp"].num_workers == 2
    # The table's notes say what one GPU changed.
    assert gpu_check._notes(2, list(gpu_check.CHECKS)) == []
    notes = gpu_check._notes(1, ["ddp", "fsdp"])
    assert len(notes) == 2 and "gloo" in notes[0] and "one worker" in notes[1]


def _passes(run: Any, placement: Placement) -> str:
    return f"fine on {placement.num_workers} workers"


def _fails(run: Any, placement: Placement) -> str:
    raise CheckFailed("the weights differ")


def _raises(run: Any, placement: Placement) -> str:
    raise RuntimeError("NCCL error\nsecond line")


def _skips(run: Any, placement: Placement) -> str:
    raise Skipped("no bf16 here")


@pytest.fixture
def fake_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = {
        "good": Check("good", False, _passes),
        "bad": Check("bad", False, _fails),
        "broken": Check("broken", True, _raises),
        "skipped": Check("skipped", False, _skips),
    }
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    # No Ray is needed for checks that start no trainer.
    monkeypatch.setattr(gpu_check, "_ray_cluster", lambda gpus, verbose: contextlib.nullcontext())


def test_every_check_runs_and_a_failure_sets_the_exit_status(
    fake_checks: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "results.json"
    argv = ["--cpu-dry-run", "--checks", "bad,broken,skipped,good", "--json", str(out_file)]
    assert gpu_check.main(argv) == 1
    results = {r["name"]: r for r in json.loads(out_file.read_text())["results"]}
    # A failure does not stop the checks after it; each has its one-line reason.
    assert {n: r["status"] for n, r in results.items()} == {
        "bad": "FAIL",
        "broken": "FAIL",
        "skipped": "skip",
        "good": "pass",
    }
    assert results["bad"]["reason"] == "the weights differ"
    assert results["broken"]["reason"] == "RuntimeError: NCCL error"
    assert results["good"]["reason"] == "fine on 2 workers"
    captured = capsys.readouterr()
    table = captured.out
    assert "check" in table and "placement" in table and "seconds" in table
    assert "1 passed, 2 failed, 1 skipped: bad, broken" in table
    # The tracebacks follow the table, on stderr.
    assert "broken failed" in captured.err and "RuntimeError: NCCL error" in captured.err
    # Skips and passes alone exit 0.
    assert gpu_check.main(["--cpu-dry-run", "--checks", "good,skipped"]) == 0


def test_unknown_checks_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu-dry-run", "--checks", "ddp,nvlink"])
    assert "nvlink" in capsys.readouterr().err


def test_cpu_dry_run_checks_pass_on_cpu_workers(ray_local: None, tmp_path: Path) -> None:
    """Three real checks: ddp and fsdp on two workers, and every rank's generator through
    save()/load()."""
    out_file = tmp_path / "results.json"
    argv = ["--cpu-dry-run", "--checks", "ddp,fsdp,rng", "--json", str(out_file)]
    assert gpu_check.main(argv) == 0
    payload = json.loads(out_file.read_text())
    assert payload["gpus"] == 0 and payload["dry_run"]
    rows = payload["results"]
    assert [(r["name"], r["status"]) for r in rows] == [
        ("ddp", "pass"),
        ("fsdp", "pass"),
        ("rng", "pass"),
    ], rows
    assert all(r["placement"] == "2 CPU workers, gloo (dry run)" for r in rows)
