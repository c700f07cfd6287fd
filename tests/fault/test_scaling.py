"""The scaling policies: how many workers to run at a grow or a move, from plain values (no Ray)."""

from __future__ import annotations

import pytest

from raysgd_fault import (
    DefaultPolicy,
    ElasticPolicy,
    FixedSize,
    GrowWhenRoom,
    NeverRetryPolicy,
    ScalingDecision,
    ScalingStatus,
)


def status(moment: str = "grow", **kw: object) -> ScalingStatus:
    base: dict[str, object] = {"workers_wanted": 4, "workers_running": 2}
    base.update(kw)
    return ScalingStatus(moment, **base)  # type: ignore[arg-type]


def test_grow_when_room_takes_what_fits_up_to_the_wanted_size() -> None:
    policy = GrowWhenRoom()
    d = policy.decide(status(workers_fitting=1))
    assert d.num_workers == 3 and "grow: from 2 to 3 of 4" in d.reason
    assert policy.decide(status(workers_running=3, workers_fitting=5)).num_workers == 4
    kept = policy.decide(status(workers_fitting=0))
    assert kept.num_workers == 2 and kept.reason.startswith("keep 2 of 4")


def test_a_move_starts_replacements_where_there_is_room() -> None:
    # 1 worker stays, 2 fit elsewhere: run 3; none fit: shrink to the one that stays.
    policy = GrowWhenRoom()
    assert (
        policy.decide(status("preemption", workers_running=1, workers_fitting=2)).num_workers == 3
    )
    assert policy.decide(status("preemption", workers_running=1)).num_workers == 1


def test_the_minimum_and_the_cooldown() -> None:
    policy = GrowWhenRoom(min_workers=3, cooldown_s=10.0)
    assert policy.decide(status(workers_running=1, workers_fitting=1)).num_workers == 1  # 2 < 3
    assert policy.decide(status(workers_running=1, workers_fitting=5)).num_workers == 4
    recent = status(workers_fitting=2, seconds_since_last_failure=3.0)
    d = policy.decide(recent)
    assert d.num_workers == 2 and "cooldown" in d.reason
    assert (
        policy.decide(status(workers_fitting=2, seconds_since_last_failure=30.0)).num_workers == 4
    )
    # The cooldown is for growing back only: a move off a draining node is not delayed by it.
    moving = status(
        "preemption", workers_running=1, workers_fitting=3, seconds_since_last_failure=1.0
    )
    assert policy.decide(moving).num_workers == 4
    assert GrowWhenRoom(min_workers=8).decide(status(workers_fitting=5)).num_workers == 4


def test_fixed_size_never_resizes() -> None:
    assert FixedSize().decide(status(workers_fitting=4)).num_workers == 2
    assert (
        FixedSize().decide(status("preemption", workers_running=1, workers_fitting=4)).num_workers
        == 1
    )


def test_each_failure_policy_names_its_scaling_policy() -> None:
    assert (
        repr(DefaultPolicy(grow_cooldown_s=5).scaling)
        == "GrowWhenRoom(min_workers=1, cooldown_s=5)"
    )
    assert repr(ElasticPolicy(min_workers=3).scaling) == "GrowWhenRoom(min_workers=3, cooldown_s=0)"
    assert isinstance(NeverRetryPolicy().scaling, FixedSize)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"moment": "failure"}, ValueError),
        ({"workers_wanted": 0}, ValueError),
        ({"workers_running": 5}, ValueError),  # more than wanted
        ({"workers_fitting": -1}, ValueError),
        ({"seconds_since_last_failure": -1.0}, ValueError),
        ({"workers_running": 1.5}, TypeError),
    ],
)
def test_bad_status_fields_are_refused(fields: dict[str, object], error: type[Exception]) -> None:
    base: dict[str, object] = {"moment": "grow", "workers_wanted": 4, "workers_running": 2}
    with pytest.raises(error):
        ScalingStatus(**{**base, **fields})  # type: ignore[arg-type]


def test_a_decision_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        ScalingDecision(2, " ")
    assert str(ScalingDecision(3, "room")) == "run 3 worker(s): room"
