"""FailureStatus / Decision validation and the log line a decision produces."""

from __future__ import annotations

import dataclasses

import pytest

from raysgd_fault import Action, Decision, FailureStatus, describe


def test_status_defaults_total_failures_to_failures() -> None:
    status = FailureStatus(failures=2, max_retries=3, workers_wanted=4)
    assert status.total_failures == 2
    assert status.workers_alive == 0 and status.workers_fitting == 0 and status.attempt == 0


def test_status_is_frozen() -> None:
    status = FailureStatus(failures=0, max_retries=0, workers_wanted=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.failures = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("failures", -1, ValueError),
        ("max_retries", -1, ValueError),
        ("workers_wanted", 0, ValueError),
        ("workers_alive", -1, ValueError),
        ("workers_alive", 5, ValueError),  # more than wanted
        ("workers_fitting", -2, ValueError),
        ("attempt", -1, ValueError),
        ("total_failures", 0, ValueError),  # fewer than failures (1)
        ("seconds_since_last_failure", -0.5, ValueError),
        ("seconds_since_last_failure", float("nan"), ValueError),
        ("failures", 1.0, TypeError),
        ("workers_wanted", True, TypeError),
        ("seconds_since_last_failure", "1", TypeError),
        ("error", None, TypeError),
    ],
)
def test_status_rejects_bad_fields(field: str, value: object, error: type[Exception]) -> None:
    fields: dict[str, object] = {"failures": 1, "max_retries": 3, "workers_wanted": 4}
    fields[field] = value
    with pytest.raises(error, match=field):
        FailureStatus(**fields)  # type: ignore[arg-type]


def test_decision_validation() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        Decision(Action.RETRY, num_workers=0, reason="x")
    with pytest.raises(ValueError, match="reason"):
        Decision(Action.GIVE_UP, reason="  ")
    with pytest.raises(ValueError, match="wait_s"):
        Decision(Action.WAIT, wait_s=-1.0, reason="x")
    with pytest.raises(TypeError, match="action"):
        Decision("retry", num_workers=1, reason="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="background"):
        Decision(Action.RETRY, num_workers=1, background=-1, reason="x")
    with pytest.raises(ValueError, match="RETRY"):
        Decision(Action.WAIT, wait_s=1.0, background=1, reason="x")


def test_describe_and_str_give_one_log_line() -> None:
    retry = Decision(Action.RETRY, num_workers=2, reason="1 failure")
    wait = Decision(Action.WAIT, wait_s=4.0, reason="nothing fits")
    give_up = Decision(Action.GIVE_UP, reason="budget spent")
    assert describe(retry) == str(retry) == "RETRY with 2 worker(s): 1 failure"
    assert str(wait) == "WAIT 4 s: nothing fits"
    assert str(give_up) == "GIVE_UP: budget spent"
    later = Decision(Action.RETRY, num_workers=1, background=1, reason="1 failure")
    assert str(later) == "RETRY with 1 worker(s), 1 more starting in the background: 1 failure"
    assert Action.RETRY == "retry"  # a str enum: serialisable in logs and metrics as is


def test_package_imports_no_ray_torch_or_sibling() -> None:
    # The policies must be usable (and testable) where Ray is not installed.
    import subprocess
    import sys

    code = (
        "import sys, raysgd_fault; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'torch', 'raysgd', 'raysgd_core', 'raysgd_amp', 'raysgd_operator')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
