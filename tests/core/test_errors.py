"""`WorkerError.as_instance_of_cause`: one exception that is both the WorkerError and the user's
exception (no Ray needed: the errors are built here as a group builds them)."""

from __future__ import annotations

import errno
import pickle

import pytest

from raysgd_core import WorkerError

MESSAGE = "rank 1 (node abc) raised BadInput: no\n\nTraceback on the worker:\n  File ..., in hook"


class BadInput(ValueError):
    """A user exception whose `__init__` takes other arguments than its `args`."""

    def __init__(self, field: str, value: int) -> None:
        super().__init__(f"{field} cannot be {value}")
        self.field = field
        self.value = value

    def __reduce__(self):
        return (BadInput, (self.field, self.value))


class Refuses(Exception):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("this class cannot be subclassed")


def from_worker(cause: BaseException | None) -> WorkerError:
    """A WorkerError as `WorkerGroup.execute` raises it: the original exception as its cause."""
    error = WorkerError(MESSAGE, 1, "abc", "  File ..., in hook", lost_ranks=[2])
    error.__cause__ = cause
    return error


def test_it_is_both_types_with_the_cause_args_and_attributes_and_no_init_run() -> None:
    cause = BadInput("lr", -1)
    cause.add_note("while reading the config")
    calls = []
    BadInput.__init__, original = (lambda *a: calls.append(a)), BadInput.__init__
    try:
        error = from_worker(cause).as_instance_of_cause()
    finally:
        BadInput.__init__ = original
    assert not calls  # the user's __init__ never ran
    assert isinstance(error, WorkerError) and isinstance(error, BadInput)
    assert type(error).__name__ == "WorkerError(BadInput)"
    assert error.args == ("lr cannot be -1",) and (error.field, error.value) == ("lr", -1)
    assert error.__notes__ == ["while reading the config"]
    assert (error.rank, error.node_id, error.lost_ranks) == (1, "abc", [2])
    assert error.remote_traceback == "  File ..., in hook"
    assert str(error) == MESSAGE  # the worker's traceback, as a plain WorkerError shows it
    assert error.__cause__ is cause
    with pytest.raises(BadInput, match="BadInput: no"):
        raise error
    # One class per cause class; asking again changes nothing.
    again = from_worker(BadInput("x", 1)).as_instance_of_cause()
    assert type(again) is type(error) and error.as_instance_of_cause() is error


def test_it_survives_pickling() -> None:
    error = from_worker(BadInput("lr", -1)).as_instance_of_cause()
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and isinstance(copy, BadInput)
    assert (copy.field, copy.rank, str(copy)) == ("lr", 1, MESSAGE)
    assert isinstance(copy.__cause__, BadInput)


def test_builtin_fields_come_along() -> None:
    missing = from_worker(FileNotFoundError(errno.ENOENT, "gone", "/data")).as_instance_of_cause()
    assert isinstance(missing, FileNotFoundError) and isinstance(missing, WorkerError)
    assert (missing.errno, missing.strerror, missing.filename) == (errno.ENOENT, "gone", "/data")
    key = from_worker(KeyError("lr")).as_instance_of_cause()
    assert isinstance(key, KeyError) and key.args == ("lr",)


@pytest.mark.parametrize(
    "cause",
    [None, KeyboardInterrupt(), Refuses("no subclasses")],
    ids=["no cause", "not an Exception", "cannot be subclassed"],
)
def test_plain_worker_error_when_no_such_instance_can_be_made(cause) -> None:
    error = from_worker(cause)
    assert error.as_instance_of_cause() is error
