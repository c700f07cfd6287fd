"""The Ray actor that hosts one remote worker."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["WorkerActor"]


class WorkerActor:
    """One remote rank. Made a Ray actor class by `remote_worker_class()`."""

    def __init__(
        self, env_vars: Optional[dict[str, str]] = None, keep_freed_memory: bool = False
    ) -> None:
        # Before anything else: variables such as OMP_NUM_THREADS only count if set before torch
        # is imported.
        os.environ.update(env_vars or {})
        if keep_freed_memory:
            from raysgd_core._internal import host_memory

            host_memory.keep_freed_memory()
        from raysgd_core._internal.runtime import WorkerRuntime

        self._runtime = WorkerRuntime()
        # Pay torch's import now, while the other actors start in parallel, not on the first call.
        import torch.distributed  # noqa: F401

    def describe(self) -> dict:
        return self._runtime.describe()

    def open_store(self, world_size: int, formation_timeout_s: float) -> tuple[str, int]:
        return self._runtime.open_store(world_size, formation_timeout_s)

    def form(self, **kwargs: Any) -> str:
        return self._runtime.form(**kwargs)

    def destroy_process_group(self) -> bool:
        return self._runtime.destroy()

    def ping(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn`; a user exception comes back as a `Failure` value (see runtime.py)."""
        return self._runtime.run(fn, args, kwargs)

    def run_raising(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` for `execute_async`: a user exception is raised as a `WorkerError`."""
        from raysgd_core._internal.failures import failure_to_error
        from raysgd_core._internal.runtime import Failure

        result = self._runtime.run(fn, args, kwargs)
        if isinstance(result, Failure):
            raise failure_to_error(result)
        return result


_remote_class: list[Any] = []


def remote_worker_class() -> Any:
    """`ray.remote(WorkerActor)`, made once per process."""
    if not _remote_class:
        import ray

        # No retries: a worker that dies is reported and replaced by `recover`, never silently
        # restarted with its state lost.
        _remote_class.append(ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor))
    return _remote_class[0]
