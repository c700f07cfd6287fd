"""The guard of the trainer's calls other than `train()` (a save, a state read, `get_model`, an
operator applied): each runs on a usable group and fails in one form.

A group found broken is repaired before the call; a user error or a lost worker inside it is
repaired after (the controller's REPAIRING: a user error logged and not counted, a lost worker
counted, the group re-formed at its size) and then raised, a user error in its one form
(`in_one_form`). What the user asked to read, and what the driver writes through the workers,
is done once more on the repaired group when a worker was lost in it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable, Optional, TypeVar

from raysgd._internal.driver.group_view import ElasticGroup
from raysgd_core import WorkerDiedError, WorkerError

__all__ = ["CallGuard", "in_one_form"]

T = TypeVar("T")


def in_one_form(error: WorkerError) -> WorkerError:
    """The form every user exception takes when it leaves the trainer: `error` as an instance of
    both `WorkerError` and its cause's class (`WorkerError.as_instance_of_cause`), keeping the
    traceback of where the group raised it."""
    return error.as_instance_of_cause().with_traceback(error.__traceback__)


class CallGuard:
    """Guards worker calls made outside a train attempt (see the module docstring).

    Args:
        group: The worker group the calls run on.
        repair: Puts the group back in shape after a call failed with the error given, or
            before a call when the group is found broken (None); returns whether it is usable.
    """

    def __init__(
        self, group: ElasticGroup, repair: Callable[[Optional[BaseException]], bool]
    ) -> None:
        self._group, self._repair = group, repair
        self._guarding = False

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Worker calls inside are made on a usable group and fail in one form. Nested blocks
        are part of the outermost one."""
        if self._guarding:
            yield
            return
        self._guarding = True
        try:
            if self._group.needs_recovery:
                self._repair(None)
            try:
                yield
            except (WorkerError, WorkerDiedError) as exc:
                self._repair(exc)
                if isinstance(exc, WorkerError):
                    raise in_one_form(exc)  # noqa: B904 (its cause is the user's exception)
                raise
        finally:
            self._guarding = False

    def call(self, fn: Callable[..., Any], *args: Any, rank: Optional[int] = None) -> Any:
        """`fn(*args)` on every worker (or on `rank`), guarded."""
        with self.guarded():
            if rank is None:
                return self._group.execute(fn, *args)
            return self._group.execute_single(rank, fn, *args)

    def read(self, fn: Callable[..., T], *args: Any, rank: int = 0) -> T:
        """`fn(*args)` on `rank` for something the user asked to read (the state, the model): a
        worker lost meanwhile is replaced and the read done again once."""
        return self.again_once(functools.partial(self.call, fn, rank=rank), *args)

    def again_once(self, action: Callable[..., T], *args: Any) -> T:
        """`action(*args)` (driver code that calls the workers: a checkpoint written, a state
        read), guarded; when a worker is lost in it, done once more on the repaired group."""
        try:
            with self.guarded():
                return action(*args)
        except WorkerDiedError:
            with self.guarded():
                return action(*args)
