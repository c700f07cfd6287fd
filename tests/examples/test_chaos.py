"""bench:chaos's schedule and its count of rows, the parts of its report that need no cluster."""

from __future__ import annotations

from pathlib import Path

from raysgd_examples.bench._chaos_faults import KINDS, plan_faults
from raysgd_examples.bench._chaos_report import rows_report


def test_the_schedule_is_seeded_takes_every_kind_and_kills_the_driver_once_mid_run() -> None:
    schedule = plan_faults(25, 600.0, seed=3)
    assert schedule == plan_faults(25, 600.0, seed=3)
    assert schedule != plan_faults(25, 600.0, seed=4)
    kinds = [f.kind for f in schedule]
    assert len(kinds) == 25 and set(kinds) == set(KINDS)
    assert kinds.count("driver") == 1
    # The driver's kill falls in the middle: the run has time to go on after the resume.
    assert abs(kinds.index("driver") - len(kinds) // 2) <= 1
    times = [f.at_s for f in schedule]
    assert times == sorted(times) and 0.03 * 600 <= times[0] and times[-1] <= 0.93 * 600
    # Some come while the group still recovers from the fault before: seconds after it.
    eager = [(b, f) for b, f in zip(schedule, schedule[1:]) if f.eager_after_s is not None]
    assert eager and all(1.0 <= f.eager_after_s <= 5.0 for _, f in eager)
    assert all(f.at_s == round(b.at_s + f.eager_after_s, 1) for b, f in eager)
    # Fewer faults than kinds: the first kinds, in their order; only the allowed ones.
    assert sorted(f.kind for f in plan_faults(2, 60.0, seed=0)) == sorted(KINDS[:2])
    assert {f.kind for f in plan_faults(6, 60.0, seed=0, kinds_allowed=("sigkill",))} == {"sigkill"}


def _line(epoch: int, place: int, rank: int, world: int, t: float, ids: list[int]) -> str:
    step = epoch * 100 + place
    return f"{epoch} {place} {step} {rank} {world} {t:.6f} {','.join(map(str, ids))}\n"


def test_rows_count_the_last_attempt_of_every_batch(tmp_path: Path) -> None:
    # Two ranks, 8 rows, 2 batches of 2 rows per rank. Batch 1 was started, then redone after a
    # loss at the same size: its last attempt counts, the first is "trained again".
    (tmp_path / "rows-1.txt").write_text(
        _line(0, 0, 0, 2, 1.0, [0, 1])
        + _line(0, 1, 0, 2, 2.0, [4, 5])
        + _line(0, 1, 0, 2, 5.0, [4, 5])
        + "0 1 1 0 2"  # a line without its time and rows is not read
    )
    (tmp_path / "rows-2.txt").write_text(_line(0, 0, 1, 2, 1.0, [2, 3]))
    (tmp_path / "rows-3.txt").write_text(_line(0, 1, 1, 2, 5.5, [6, 7]))
    report = rows_report(tmp_path, rows=8, epochs=1)
    assert (report["lost"], report["duplicated"], report["trained_again"]) == (0, 0, 2)

    # No attempt of rank 1 at batch 1 at all: its rows are lost, and the rank is missing.
    (tmp_path / "rows-3.txt").write_text("")
    report = rows_report(tmp_path, rows=8, epochs=1)
    assert (report["lost"], report["per_epoch"][0]["missing_ranks"]) == (2, 1)
