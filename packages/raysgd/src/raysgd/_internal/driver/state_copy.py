"""The driver's bounded copy of a replicated training state, for the day every worker is lost.

The state lives on the workers; a copy on the driver only matters when all of them die at once
(one node carried them all). RaySGD always kept one, which costs the driver memory and every call a
transfer that grow with the model. Here the copy is bounded twice:

- in size: only a state of at most `limit_bytes` is copied (the default, 64 MiB, holds a model of
  about five million parameters with Adam); a larger one relies on checkpoints;
- in time: a copy is taken after a `train()` call, asynchronously (rank 0 serialises it before its
  next call, and a driver thread fetches it), and only when the training time since the last copy
  is at least ``1 / max_share`` times what the last copy cost rank 0, so copying never takes more
  than `max_share` of the training time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

__all__ = ["DEFAULT_LIMIT_MB", "DriverCopy"]

logger = logging.getLogger("raysgd")

#: Default `TorchTrainer(state_copy_limit_mb=...)`.
DEFAULT_LIMIT_MB = 64.0


class DriverCopy:
    """The latest copy (bytes and the step it is at) and the rules for refreshing it."""

    def __init__(self, limit_bytes: int, *, max_share: float = 0.02) -> None:
        self.limit_bytes = int(limit_bytes)
        self.max_share = float(max_share)
        self._lock = threading.Lock()
        self._data: Optional[bytes] = None
        self._step = -1
        self._size: Optional[int] = None  # the state's size when last measured
        self._cost_s = 0.0  # what the last copy cost rank 0
        self._taken_at = time.monotonic()
        self._pending: Optional[threading.Thread] = None

    @property
    def enabled(self) -> bool:
        """Whether copies are kept at all (a limit of 0 turns them off)."""
        return self.limit_bytes > 0

    def offer(self, data: Optional[bytes], size: int, step: int, cost_s: float = 0.0) -> None:
        """Take a copy made elsewhere (at start-up, after a load): `data` None when too large."""
        with self._lock:
            self._size, self._cost_s = int(size), float(cost_s)
            if data is not None and step >= self._step:
                self._data, self._step = data, int(step)
            elif data is None:
                # The state outgrew the limit: an older copy would only mislead a restore.
                self._data, self._step = None, -1
            self._taken_at = time.monotonic()

    def forget(self) -> None:
        """Drop the copy: the state was replaced as a whole (a load), and a copy of the state
        before it, of a later step when the load went back, must never be restored. A fetch in
        flight is of that state too: it is let finish first."""
        self.wait()
        with self._lock:
            self._data, self._step = None, -1

    def latest(self) -> Optional[tuple[bytes, int]]:
        """(bytes, step) of the newest copy fetched, or None."""
        with self._lock:
            return None if self._data is None else (self._data, self._step)

    def due(self) -> bool:
        """Whether a refresh now keeps copying within its size and time budget."""
        if not self.enabled or (self._pending is not None and self._pending.is_alive()):
            return False
        if self._size is not None and self._size > self.limit_bytes:
            return False
        return time.monotonic() - self._taken_at >= self._cost_s / self.max_share

    def refresh(self, ref: Any) -> None:
        """Fetch the result of `worker.state_copy` behind `ref` in a driver thread."""
        self._taken_at = time.monotonic()

        def fetch() -> None:
            import ray

            try:
                data, size, step, cost_s = ray.get(ref)
            except Exception:  # the worker died meanwhile: the recovery has other sources
                logger.debug("the driver's state copy could not be fetched", exc_info=True)
                return
            self.offer(data, size, step, cost_s)

        self._pending = threading.Thread(target=fetch, name="raysgd-state-copy", daemon=True)
        self._pending.start()

    def wait(self, timeout_s: float = 30.0) -> None:
        """Let a fetch in flight finish (before relying on `latest`)."""
        pending = self._pending
        if pending is not None:
            pending.join(timeout_s)
