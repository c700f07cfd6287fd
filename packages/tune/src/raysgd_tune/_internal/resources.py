"""Resource requests for Tune trials that start their own workers.

A trial that starts Ray actors has to reserve room for them in its own placement group: Tune creates
the group from the trial's `PlacementGroupFactory` and, because it captures child tasks, every actor
the trial starts lands in it. Bundle 0 belongs to the trial process itself; the workers take the rest.
"""

from __future__ import annotations

from ray.tune import PlacementGroupFactory

from raysgd_base import check_int
from raysgd_core import GroupOptions

__all__ = ["worker_bundles_request"]


def worker_bundles_request(
    *,
    num_workers: int,
    group: GroupOptions,
    head_bundle: dict[str, float] | None,
    workers_per_bundle: int = 1,
    placement_strategy: str = "PACK",
) -> PlacementGroupFactory:
    """One bundle for the trial process (`head_bundle`; empty or None: it needs nothing) and one per
    `workers_per_bundle` workers, plus one per spare worker (`group.spare_workers`: always a remote
    actor of its own, which a trial must reserve too or its spares would wait forever).

    A worker's share is `group`'s `num_cpus_per_worker` and `num_gpus_per_worker`, already checked
    by `GroupOptions`. An empty head bundle is dropped by Tune, which shifts the worker bundles'
    indexes down by one; raysgd's workers never name a bundle index (they ask for "any bundle with
    room"), so that shift does not matter to them. With `group.use_local`, rank 0 lives in the
    trial process: the first worker bundle becomes the trial's own and `head_bundle` is ignored.
    """
    check_int("num_workers", num_workers)
    bundle = {
        "CPU": group.num_cpus_per_worker * workers_per_bundle,
        "GPU": group.num_gpus_per_worker * workers_per_bundle,
    }
    worker_bundles = [dict(bundle) for _ in range(num_workers // workers_per_bundle)]
    one_worker = {key: amount / workers_per_bundle for key, amount in bundle.items()}
    worker_bundles += [dict(one_worker) for _ in range(group.spare_workers)]
    if group.use_local:
        return PlacementGroupFactory(worker_bundles, strategy=placement_strategy)
    return PlacementGroupFactory(
        [dict(head_bundle or {}), *worker_bundles], strategy=placement_strategy
    )
