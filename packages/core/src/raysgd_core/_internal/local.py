"""Rank 0 in the calling process (`use_local=True`).

A process can be in one `torch.distributed` default group at a time, so only one live local worker
is allowed per process; a second one gets a clear error instead of a corrupted group.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from raysgd_core._internal.runtime import WorkerRuntime, _in_actor

__all__ = ["LocalWorker"]

logger = logging.getLogger("raysgd_core")

_active: list[Optional[LocalWorker]] = [None]


class LocalWorker:
    """The calling process's rank 0 and the resources reserved for it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if _active[0] is not None and _active[0].outlived_its_cluster():
            # Ray was shut down (or restarted) under it without `shutdown()`, e.g. after a test
            # failed half-way: its workers are gone, so it holds nothing but this seat.
            _active[0].close_quietly()
        if _active[0] is not None:
            raise RuntimeError(
                "Another WorkerGroup with use_local=True is alive in this process; a process can "
                "hold only one torch.distributed group. Shut that group down first."
            )
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "This process already belongs to a torch.distributed process group; use_local=True "
                "needs the default group for itself. Destroy it or use use_local=False."
            )
        self.runtime = WorkerRuntime()
        self.gpu_index: Optional[int] = None
        self.reservation_pg: Any = None
        self._holder: Any = None
        self._node_id = _current_node_id()
        _active[0] = self

    def outlived_its_cluster(self) -> bool:
        """True when the Ray session this rank 0 was made in is gone (shut down or replaced)."""
        return self._node_id is None or _current_node_id() != self._node_id

    def close_quietly(self) -> None:
        """`close`, for a group whose cluster is gone: nothing left to free may raise."""
        try:
            self.close()
        except Exception:
            logger.debug("closing a local group whose cluster is gone", exc_info=True)
        if _active[0] is self:
            _active[0] = None

    def reserve(self, bundle: dict, timeout_s: float) -> Optional[Any]:
        """Reserve rank 0's share of the cluster on this node (a one-bundle placement group).

        Returns the placement group so the caller can wait for it together with the workers'.
        Skipped inside an actor (a Tune trial): its own resources are rank 0's share.
        """
        if _in_actor() or not bundle:
            return None
        from ray.util.placement_group import placement_group

        pinned = dict(bundle)
        # Keep the reservation on the driver's node: that is where rank 0 computes.
        pinned[f"node:{self.runtime.node_ip}"] = 0.001
        self.reservation_pg = placement_group([pinned], strategy="PACK")
        return self.reservation_pg

    def learn_gpu(self, num_gpus: float) -> None:
        """Pick rank 0's GPU: the one Ray gave this actor, or the one reserved for the driver."""
        import ray

        if not num_gpus:
            return
        if _in_actor():
            self.gpu_index = 0  # Ray set CUDA_VISIBLE_DEVICES for this actor
            return
        if self.reservation_pg is None:
            self.gpu_index = 0
            return
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        holder_cls = ray.remote(num_cpus=0, num_gpus=num_gpus)(_GpuHolder)
        self._holder = holder_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.reservation_pg, 0)
        ).remote()
        ids = ray.get(self._holder.gpu_ids.remote())
        self.gpu_index = int(ids[0])

    def forget_reservation(self) -> None:
        """Drop the handles of the reservation (Ray is gone and took it along)."""
        self.reservation_pg = self._holder = None

    def close(self) -> list[Any]:
        """Leave the process group, free the reservation, let another local group start.

        Returns the placement groups whose removal was asked for (see `wait_removed`)."""
        import ray

        removed = []
        self.runtime.destroy()
        if self._holder is not None:
            ray.kill(self._holder)
            self._holder = None
        if self.reservation_pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.reservation_pg)
                removed.append(self.reservation_pg)
            except Exception:
                logger.debug("removing the local reservation failed", exc_info=True)
            self.reservation_pg = None
        if _active[0] is self:
            _active[0] = None
        from raysgd_core import context as _ctx

        if (
            _ctx._process_default[0] is not None
            and _ctx._process_default[0] is self.runtime.context
        ):
            _ctx._process_default[0] = None
        return removed


def _current_node_id() -> Optional[str]:
    """This process's Ray node id, or None when Ray is not initialised."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


class _GpuHolder:
    """Holds the driver's GPU reservation and tells which GPU Ray picked."""

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()
