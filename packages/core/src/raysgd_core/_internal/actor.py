"""The Ray actor that hosts one remote worker."""

from __future__ import annotations

import os
import signal
import threading
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
        from raysgd_core.scratch import sweep_scratch

        self._runtime = WorkerRuntime()
        # What workers killed on this node before left behind (they could not remove it): in a
        # thread of its own, so that a large folder's removal does not delay this worker's start.
        threading.Thread(target=sweep_scratch, name="raysgd-scratch-sweep", daemon=True).start()
        self._chain_sigterm()
        # Pay torch's import now, while the other actors start in parallel, not on the first call.
        import torch.distributed  # noqa: F401

    def _chain_sigterm(self) -> None:
        """On SIGTERM (the node shuts down, a pod is deleted), end the running call too.

        Calls run on a thread of their own (see `remote_worker_class`), so Ray's handler, which
        raises SystemExit on the main thread, would let a call blocked in a collective run on
        until the process ends. The runtime aborts the group first: the call raises at once and
        ends the actor (`WorkerRuntime.run`), and its peers are let out of their collectives."""
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self._runtime.terminate()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def describe(self) -> dict:
        return self._runtime.describe()

    def open_store(self, world_size: int, formation_timeout_s: float) -> tuple[str, int]:
        return self._runtime.open_store(world_size, formation_timeout_s)

    def form(self, **kwargs: Any) -> str:
        return self._runtime.form(**kwargs)

    def destroy_process_group(self) -> bool:
        return self._runtime.destroy()

    def abort(self, generation: int) -> bool:
        """Abort the collectives of the group `generation` (see `abort.py`). Runs on the actor's
        control thread, beside a call that may be blocked in one of them."""
        return self._runtime.abort(generation)

    def reset(self) -> dict:
        """Ready this kept process for another group; its `describe()`."""
        return self._runtime.reset()

    def ping(self) -> int:
        return os.getpid()

    def alive(self) -> int:
        """Answer a liveness probe (see `liveness.py`). Runs on a thread of its own, beside a
        call and an abort, so that only a process that is stopped (or a node that is frozen or
        cut off) leaves it unanswered."""
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


#: The actor's second thread: calls that must run while a call of the default thread is blocked.
CONTROL = "control"
#: The actor's third thread: liveness probes, answered whatever the other two are doing.
LIVENESS = "liveness"

_remote_class: list[Any] = []


def remote_worker_class() -> Any:
    """`ray.remote(WorkerActor)`, made once per process."""
    if not _remote_class:
        import ray

        # `abort` on a thread of its own; every other call runs on the one default thread, in
        # the order it was sent (a sync actor with one default thread keeps that order).
        ray.method(concurrency_group=CONTROL)(WorkerActor.abort)
        ray.method(concurrency_group=LIVENESS)(WorkerActor.alive)
        # No retries: a worker that dies is reported and replaced by `recover`, never silently
        # restarted with its state lost.
        _remote_class.append(
            ray.remote(
                max_restarts=0, max_task_retries=0, concurrency_groups={CONTROL: 1, LIVENESS: 1}
            )(WorkerActor)
        )
    return _remote_class[0]
