"""What a function run by `WorkerGroup.execute` can learn about the worker it runs on.

`get_context()` reads a `ContextVar` that the worker sets around every call, so the driver-local
rank 0 (`use_local=True`) and the Ray actors behave the same. In an actor process the last context
also stays the process default, so threads started by user code see it too.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["WorkerContext", "get_context"]


@dataclass(frozen=True)
class WorkerContext:
    """The worker's place in the current process group.

    Attributes:
        world_rank: rank in the process group (0..world_size-1).
        world_size: number of workers in the process group.
        local_rank: rank among the workers on the same node, in world-rank order.
        local_world_size: number of workers on this node.
        node_id: Ray node id of this worker.
        node_ip: IP address of this worker's node.
        device: the `torch.device` this worker should compute on (`cuda:0` for a GPU actor, as Ray
            sets `CUDA_VISIBLE_DEVICES` per actor; `cpu` otherwise).
        backend: the `torch.distributed` backend ("gloo" or "nccl").
        timeout_s: the process group's timeout: the longest one collective waits for a peer,
            unless the caller bounds it tighter with `raysgd_core.set_collective_timeout`.
        store: a dict that lives as long as the worker's `WorkerGroup` (kept across
            `WorkerGroup.recover`): frameworks keep their per-worker objects here. A process
            kept for a later group (`KEEP_WORKERS_ENV`) starts it empty, and first calls
            `close()` on each value that has one.
        generation: which process group this is: the same on every rank, never the same for
            two process groups of one driver (a re-formed group, another `WorkerGroup`). It
            tells this group apart from an earlier one in which the process may have had
            another rank (name a `DeviceMesh` by it, so that nothing cached for the old group's
            mesh is used for the new one).
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: str
    node_ip: str
    device: Any
    backend: str
    timeout_s: float
    store: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    generation: int = 0


_current: contextvars.ContextVar[Optional[WorkerContext]] = contextvars.ContextVar(
    "raysgd_core_worker_context", default=None
)
# The default for threads that did not inherit the ContextVar; set only in actor processes, where
# one process is exactly one worker.
_process_default: list[Optional[WorkerContext]] = [None]


def get_context() -> WorkerContext:
    """Return the `WorkerContext` of the worker running the caller.

    Raises:
        RuntimeError: when called outside a function run by a `WorkerGroup`.
    """
    ctx = _current.get() or _process_default[0]
    if ctx is None:
        raise RuntimeError(
            "raysgd_core.get_context() was called outside a worker: call it inside a function "
            "run by WorkerGroup.execute / execute_single."
        )
    return ctx
