"""Every branch of the built-in failure policies, driven by plain FailureStatus values (no Ray)."""

from __future__ import annotations

import logging

import pytest

from raysgd_fault import (
    Action,
    DefaultPolicy,
    ElasticPolicy,
    FailureStatus,
    NeverRetryPolicy,
)


def status(**kw: object) -> FailureStatus:
    base: dict[str, object] = {"failures": 1, "max_retries": 3, "workers_wanted": 4}
    base.update(kw)
    return FailureStatus(**base)  # type: ignore[arg-type]


# ---- DefaultPolicy: after a loss -------------------------------------------------------------


def test_default_retries_with_survivors_plus_fitting() -> None:
    d = DefaultPolicy().decide(status(workers_alive=2, workers_fitting=1))
    assert d.action is Action.RETRY and d.num_workers == 3
    assert "1 failure" in d.reason


def test_default_never_asks_for_more_than_wanted() -> None:
    d = DefaultPolicy().decide(status(workers_alive=3, workers_fitting=10))
    # 3 of 4 go on, one more starts beside them.
    assert (d.action, d.num_workers + d.background) == (Action.RETRY, 4)
    d = DefaultPolicy().decide(status(workers_alive=1, workers_fitting=10))
    assert (d.action, d.num_workers, d.background) == (Action.RETRY, 4, 0)


def test_default_runs_on_a_single_worker() -> None:
    d = DefaultPolicy().decide(status(workers_alive=0, workers_fitting=1))
    assert (d.action, d.num_workers) == (Action.RETRY, 1)


def test_default_retries_up_to_max_retries_inclusive() -> None:
    assert DefaultPolicy().decide(status(failures=3, workers_fitting=4)).action is Action.RETRY
    d = DefaultPolicy().decide(status(failures=4, workers_fitting=4, error="actor died"))
    assert d.action is Action.GIVE_UP
    assert "4 failure(s)" in d.reason and "max_retries=3" in d.reason
    assert "actor died" in d.reason


def test_default_max_retries_zero_gives_up_at_first_failure() -> None:
    d = DefaultPolicy().decide(status(failures=1, max_retries=0, workers_fitting=4))
    assert d.action is Action.GIVE_UP


def test_default_backoff_sequence_is_exponential_and_capped() -> None:
    policy = DefaultPolicy(max_attempts=10, max_wait_s=60.0)
    waits = []
    for attempt in range(10):
        d = policy.decide(status(workers_alive=0, workers_fitting=0, attempt=attempt))
        assert d.action is Action.WAIT and d.num_workers == 0
        waits.append(d.wait_s)
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert policy.backoff_s(10_000) == 60.0  # no overflow for absurd attempts


def test_default_backoff_base_scales_sequence() -> None:
    policy = DefaultPolicy(base_wait_s=0.5, max_wait_s=3.0)
    assert [policy.backoff_s(i) for i in range(4)] == [0.5, 1.0, 2.0, 3.0]


def test_default_gives_up_after_max_attempts_naming_failures() -> None:
    d = DefaultPolicy(max_attempts=3).decide(
        status(failures=2, workers_fitting=0, attempt=3, error="node lost")
    )
    assert d.action is Action.GIVE_UP
    assert "3 attempt(s)" in d.reason and "2 failure(s)" in d.reason and "node lost" in d.reason


def test_default_gives_up_after_max_attempts_even_if_estimate_says_room() -> None:
    # `attempt` counts restarts that produced no worker: a stale estimate must not loop forever.
    d = DefaultPolicy(max_attempts=2).decide(status(workers_fitting=4, attempt=2))
    assert d.action is Action.GIVE_UP


def test_default_retries_when_room_appears_during_backoff() -> None:
    d = DefaultPolicy().decide(status(workers_fitting=2, attempt=5))
    assert (d.action, d.num_workers) == (Action.RETRY, 2)


# ---- ElasticPolicy ---------------------------------------------------------------------------


def test_elastic_retries_at_or_above_minimum() -> None:
    d = ElasticPolicy(min_workers=2).decide(status(workers_alive=1, workers_fitting=1))
    assert (d.action, d.num_workers) == (Action.RETRY, 2)


def test_elastic_waits_below_minimum_then_gives_up() -> None:
    policy = ElasticPolicy(min_workers=3, max_attempts=2)
    d = policy.decide(status(workers_alive=1, workers_fitting=1))
    assert d.action is Action.WAIT and d.wait_s == 1.0
    assert "3 needed" in d.reason
    d = policy.decide(status(workers_alive=1, workers_fitting=1, attempt=1))
    assert d.action is Action.WAIT and d.wait_s == 2.0
    d = policy.decide(status(workers_alive=1, workers_fitting=1, attempt=2))
    assert d.action is Action.GIVE_UP and "at least 3" in d.reason and "1 failure(s)" in d.reason


def test_elastic_still_respects_max_retries() -> None:
    d = ElasticPolicy(min_workers=1).decide(status(failures=4, workers_fitting=4))
    assert d.action is Action.GIVE_UP


def test_elastic_minimum_clamped_to_wanted() -> None:
    d = ElasticPolicy(min_workers=8).decide(status(workers_fitting=4))
    assert (d.action, d.num_workers) == (Action.RETRY, 4)


def test_elastic_trains_on_with_the_survivors_while_replacements_start() -> None:
    d = ElasticPolicy(min_workers=2).decide(status(workers_alive=2, workers_fitting=1))
    assert (d.action, d.num_workers, d.background) == (Action.RETRY, 2, 1)
    assert "2 alive go on while 1 replacement(s)" in d.reason
    # Below the minimum the group waits for its replacements, as without the option.
    d = ElasticPolicy(min_workers=3).decide(status(workers_alive=2, workers_fitting=2))
    assert (d.num_workers, d.background) == (4, 0)
    # No room for a replacement: nothing to start, the survivors go on.
    d = ElasticPolicy(min_workers=1).decide(status(workers_alive=3, workers_fitting=0))
    assert (d.num_workers, d.background) == (3, 0)
    # Opting out, and the default policy's opting in.
    d = ElasticPolicy(replace_in_background=False).decide(
        status(workers_alive=2, workers_fitting=2)
    )
    assert (d.num_workers, d.background) == (4, 0)
    d = DefaultPolicy(replace_in_background=True).decide(status(workers_alive=1, workers_fitting=1))
    assert (d.num_workers, d.background) == (1, 1)
    with pytest.raises(TypeError, match="replace_in_background"):
        DefaultPolicy(replace_in_background=1)  # type: ignore[arg-type]


def test_the_default_trains_on_when_three_quarters_survive() -> None:
    # "auto": one lost of four (or more) goes on at once; a survivor's share grows by a third.
    d = DefaultPolicy().decide(status(workers_alive=3, workers_fitting=1))
    assert (d.action, d.num_workers, d.background) == (Action.RETRY, 3, 1)
    d = DefaultPolicy().decide(status(workers_wanted=16, workers_alive=12, workers_fitting=4))
    assert (d.num_workers, d.background) == (12, 4)
    # One of two, or two of four: the survivors' share would double; they wait.
    d = DefaultPolicy().decide(status(workers_wanted=2, workers_alive=1, workers_fitting=1))
    assert (d.num_workers, d.background) == (2, 0)
    d = DefaultPolicy().decide(status(workers_alive=2, workers_fitting=2))
    assert (d.num_workers, d.background) == (4, 0)
    assert "replace_in_background='auto'" in repr(DefaultPolicy())


# ---- NeverRetryPolicy ------------------------------------------------------------------------


def test_never_gives_up_at_once() -> None:
    d = NeverRetryPolicy().decide(status(failures=1, workers_fitting=4, error="boom"))
    assert d.action is Action.GIVE_UP
    assert "never" in d.reason and "1 failure(s)" in d.reason and "boom" in d.reason


# ---- common ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [DefaultPolicy(), ElasticPolicy(2), NeverRetryPolicy()])
def test_decide_rejects_non_status(policy: object) -> None:
    with pytest.raises(TypeError, match="FailureStatus"):
        policy.decide({"failures": 1})  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_attempts": 0}, ValueError, "max_attempts"),
        ({"max_attempts": 2.5}, TypeError, "max_attempts"),
        ({"base_wait_s": -1}, ValueError, "base_wait_s"),
        ({"max_wait_s": float("nan")}, ValueError, "max_wait_s"),
        ({"grow_cooldown_s": "10"}, TypeError, "grow_cooldown_s"),
    ],
)
def test_default_rejects_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DefaultPolicy(**kwargs)


def test_elastic_rejects_bad_minimum() -> None:
    with pytest.raises(ValueError, match="min_workers"):
        ElasticPolicy(min_workers=0)
    with pytest.raises(TypeError, match="min_workers"):
        ElasticPolicy(min_workers="2")  # type: ignore[arg-type]


def test_decisions_are_pure_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    policy, s = DefaultPolicy(), status(workers_alive=1, workers_fitting=1)
    with caplog.at_level(logging.DEBUG, logger="raysgd_fault"):
        assert policy.decide(s) == policy.decide(s)
    assert "RETRY with 2 worker(s)" in caplog.text
