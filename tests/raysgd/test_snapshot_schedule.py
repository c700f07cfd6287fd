"""The sharded snapshots' interval: fixed, or chosen from the measured cost (pure, no workers)."""

from __future__ import annotations

import pytest

from raysgd._internal.worker.snapshot_schedule import (
    BUDGET,
    FIRST_INTERVAL,
    MAX_INTERVAL,
    SnapshotSchedule,
)
from raysgd_operator import TrainingOptions


def _run(
    schedule: SnapshotSchedule, steps: int, step_s: float, wait_s: float, slow_s: float
) -> list[int]:
    """`steps` steps of `step_s`; a snapshot (a wait of `wait_s`, then the next step slower by
    `slow_s` while its thread runs) whenever one falls due; the steps it was taken at."""
    taken = []
    for step in range(1, steps + 1):
        running = bool(taken) and taken[-1] == step - 1
        schedule.stepped(step_s + (slow_s if running else 0.0), running)
        if not running:
            schedule.finished()
        if schedule.due(step):
            schedule.taken(step, wait_s)
            taken.append(step)
    return taken


def test_a_fixed_interval_is_kept_and_zero_takes_none() -> None:
    assert _run(SnapshotSchedule(5), 20, 0.1, 0.5, 0.5) == [5, 10, 15, 20]
    assert _run(SnapshotSchedule(0), 20, 0.1, 0.5, 0.5) == []


@pytest.mark.parametrize(
    ("step_s", "wait_s", "slow_s", "expected"),
    [
        (1.0, 0.01, 0.01, 1),  # cheap against slow steps: every step
        (0.1, 0.02, 0.04, 20),  # 0.06 s a snapshot, 3% of 0.1 s steps: every 20
        (0.01, 0.5, 0.5, MAX_INTERVAL),  # far costlier than a step: the longest interval
    ],
)
def test_auto_picks_the_shortest_interval_within_the_budget(
    step_s: float, wait_s: float, slow_s: float, expected: int
) -> None:
    schedule = SnapshotSchedule("auto")
    assert schedule.every == FIRST_INTERVAL  # nothing measured yet
    schedule.taken(0, wait_s)  # the snapshot at start-up: its wait is measured
    _run(schedule, 2000, step_s, wait_s, slow_s)
    assert schedule.every == expected
    # What it spends: one snapshot's cost over the interval's training time.
    cost = (wait_s + slow_s) / (schedule.every * step_s)
    assert cost <= BUDGET * 1.01 or schedule.every == MAX_INTERVAL


def test_snapshot_every_accepts_auto_and_counts_only() -> None:
    assert TrainingOptions().snapshot_every == "auto"
    assert TrainingOptions(snapshot_every=0).snapshot_every == 0
    with pytest.raises(ValueError, match='snapshot_every must be "auto" or an int'):
        TrainingOptions(snapshot_every="often")
    with pytest.raises(ValueError, match="snapshot_every"):
        TrainingOptions(snapshot_every=-1)
