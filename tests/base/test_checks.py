"""raysgd_base.check_int and check_number: one check each, one message form, WrongTypeError (a
TypeError that is also a ValueError) for the type, ValueError for the range."""

from __future__ import annotations

import pytest

from raysgd_base import WrongTypeError, check_int, check_number, check_option_names

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("value", "minimum"), [(1, 1), (7, 1), (0, 0), (-3, -3)])
def test_accepted_values_come_back(value: int, minimum: int) -> None:
    assert check_int("n", value, minimum=minimum) == value


@pytest.mark.parametrize("value", ["2", 2.0, 1.5, None, True, False, [1]])
def test_a_value_that_is_not_an_int_is_a_type_error(value: object) -> None:
    with pytest.raises(WrongTypeError) as info:
        check_int("num_workers", value)
    assert str(info.value) == f"num_workers must be a positive int (>= 1), got {value!r}"
    # Any bad value can be caught as a ValueError.
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), (-1, 0), (2, 3)])
def test_a_value_below_the_minimum_is_a_value_error(value: int, minimum: int) -> None:
    with pytest.raises(ValueError) as info:
        check_int("spare_workers", value, minimum=minimum)
    assert not isinstance(info.value, TypeError)
    expected = "a positive int (>= 1)" if minimum == 1 else f"an int >= {minimum}"
    assert str(info.value) == f"spare_workers must be {expected}, got {value!r}"


def test_the_packages_use_the_one_message_form() -> None:
    """Checks that once had their own wording now say the same thing."""
    from raysgd_core import GroupOptions, WorkerGroup
    from raysgd_fault import ElasticPolicy, FailureStatus
    from raysgd_operator import TrainingOptions

    with pytest.raises(ValueError, match=r"^num_workers must be a positive int \(>= 1\), got 0$"):
        WorkerGroup(0)
    with pytest.raises(ValueError, match=r"^spare_workers must be an int >= 0, got -1$"):
        GroupOptions(spare_workers=-1)
    with pytest.raises(ValueError, match=r"^timeout_s must be a number > 0, got 0$"):
        GroupOptions(timeout_s=0)
    with pytest.raises(TypeError, match=r"^num_gpus_per_worker must be a number >= 0, got '1'$"):
        WorkerGroup(1, num_gpus_per_worker="1")
    with pytest.raises(TypeError, match=r"^min_workers must be a positive int \(>= 1\), got '2'$"):
        ElasticPolicy(min_workers="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^failures must be an int >= 0, got 1\.0$"):
        FailureStatus(failures=1.0, max_retries=0, workers_wanted=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^accumulate_grad_batches must be a positive int \("):
        TrainingOptions(accumulate_grad_batches=0)


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        ("1", {}, WrongTypeError, "x must be a number >= 0, got '1'"),
        (True, {}, WrongTypeError, "x must be a number >= 0, got True"),
        (-0.5, {}, ValueError, "x must be a number >= 0, got -0.5"),
        (0, {"above": 0}, ValueError, "x must be a number > 0, got 0"),
        (float("nan"), {}, ValueError, "x must be a number >= 0, got nan"),
        (1, {"minimum": 2}, ValueError, "x must be a number >= 2, got 1"),
    ],
)
def test_check_number_refuses_with_one_message_form(
    value: object, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        check_number("x", value, **kwargs)
    assert str(info.value) == message


def test_check_number_returns_accepted_values() -> None:
    assert check_number("x", 0) == 0
    assert check_number("x", 2.5, above=0) == 2.5


def test_unknown_option_names_are_one_type_error_in_every_options_object() -> None:
    check_option_names("training", ["use_fp16"], ["use_fp16", "use_gpu"])
    with pytest.raises(TypeError) as info:
        check_option_names("training", ["b", "use_gpu", "a"], ["use_fp16", "use_gpu"])
    assert str(info.value) == (
        "unknown training option(s) a, b; the options are ['use_fp16', 'use_gpu']"
    )

    from raysgd_core import GroupOptions
    from raysgd_operator import TrainingOptions

    with pytest.raises(
        TypeError, match=r"^unknown worker-group option\(s\) bogus; the options are \["
    ):
        GroupOptions.build(bogus=1)
    with pytest.raises(TypeError, match=r"^unknown training option\(s\) bogus; the options are \["):
        TrainingOptions.build(bogus=1)
