"""The state of one worker process, shared by the Ray actor and the driver-local rank 0.

A user exception never escapes `WorkerRuntime.run`: it comes back as a `Failure` value, so the driver
can tell user errors from dead actors without unwrapping Ray's error types, and so the worker can
first abort its process group. That releases every peer that is waiting in a collective, for it or
for a peer that waits for it (see `abort.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from raysgd_core import context as _ctx
from raysgd_core._internal import process_group as _pg
from raysgd_core._internal.abort import Endpoint, GroupConnections, shut_down_connections_to

__all__ = ["Failure", "WorkerRuntime", "is_collateral", "is_peer_timeout"]

logger = logging.getLogger("raysgd_core")

# A collective that outlived its bound: the peer it waited for went silent (gloo's per-operation
# timeout; NCCL's watchdog).
_TIMEOUT_MARKERS = (
    "Timed out waiting",
    "Watchdog caught collective operation timeout",
    # The rendezvous store: a peer that never joined a forming group.
    "wait timeout after",
)

# Errors a rank gets because a *peer* failed; the peer's own failure is the one to report.
_COLLATERAL_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
    # The rendezvous store's connection, shut by an abort (a peer lost while a group forms).
    "Connection was likely closed",
    *_TIMEOUT_MARKERS,
)


def is_collateral(message: str) -> bool:
    """Whether an error message is a process-group failure caused by another rank."""
    return any(marker in message for marker in _COLLATERAL_MARKERS)


def is_peer_timeout(message: str) -> bool:
    """Whether an error message says a collective waited out its bound for a silent peer."""
    return any(marker in message for marker in _TIMEOUT_MARKERS)


@dataclass
class Failure:
    """An exception raised by user code on one worker, in a form that always pickles."""

    rank: int
    node_id: str
    type_name: str
    message: str
    traceback: str
    exception_bytes: Optional[bytes]
    collateral: bool
    time: float
    #: The rank waited out a collective's bound: some peer did not answer (see `is_peer_timeout`).
    peer_timeout: bool = False
    #: The group had been aborted when this rank failed (a peer failed first): collateral.
    after_abort: bool = False

    def exception(self) -> Optional[BaseException]:
        """The original exception, when it could be pickled and unpickled."""
        if self.exception_bytes is None:
            return None
        try:
            import ray.cloudpickle as cloudpickle

            return cloudpickle.loads(self.exception_bytes)
        except Exception:
            return None


class WorkerRuntime:
    """Per-process worker state: identity, the long-lived `store`, the current context."""

    def __init__(self) -> None:
        import ray

        runtime = ray.get_runtime_context()
        self.node_id: str = runtime.get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()
        self.pid = os.getpid()
        self.store: dict[str, Any] = {}
        self.context: Optional[_ctx.WorkerContext] = None
        self.rank = -1
        self._master_store: Any = None
        #: Counts the groups this process formed; an abort names the one it is meant for.
        self.generation = 0
        self._connections: Optional[GroupConnections] = None
        #: While a group forms: where its rendezvous store is (what an abort can end then).
        self._forming: Optional[Endpoint] = None
        self._aborted = False
        #: The process is ending (SIGTERM): the running call ends as the actor does.
        self.terminating = False
        # An abort arrives on another thread (the actor's control thread, the driver's collect);
        # it must not run while the group's connections are being set or dropped. While the
        # group forms it reaches only the rendezvous store's connection (`_forming`).
        self._lock = threading.Lock()

    def describe(self) -> dict:
        """Identity of this worker (answered once the actor is up)."""
        import ray

        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": self.pid,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if _in_actor() else [],
        }

    def open_store(self, world_size: int, formation_timeout_s: float) -> tuple[str, int]:
        """As the next rank 0: open the rendezvous store; return its (host, port)."""
        self._master_store = _pg.make_master_store(self.node_ip, world_size, formation_timeout_s)
        return self.node_ip, int(self._master_store.port)

    def form(
        self,
        *,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        timeout_s: float,
        formation_timeout_s: float,
        gpu_index: Optional[int],
        generation: int = 0,
    ) -> str:
        """Join a new process group (dropping the old one) as the group's `generation`; return
        the device as a string."""
        self.context = None
        self.rank = rank
        master, self._master_store = self._master_store, None
        store = _pg.store_endpoint(host, port)
        with self._lock:
            self._connections, self._aborted = None, False
            self.generation = generation
            # Until the group has formed, an abort can end only the waits in its rendezvous
            # store (a peer lost meanwhile never writes its address there).
            self._forming = store
        try:
            connections = _pg.form_process_group(
                backend=backend,
                host=host,
                port=port,
                rank=rank,
                world_size=world_size,
                timeout_s=timeout_s,
                formation_timeout_s=formation_timeout_s,
                master_store=master,
                store_endpoint=store,
            )
        except Exception as exc:
            if self._aborted:
                # Said so that the driver reads it as a peer's failure, not this rank's.
                raise RuntimeError(
                    f"Connection closed by peer: forming the group was aborted ({exc})"
                ) from exc
            raise
        finally:
            with self._lock:
                self._forming = None
        with self._lock:
            self._connections = connections
            if self._aborted:  # the abort came as the group formed: it must not be used
                connections.abort()
        device = _pg.select_device(gpu_index)
        self.context = _ctx.WorkerContext(
            world_rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_id=self.node_id,
            node_ip=self.node_ip,
            device=device,
            backend=backend,
            timeout_s=float(timeout_s),
            store=self.store,
            generation=generation,
        )
        if _in_actor():
            _ctx._process_default[0] = self.context
        return str(device)

    def destroy(self) -> bool:
        """Leave the process group (the context stays readable until the next `form`)."""
        with self._lock:
            self._connections = None
            return _pg.destroy_process_group()

    def reset(self) -> dict:
        """Ready this process for another group (it was kept, see `kept.py`): out of any
        process group, an empty store, no context. Returns `describe()`."""
        self.destroy()
        # What a framework kept here ends with the group it was made for (its threads above
        # all): a value with a close() is closed.
        for name, value in self.store.items():
            close = getattr(value, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.warning("closing the worker store's %r failed", name, exc_info=True)
        self.store = {}
        self.context = None
        self.rank = -1
        self._master_store = None
        if _in_actor():
            _ctx._process_default[0] = None
        return self.describe()

    def abort(self, generation: Optional[int] = None) -> bool:
        """Abort the process group's collectives (see `abort.py`): the ones waiting here raise
        at once, and so do the peers' that wait on this process. `generation`: only if the
        group is still that one (an abort that arrives after the group was re-formed is void).
        Whether there was a group to abort."""
        with self._lock:
            if generation not in (None, self.generation):
                return False
            if self._connections is None and self._forming is None:
                return False
            # Before the first wait is let out: the call it ends reads this to know why.
            self._aborted = True
            if self._connections is not None:
                shut = self._connections.abort()
            else:
                assert self._forming is not None
                shut = shut_down_connections_to(self._forming)
        logger.info("rank %d aborted its group's collectives (%d connections)", self.rank, shut)
        return True

    def terminate(self) -> None:
        """The process is ending: abort the group, and let the running call end the actor."""
        self.terminating = True
        self.abort()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call `fn` with this worker's context set; an exception comes back as a `Failure`."""
        token = _ctx._current.set(self.context)
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            after_abort = self._aborted
            # Peers may be blocked in a collective waiting for this rank, or for a peer that
            # waits for it: the abort releases them at once instead of after their bound (done
            # already when the group was aborted: this rank's failure is its consequence).
            if not after_abort:
                self.abort()
            self.destroy()
            # A SystemExit means this process is ending (a user's sys.exit()), and so does a
            # SIGTERM (the node shuts down: `terminate`). Returned as a Failure it would read as
            # user code raising, and a worker on its way out would be reported as an error
            # instead of a lost worker; let it end the actor so the caller sees the loss. An
            # interrupt ends only a local (non-actor) caller.
            if isinstance(exc, SystemExit) or (
                isinstance(exc, KeyboardInterrupt) and not _in_actor()
            ):
                raise
            if self.terminating:
                raise SystemExit(1) from exc
            return self._failure(exc, after_abort)
        finally:
            _ctx._current.reset(token)

    def _failure(self, exc: BaseException, after_abort: bool = False) -> Failure:
        import ray.cloudpickle as cloudpickle

        try:
            payload: Optional[bytes] = cloudpickle.dumps(exc)
            cloudpickle.loads(payload)  # an exception that pickles may still fail to unpickle
        except Exception:
            payload = None
        message = f"{type(exc).__name__}: {exc}"
        return Failure(
            rank=self.rank,
            node_id=self.node_id,
            type_name=type(exc).__qualname__,
            message=message,
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            exception_bytes=payload,
            collateral=after_abort or is_collateral(message),
            time=time.time(),
            peer_timeout=is_peer_timeout(message),
            after_abort=after_abort,
        )


def _in_actor() -> bool:
    import ray

    try:
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False
