"""Typed errors of the worker pool.

Callers (the trainer's recovery loop, embedding frameworks) branch on these types: a
`WorkerDiedError` means workers are gone and `WorkerGroup.recover` can replace them; a `WorkerError`
means user code raised, which retrying will not fix. `WorkerError.as_instance_of_cause()` gives
the form a library hands its own users: one exception that is both the `WorkerError` and an
instance of the user's exception class.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Optional

__all__ = [
    "ResourcesUnavailableError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroupError",
]


class WorkerGroupError(RuntimeError):
    """Base class of the failures a started `WorkerGroup` reports."""


class WorkerDiedError(WorkerGroupError):
    """One or more workers are gone: the actor process or its node died, or it was killed.

    Attributes:
        ranks: the world ranks that are gone, sorted.
        nodes: the Ray node ids they ran on, in the order of `ranks`.
        preempted: the ranks among them whose loss Ray marked as a preemption (their node was
            reclaimed after a preemption drain).
        silent: the ranks among them that stopped answering without dying (a peer's collective
            waited out its bound for them) and were killed: their node may be frozen, so its
            room is not counted on.
    """

    def __init__(
        self,
        message: str,
        ranks: Sequence[int],
        nodes: Sequence[str],
        preempted: Sequence[int] = (),
        silent: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks)
        self.nodes: list[str] = list(nodes)
        self.preempted: list[int] = list(preempted)
        self.silent: list[int] = list(silent)

    def __reduce__(self):  # keep the attributes when the error crosses a process boundary
        return (type(self), (str(self), self.ranks, self.nodes, self.preempted, self.silent))


class WorkerError(WorkerGroupError):
    """User code raised on a worker.

    The message holds the worker's traceback; the original exception is `__cause__` when it could be
    pickled back to the caller.

    Attributes:
        rank: the world rank whose code raised first.
        node_id: the Ray node id of that worker.
        remote_traceback: the formatted traceback from the worker.
        lost_ranks: ranks that were stuck in a collective after the failure and were killed (they
            must be replaced with `WorkerGroup.recover`); empty when every peer came back.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        node_id: str,
        remote_traceback: str,
        lost_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.node_id = node_id
        self.remote_traceback = remote_traceback
        self.lost_ranks: list[int] = list(lost_ranks or [])

    def __reduce__(self):
        return (
            type(self),
            (str(self), self.rank, self.node_id, self.remote_traceback, self.lost_ranks),
        )

    def as_instance_of_cause(self) -> WorkerError:
        """This error as an instance of both `WorkerError` and the class of `__cause__`.

        `except WorkerError` and `except <the user's exception class>` then both catch it. Its
        class is made once per cause class, named ``WorkerError(<cause class name>)``; the instance
        is made without calling the cause class's `__init__`: it gets the cause's `args` and
        attributes (those in its `__dict__` and its slots), this error's `rank`, `node_id`,
        `remote_traceback` and `lost_ranks` (these win over attributes of the same name), and
        the cause as `__cause__`. `str()` is this error's message, with the worker's traceback.

        Returns this error itself when there is no cause, when the cause is not an `Exception`
        (KeyboardInterrupt, SystemExit) or when its class cannot be subclassed (a class that
        refuses subclasses, a conflicting instance layout or metaclass).
        """
        cause = self.__cause__
        if isinstance(self, _CauseTyped) or not isinstance(cause, Exception):
            return self
        typed = _cause_typed_class(type(cause))
        if typed is None:
            return self
        try:
            error = _new_without_init(typed, cause)
        except Exception:
            return self
        error.rank = self.rank
        error.node_id = self.node_id
        error.remote_traceback = self.remote_traceback
        error.lost_ranks = list(self.lost_ranks)
        error._message = str(self)
        error.__cause__ = cause
        return error


class _CauseTyped(WorkerError):
    """Base of the classes `WorkerError.as_instance_of_cause` makes (one per cause class)."""

    _message: str

    def __str__(self) -> str:
        return self._message

    def __reduce__(self):  # the made class cannot be found by name: rebuild it where unpickled
        return (
            _rebuild_cause_typed,
            (
                self._message,
                self.rank,
                self.node_id,
                self.remote_traceback,
                self.lost_ranks,
                self.__cause__,
            ),
        )


#: The class made for each cause class (None: that class cannot be subclassed).
_CAUSE_TYPED: dict[type, Optional[type]] = {}


def _cause_typed_class(cause_cls: type) -> Optional[type]:
    if cause_cls not in _CAUSE_TYPED:
        name = f"WorkerError({cause_cls.__name__})"
        try:
            made: Optional[type] = type(
                name, (_CauseTyped, cause_cls), {"__module__": __name__, "__qualname__": name}
            )
        except Exception:  # refuses subclasses, or a layout or metaclass conflict
            made = None
        _CAUSE_TYPED[cause_cls] = made
    return _CAUSE_TYPED[cause_cls]


def _new_without_init(typed: type, cause: BaseException) -> WorkerError:
    """An instance of `typed` holding `cause`'s args and attributes; no `__init__` of the user's
    class runs. The first built-in exception class of the cause's MRO allocates it (its layout may
    be larger than BaseException's, as OSError's is) and fills its own fields from the args."""
    builtin = next(k for k in type(cause).__mro__ if k.__module__ == "builtins")
    error = builtin.__new__(typed, *cause.args)
    try:
        builtin.__init__(error, *cause.args)
    except Exception:  # args the built-in class does not take: they are copied below anyway
        pass
    error.args = cause.args
    for klass in type(cause).__mro__:
        for name, member in vars(klass).items():
            # Slots, and the fields of built-in exceptions (OSError.errno, ImportError.name, ...).
            if isinstance(member, types.MemberDescriptorType) and not name.startswith("__"):
                try:
                    setattr(error, name, getattr(cause, name))
                except (AttributeError, TypeError):
                    pass
    error.__dict__.update(vars(cause))
    return error


def _rebuild_cause_typed(
    message: str,
    rank: int,
    node_id: str,
    remote_traceback: str,
    lost_ranks: Sequence[int],
    cause: Optional[BaseException],
) -> Any:
    error = WorkerError(message, rank, node_id, remote_traceback, lost_ranks)
    error.__cause__ = cause
    return error.as_instance_of_cause()


class ResourcesUnavailableError(TimeoutError):
    """The workers could not be placed within the start timeout.

    Nothing is left behind: the actors and the placement group made for them are removed before this
    is raised. The message names what was asked for and what the cluster had free.
    """
