"""Finding a worker process that stopped answering while the driver waits for it.

A process stopped by SIGSTOP, on a frozen node or behind a network partition keeps its
connections open: nothing fails, so no error reaches the driver, and every wait on it (a call's
result, a collective of its peers, a rendezvous, a point-to-point copy) lasts as long as that
wait's own bound, or forever where it has none. The collectives' bounds cannot tell a stopped
peer from a slow phase (a restore, a checkpoint, compiling), which is why theirs are long.

So whenever the driver waits for remote workers, it also probes each of them on a thread of the
actor's own (`actor.LIVENESS`), beside whatever call the worker is running: a live process
answers within milliseconds whatever its call is doing, a stopped one never does. A worker that
has answered no probe for `bound_s` is silent: the caller aborts its peers' collectives and
kills it. A probe goes out `every_s` after the last answer, so a call shorter than that sends
none, and a long one sends one per worker and `every_s`; the silent worker is found at most
`bound_s` after it stopped (or after the wait began, when it had stopped before).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

__all__ = ["PROBE_EVERY_S", "Liveness", "probes", "watch_while"]

#: The longest pause between a worker's answer and its next probe.
PROBE_EVERY_S = 2.0


class Liveness:
    """The probes of one wait on remote workers (`rank -> actor`); `bound_s` is how long a worker
    may leave them unanswered. Not thread-safe: one thread polls at a time."""

    def __init__(self, actors: Mapping[int, Any], bound_s: float) -> None:
        self.bound_s = float(bound_s)
        #: The pause between an answer and the next probe: a fifth of the bound, at most
        #: `PROBE_EVERY_S`, so that a live worker has most of the bound to answer one.
        self.every_s = max(0.05, min(PROBE_EVERY_S, self.bound_s / 5))
        self._actors = {rank: a for rank, a in actors.items() if a is not None}
        start = time.monotonic()
        self._answered = dict.fromkeys(self._actors, start)
        self._probes: dict[Any, int] = {}  # a probe in flight -> its rank
        self._in_flight: set[int] = set()
        #: Ranks found silent, in the order found, with the seconds since their last answer.
        self.silent: dict[int, float] = {}

    def poll(self, waiting_for: Iterable[int]) -> list[int]:
        """Take the probes' answers, probe the ranks of `waiting_for` that are due, and return
        those of them newly found silent."""
        import ray

        now = time.monotonic()
        if self._probes:
            done, _ = ray.wait(list(self._probes), num_returns=len(self._probes), timeout=0)
            for ref in done:
                rank = self._probes.pop(ref)
                self._in_flight.discard(rank)
                try:
                    ray.get(ref)
                except Exception:  # dead: the wait itself reports that, from its own ref
                    continue
                self._answered[rank] = now
        found = []
        for rank in waiting_for:
            if rank not in self._actors or rank in self.silent:
                continue
            quiet_s = now - self._answered[rank]
            if quiet_s > self.bound_s:
                self.silent[rank] = quiet_s
                found.append(rank)
            elif rank not in self._in_flight and quiet_s >= self.every_s:
                self._probes[self._actors[rank].alive.remote()] = rank
                self._in_flight.add(rank)
        return found


def probes(actors: Mapping[int, Any], bound_s: Optional[float]) -> Optional[Liveness]:
    """A `Liveness` of `actors` (the remote ones: local ranks have None) with `bound_s`; None
    when `bound_s` is None (no probes asked for)."""
    return None if bound_s is None else Liveness(actors, bound_s)


def watch_while(
    liveness: Optional[Liveness],
    waiting_for: Callable[[], Iterable[int]],
    on_silent: Callable[[list[int]], None],
) -> Callable[[], None]:
    """Poll `liveness` from a thread while this thread is busy (running the local rank's part of
    a call), calling `on_silent(ranks)` with the ranks it finds; returns the function that stops
    the thread (and waits for it). `waiting_for()` gives the ranks still running."""
    if liveness is None:
        return lambda: None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(liveness.every_s / 2):
            found = liveness.poll(waiting_for())
            if found:
                on_silent(found)

    thread = threading.Thread(target=run, name="raysgd-liveness", daemon=True)
    thread.start()

    def finish() -> None:
        stop.set()
        thread.join()

    return finish
