"""Finding a worker process that stopped answering while the driver waits for it.

A process stopped by SIGSTOP, on a frozen node or behind a network partition keeps its
connections open: nothing fails, so no error reaches the driver, and every wait on it (a call's
result, a collective of its peers, a rendezvous, a point-to-point copy) lasts as long as that
wait's own bound, or forever where it has none. The collectives' bounds cannot tell a stopped
peer from a slow phase (a restore, a checkpoint, compiling), which is why theirs are long.

So whenever the driver waits for remote workers, it also probes each of them on a thread of the
actor's own (`actor.LIVENESS`), beside whatever call the worker is running: a live process
answers within milliseconds whatever its call is doing, a stopped one never does. Each worker gets
one probe every `every_s` (a tenth of the bound, at most `PROBE_EVERY_S`), the next one once the
last has been answered; the wait polls twice a cadence. A worker whose probe has gone unanswered
for its patience is silent: the caller aborts its peers' collectives and kills it.

The patience is the bound less three cadences, so that a stopped worker is found and killed
within `bound_s` of stopping: it answered its last probe after that probe was sent, so the next
one leaves at most a cadence and a poll later; it is seen unanswered at most a poll after the
patience; and one cadence is left for the kill to take the process. The probes of a group are one
`Liveness`, kept from wait to wait: a worker stopped during a series of short calls is found as
soon as one probe of it has gone unanswered that long (or within the bound of the first wait that
needs it, when it had stopped while nothing waited for it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["PROBE_EVERY_S", "Liveness", "Wait", "watch_while"]

#: The longest time between two probes of a worker.
PROBE_EVERY_S = 1.0
#: What is known of a worker no wait asked about for this long is dropped.
_FORGET_AFTER_S = 600.0


@dataclass
class _Probed:
    """What is known of one worker's answers (it holds the actor's handle, so that the handle's
    `id`, its key, is not reused while it is known)."""

    actor: Any
    answered: float = float("-inf")
    #: The probe in flight (None once answered), and when the last probe was sent.
    ref: Any = None
    sent: float = float("-inf")


class Liveness:
    """The probes of a group's remote workers, kept across waits; `bound_s` is how long a
    worker may be stopped before it is found (see the module docstring). Thread-safe."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = float(bound_s)
        #: The cadence of a worker's probes: a tenth of the bound, at most `PROBE_EVERY_S`.
        self.every_s = max(0.05, min(PROBE_EVERY_S, self.bound_s / 10))
        #: How long a probe may go unanswered (see the module docstring): 70% of the bound up to
        #: 10 s, the bound less 3 s beyond.
        self.patience_s = self.bound_s - 3 * self.every_s
        self._probed: dict[int, _Probed] = {}  # id(actor handle) -> what is known
        self._lock = threading.Lock()

    def wait(self, actors: Mapping[int, Any]) -> Wait:
        """The probes of one wait for the remote workers `actors` (rank -> actor handle; None
        for a local rank, which is never probed)."""
        return Wait(self, {rank: a for rank, a in actors.items() if a is not None})

    def _poll(self, actors: Mapping[int, Any]) -> list[int]:
        """Take the answers, probe the workers of `actors` that are due, and return the ranks of
        those whose probe went unanswered past the patience."""
        import ray

        with self._lock:
            now = time.monotonic()
            flying = {p.ref: p for p in self._probed.values() if p.ref is not None}
            if flying:
                done, _ = ray.wait(list(flying), num_returns=len(flying), timeout=0)
                for ref in done:
                    probed = flying[ref]
                    probed.ref = None
                    try:
                        ray.get(ref)
                    except Exception:  # dead: the wait itself reports that, from its own ref
                        continue
                    probed.answered = now
            silent = []
            for rank, actor in actors.items():
                probed = self._probed.setdefault(id(actor), _Probed(actor))
                if probed.ref is not None:
                    if now - probed.sent > self.patience_s:
                        silent.append(rank)
                elif now - probed.sent >= self.every_s:
                    probed.ref, probed.sent = actor.alive.remote(), now
            # Workers no wait asked about for a long while are gone (dropped elsewhere).
            asked = {id(actor) for actor in actors.values()}
            for key, probed in list(self._probed.items()):
                idle = now - max(probed.answered, probed.sent)
                if key not in asked and probed.ref is None and idle > _FORGET_AFTER_S:
                    del self._probed[key]
            return silent

    def forget(self, actors: Iterable[Any]) -> None:
        """Drop what is known of `actors` (killed, released: their handles may be reused)."""
        with self._lock:
            for actor in actors:
                self._probed.pop(id(actor), None)


class Wait:
    """The probes of one wait (`Liveness.wait`): the ranks found silent so far, by rank, with the
    seconds their probe had gone unanswered."""

    def __init__(self, liveness: Liveness, actors: Mapping[int, Any]) -> None:
        self.liveness, self.every_s = liveness, liveness.every_s
        self._actors = dict(actors)
        self.silent: dict[int, float] = {}

    def poll(self, waiting_for: Iterable[int]) -> list[int]:
        """Probe the ranks of `waiting_for` that are due; those newly found silent."""
        ranks = set(waiting_for)
        actors = {r: a for r, a in self._actors.items() if r in ranks and r not in self.silent}
        found = self.liveness._poll(actors)
        for rank in found:
            self.silent[rank] = self.liveness.bound_s
        return found


def watch_while(
    wait: Optional[Wait],
    waiting_for: Callable[[], Iterable[int]],
    on_silent: Callable[[list[int]], None],
) -> Callable[[], None]:
    """Poll `wait` from a thread while this thread is busy (running the local rank's part of a
    call), calling `on_silent(ranks)` with the ranks it finds; returns the function that stops
    the thread (and waits for it). `waiting_for()` gives the ranks still running."""
    if wait is None:
        return lambda: None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(wait.every_s / 2):
            found = wait.poll(waiting_for())
            if found:
                on_silent(found)

    thread = threading.Thread(target=run, name="raysgd-liveness", daemon=True)
    thread.start()

    def finish() -> None:
        stop.set()
        thread.join()

    return finish
