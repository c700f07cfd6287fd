"""Options for a local Ray instance that hosts raysgd workers.

A worker's start is dominated by its process importing torch (about 1.5 s here), and a replacement
worker after a failure pays it again. Ray can import modules in its worker processes before they are
handed out (`preload_python_modules`, a raylet setting), so the processes Ray starts ahead of demand
already have torch loaded when an actor lands on them: measured here, an actor that imports torch
and builds an optimizer became ready in 0.1-0.2 s instead of 1.6-1.9 s. It only works for a Ray
instance started with it, so raysgd uses these options when it starts Ray itself; a cluster started
with `ray start` can pass the same setting with `--system-config`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WORKER_PRELOAD_MODULES", "local_ray_options"]

#: What every raysgd worker imports anyway. `torch._dynamo` is imported by the first
#: `torch.optim.Optimizer` a process builds (about 1 s of the operator's set-up otherwise).
WORKER_PRELOAD_MODULES: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo")


def local_ray_options(*, preload: bool = True) -> dict[str, Any]:
    """Keyword arguments for `ray.init(address="local", **local_ray_options())`.

    No dashboard and no metrics export (nothing reads them in an embedded cluster, and they take CPU
    from the workers on small machines); worker processes preload torch unless `preload=False`.
    Note that with preloading, environment variables read when torch is imported (such as
    `OMP_NUM_THREADS`) must be set before Ray starts, not through `WorkerGroup(env_vars=...)`.
    """
    system_config: dict[str, Any] = {"enable_metrics_collection": False}
    if preload:
        system_config["preload_python_modules"] = list(WORKER_PRELOAD_MODULES)
    return {"include_dashboard": False, "_system_config": system_config}
