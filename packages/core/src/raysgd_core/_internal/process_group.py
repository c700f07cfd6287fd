"""Forming and tearing down the `torch.distributed` process group inside one worker process.

Rank 0 creates the rendezvous `TCPStore` itself, on port 0, before the other ranks are told where it
is: the OS picks a free port and nobody can take it between "find a free port" and "bind it".
The store gets the short formation timeout, so a peer that dies during formation makes the others
fail within `formation_timeout_s` instead of the collective timeout (30 minutes by default).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

from raysgd_core._internal.abort import Endpoint, GroupConnections, listening_endpoints

__all__ = [
    "NCCL_ENV_DEFAULTS",
    "apply_nccl_env",
    "destroy_process_group",
    "forget_failed_group",
    "form_process_group",
    "make_master_store",
    "select_device",
    "store_endpoint",
]

#: How NCCL reacts to a collective that outlives its timeout or was aborted, read when a group is
#: built; a value the user set wins. torch's defaults can end the process, which would kill a
#: survivor together with the state it holds: its watchdog rethrows an error (ending the process)
#: unless error handling is "2" (abort the communicators only: the rank raises at its next
#: collective and stays usable), and its heartbeat monitor ends the process minutes after a timeout
#: anywhere in the group (the dump it triggers) or when the watchdog stalls (an abort can stall
#: it). raysgd's own bounds and the driver find a rank that really hangs.
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}

logger = logging.getLogger("raysgd_core")


def apply_nccl_env() -> dict[str, str]:
    """Set `NCCL_ENV_DEFAULTS` where the environment does not say otherwise (read when an NCCL
    group is built); what is in effect now. A value that lets NCCL end the process is kept, with
    a warning: a survivor aborted on purpose, or timed out waiting for a lost peer, would die."""
    for name, value in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    handling = os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    if handling not in ("0", "2"):
        logger.warning(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=%s makes NCCL end a process whose collective timed "
            "out: a worker waiting for a lost peer dies with the state it holds (raysgd sets 2)",
            handling,
        )
    return {name: os.environ[name] for name in NCCL_ENV_DEFAULTS}


def make_master_store(host: str, world_size: int, formation_timeout_s: float) -> Any:
    """Create rank 0's `TCPStore` on a free port; its `.port` tells the others where to connect."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=formation_timeout_s),
        wait_for_workers=False,
    )


def select_device(gpu_index: Optional[int]) -> Any:
    """The worker's torch device: `cuda:<gpu_index>` (made current) or the CPU."""
    import torch

    if gpu_index is None:
        return torch.device("cpu")
    device = torch.device("cuda", gpu_index)
    torch.cuda.set_device(device)
    return device


def form_process_group(
    *,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    formation_timeout_s: float,
    master_store: Any = None,
    store_endpoint: Optional[Endpoint] = None,
) -> GroupConnections:
    """Join the process group as `rank`, replacing any group this process had before; what
    aborting it takes (`GroupConnections`; `store_endpoint`: where the rendezvous store is, as
    `store_endpoint()` finds it)."""
    import torch.distributed as dist

    destroy_process_group()
    if backend == "nccl":
        apply_nccl_env()
    if rank == 0:
        if master_store is None:
            raise RuntimeError("rank 0 must create the rendezvous store first (make_master_store)")
        store = master_store
    else:
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=formation_timeout_s),
        )
    listening = listening_endpoints()
    # Joining waits for every peer with the group's timeout: the short formation timeout, so that
    # a peer lost while the group forms releases the others soon; the collectives then get the
    # group's own.
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=min(timeout_s, formation_timeout_s)),
        )
        connections = GroupConnections.gather(backend, listening, store_endpoint)
    except BaseException:
        forget_failed_group()
        raise
    dist.group.WORLD.set_timeout(timedelta(seconds=timeout_s))
    return connections


def store_endpoint(host: str, port: int) -> Optional[Endpoint]:
    """Where the rendezvous store listens, as this process's connection to it names the far end
    (None when `host` does not resolve: the connection is then left to the store's bound)."""
    import socket

    try:
        return Endpoint(socket.gethostbyname(host), int(port))
    except OSError:
        return None


def forget_failed_group() -> None:
    """After a formation that failed (a peer lost while the group formed): let this process join
    the next group like a new one.

    torch names each group it forms in a process by a counter (the rendezvous keys start with
    it), which `destroy_process_group` resets; a group that failed to form has counted but cannot
    be destroyed, so this process would look for other keys than its new peers and never meet
    them. torch has no public call for this: the counter is reset here, and only here
    (`tests/core/test_failures.py` forms a group after a failed formation, and fails when torch
    changes this).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def destroy_process_group() -> bool:
    """Destroy this process's default group if there is one; return whether there was.

    With gloo this closes the worker's connections, which makes peers blocked in a collective with
    it fail at once ("Connection closed by peer"; measured: well under a second with torch 2.13),
    whereas `ProcessGroup.abort()` leaves them blocked until the process exits.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group may fail to tear down; it is dropped either way
        logger.debug("destroy_process_group failed", exc_info=True)
    return True
