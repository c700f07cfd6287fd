"""Bounding how long a worker waits for its peers in a collective (called inside a worker).

A peer that goes silent (a frozen or partitioned node, a hung process) keeps its connections open,
so nothing fails: a rank waiting for it in a collective waits for the process group's timeout,
`WorkerContext.timeout_s`. A caller that knows how long a collective should take (a training loop
that measures its steps) bounds the wait tighter, so that the waiting rank raises soon, keeps its
process and state, and its driver learns which peer did not answer (`GroupOptions.peer_grace_s`).
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["set_collective_timeout"]


def set_collective_timeout(seconds: float) -> bool:
    """Bound every later collective of this process's default group to `seconds`; whether there
    was a group to bound.

    A rank waiting on a peer that went silent (a frozen node, a hung process) then raises instead
    of waiting for the group's full timeout, and keeps its process and tensors. A collective that
    is already waiting keeps the bound it started with: gloo can be neither aborted nor re-timed
    mid-wait, which is why callers set the bound between steps.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.group.WORLD.set_timeout(timedelta(seconds=float(seconds)))
    return True
