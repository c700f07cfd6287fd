"""A sharded state kept in host memory (`raysgd_operator.sharded_memory`), in real gloo groups:
kept by 4 ranks, loaded into 3, resharded, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests._support.ranks import run_ranks

WORKER = Path(__file__).with_name("_memory_worker.py")


def _run(phase: str, world_size: int, directory: Path) -> None:
    init_file = directory / f"init-{phase}"
    run_ranks(
        WORKER,
        world_size,
        lambda rank: (phase, *map(str, (rank, world_size, init_file, directory))),
    )


@pytest.mark.timeout(200)
def test_a_state_kept_in_memory_by_four_ranks_loads_into_three_resharded(tmp_path: Path) -> None:
    _run("keep", 4, tmp_path)
    kept = torch.load(tmp_path / "kept.pt", weights_only=False)
    _run("load", 3, tmp_path)
    for rank in range(3):
        loaded = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=False)
        # The chunks of rank 0's part were not handed over: every rank fails alike, naming one.
        assert loaded["error"] is not None and "is not among the parts" in loaded["error"]
        # Then every parameter and Adam moment is the kept copy's (taken before the parameters
        # changed), not the live model's afterwards.
        whole = loaded["whole"]
        assert kept["model"].keys() == whole["model"].keys()
        for name, value in kept["model"].items():
            assert torch.equal(value, whole["model"][name]), name
        for name, state in kept["optimizer"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[key], whole["optimizer"][name][key]), (name, key)
