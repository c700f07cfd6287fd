"""Typed errors of the worker pool.

Callers (the trainer's recovery loop, embedding frameworks) branch on these types: a
`WorkerDiedError` means workers are gone and `WorkerGroup.recover` can replace them; a `WorkerError`
means user code raised, which retrying will not fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

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
    """

    def __init__(
        self,
        message: str,
        ranks: Sequence[int],
        nodes: Sequence[str],
        preempted: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks)
        self.nodes: list[str] = list(nodes)
        self.preempted: list[int] = list(preempted)

    def __reduce__(self):  # keep the attributes when the error crosses a process boundary
        return (type(self), (str(self), self.ranks, self.nodes, self.preempted))


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


class ResourcesUnavailableError(TimeoutError):
    """The workers could not be placed within the start timeout.

    Nothing is left behind: the actors and the placement group made for them are removed before this
    is raised. The message names what was asked for and what the cluster had free.
    """
