"""Starting (or joining) Ray, and the options of a local instance that hosts raysgd workers.

No dashboard and no metrics export: nothing reads them in an embedded cluster, and they take CPU from
the workers on small machines.

Optionally (`preload=True`), Ray's worker processes import torch before they are handed out
(`preload_python_modules`, a raylet setting), so an actor that lands on a process Ray started ahead
of demand skips the torch import. It is off by default: a replacement worker usually gets a fresh
process anyway (Ray keeps few idle ones), the start-up, recovery and throughput benchmarks did not
gain from it (BENCHMARKS.md has the figures), and it changes what every worker process of the
instance imports.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["WORKER_PRELOAD_MODULES", "ensure_ray", "local_ray_options"]

logger = logging.getLogger("raysgd")

#: What every raysgd worker imports anyway. `torch._dynamo` is imported by the first
#: `torch.optim.Optimizer` a process builds (about 1 s of the operator's set-up otherwise).
WORKER_PRELOAD_MODULES: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo")


def local_ray_options(*, preload: bool = False) -> dict[str, Any]:
    """Keyword arguments for `ray.init(address="local", **local_ray_options())`.

    With `preload=True` worker processes import torch before they are handed out; environment
    variables read when torch is imported (such as `OMP_NUM_THREADS`) must then be set before Ray
    starts, not through `WorkerGroup(env_vars=...)`.
    """
    system_config: dict[str, Any] = {"enable_metrics_collection": False}
    if preload:
        system_config["preload_python_modules"] = list(WORKER_PRELOAD_MODULES)
    return {"include_dashboard": False, "_system_config": system_config}


def ensure_ray(*, log_to_driver: bool = True) -> bool:
    """Start a local Ray instance unless one is initialised; True when this call started it.

    `RAY_ADDRESS` (set by `ray job submit`, or by a user who means a cluster) is joined. Otherwise
    the instance is always a new local one (`address="local"`): a plain `ray.init()` would silently
    join whatever cluster another process started on this machine, which is not what an embedded
    default means. Call `ray.init(address="auto")` first to join a running cluster instead.
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        logger.info("Ray is not initialised: joining RAY_ADDRESS=%s", os.environ["RAY_ADDRESS"])
        ray.init(log_to_driver=log_to_driver)
        return True
    logger.info(
        "Ray is not initialised: starting a local instance (call ray.init first to join a cluster)"
    )
    ray.init(address="local", log_to_driver=log_to_driver, **local_ray_options())
    return True
