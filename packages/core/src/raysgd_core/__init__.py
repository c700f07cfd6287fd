"""raysgd-core: a Ray worker pool with a ready `torch.distributed` process group.

`WorkerGroup(n).start()` places n Ray actors with a placement group, forms a process group over them
(gloo, or nccl with GPUs) and runs functions on every rank with `execute`. Failures are typed
(`WorkerDiedError`, `WorkerError`) and `recover` replaces lost workers while keeping the healthy ones.
Nothing here knows about models or training; this package imports no other raysgd package.
"""

from raysgd_core.collectives import set_collective_timeout
from raysgd_core.context import WorkerContext, get_context
from raysgd_core.drains import draining_nodes, preempted_nodes
from raysgd_core.errors import (
    ResourcesUnavailableError,
    WorkerDiedError,
    WorkerError,
    WorkerGroupError,
)
from raysgd_core.gpu import require_cluster_gpus, resolve_use_gpu
from raysgd_core.group import WorkerGroup
from raysgd_core.info import RecoveryReport, WorkerInfo
from raysgd_core.kept import KEEP_WORKERS_ENV, release_kept_workers
from raysgd_core.options import (
    DEFAULT_PEER_GRACE_S,
    GroupOptions,
    resolve_backend,
    resolve_timeout,
)
from raysgd_core.ray_options import WORKER_PRELOAD_MODULES, ensure_ray, local_ray_options
from raysgd_core.scratch import scratch_dir
from raysgd_core.shipping import ship_by_value, shipped_by_value

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_PEER_GRACE_S",
    "KEEP_WORKERS_ENV",
    "WORKER_PRELOAD_MODULES",
    "GroupOptions",
    "RecoveryReport",
    "ResourcesUnavailableError",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerInfo",
    "__version__",
    "draining_nodes",
    "ensure_ray",
    "get_context",
    "local_ray_options",
    "preempted_nodes",
    "release_kept_workers",
    "require_cluster_gpus",
    "resolve_backend",
    "resolve_timeout",
    "resolve_use_gpu",
    "scratch_dir",
    "set_collective_timeout",
    "ship_by_value",
    "shipped_by_value",
]
