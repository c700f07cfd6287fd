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


def _agree(workers: list[SnapshotSchedule]) -> None:
    """What the workers' all-reduce does at a snapshot: each takes the largest of each."""
    wanted, every = max(w.wanted() for w in workers), max(w.every for w in workers)
    for schedule in workers:
        schedule.agree(wanted, every)


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
            _agree([schedule])  # one worker: it agrees with itself
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


def test_workers_that_measure_differently_snapshot_at_the_same_steps_also_after_a_re_form() -> None:
    # Two workers, one with steps twice as slow to snapshot: each alone would pick its own
    # interval, and a snapshot on one but not the other is a collective that never completes.
    workers = [SnapshotSchedule("auto"), SnapshotSchedule("auto")]
    costs = [(0.1, 0.01, 0.01), (0.1, 0.03, 0.03)]  # (step, wait, slowdown)
    for schedule, (_, wait_s, _) in zip(workers, costs):
        schedule.taken(0, wait_s)
    taken: list[int] = []

    def run(first: int, last: int) -> None:
        for step in range(first, last + 1):
            running = bool(taken) and taken[-1] == step - 1
            for schedule, (step_s, _, slow_s) in zip(workers, costs):
                schedule.stepped(step_s + (slow_s if running else 0.0), running)
                if not running:
                    schedule.finished()
            due = [schedule.due(step) for schedule in workers]
            assert due[0] == due[1], f"the workers disagree at step {step}"
            if due[0]:
                _agree(workers)
                for schedule, (_, wait_s, _) in zip(workers, costs):
                    schedule.taken(step, wait_s)
                taken.append(step)

    run(1, 300)
    assert workers[0].every == workers[1].every == workers[1].wanted() > workers[0].wanted()
    # A re-formed group: a survivor and a new worker; the trainer's snapshot after the restore
    # (at step 250) is where they agree again.
    workers = [workers[0], SnapshotSchedule("auto")]
    _agree(workers)
    for schedule in workers:
        schedule.taken(250, 0.01)
    assert workers[0].every == workers[1].every
    interval = workers[0].every
    taken.clear()
    run(251, 400)
    assert taken[0] == 250 + interval and len(taken) > 2


def test_a_replacement_joining_during_the_ramp_snapshots_with_the_survivors() -> None:
    # Nothing measured yet (every snapshot's thread outlasted the steps after it): the survivor
    # ramped up to 8, the replacement starts at the first interval. They must agree all the same.
    survivor = SnapshotSchedule("auto")
    for _ in range(2):
        _agree([survivor])
    assert survivor.wanted() == 0 and survivor.every == 4 * FIRST_INTERVAL
    workers = [survivor, SnapshotSchedule("auto")]
    _agree(workers)
    assert [w.every for w in workers] == [8 * FIRST_INTERVAL] * 2


def test_snapshot_every_accepts_auto_and_counts_only() -> None:
    assert TrainingOptions().snapshot_every == "auto"
    assert TrainingOptions(snapshot_every=0).snapshot_every == 0
    with pytest.raises(ValueError, match='snapshot_every must be "auto" or an int'):
        TrainingOptions(snapshot_every="often")
    with pytest.raises(ValueError, match="snapshot_every"):
        TrainingOptions(snapshot_every=-1)
