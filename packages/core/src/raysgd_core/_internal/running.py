"""What a `WorkerGroup` runs (`GroupSpec`) kept apart from what runs now (`RunningGroup`).

`WorkerGroup` is the public face; starting, recovering and stopping all work on one `RunningGroup`,
so that `recover.py` needs neither the group class nor its private fields.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from raysgd_core._internal.liveness import Liveness, Wait
from raysgd_core._internal.local import LocalWorker
from raysgd_core._internal.placement import SeatPool, make_bundle
from raysgd_core._internal.workers import (
    ActorSpec,
    Worker,
    abort_workers,
    form_group,
    kill_worker,
)
from raysgd_core.options import GroupOptions

__all__ = ["FORMATION_TIMEOUT_S", "GroupSpec", "RunningGroup"]

#: Numbers the process groups this driver forms, across all its groups: a kept worker (see
#: `kept.py`) must never see a group's number twice, or it would take what it cached for its old
#: group (a `DeviceMesh` named by the number) for the new one's.
_GENERATIONS = itertools.count(1)

#: The longest the rendezvous of a new process group may take (see `GroupSpec.formation_timeout_s`).
FORMATION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GroupSpec:
    """What every worker of a group is started with; fixed when the group is built."""

    options: GroupOptions
    #: How one remote worker is started (from `options`).
    actor: ActorSpec
    #: The placement-group bundle one worker takes (from `options`).
    bundle: dict
    #: The process group's backend, "auto" resolved (`GroupOptions.process_group_backend`).
    backend: str

    @classmethod
    def from_options(cls, options: GroupOptions) -> GroupSpec:
        """The spec of a group built with `options`."""
        return cls(
            options=options,
            actor=ActorSpec(
                num_cpus=options.num_cpus_per_worker,
                num_gpus=options.num_gpus_per_worker,
                resources=dict(options.resources_per_worker or {}),
                env_vars=dict(options.env_vars or {}),
                init_hook=options.init_hook,
                keep_freed_memory=options.keep_freed_memory,
            ),
            bundle=make_bundle(
                options.num_cpus_per_worker,
                options.num_gpus_per_worker,
                options.resources_per_worker,
            ),
            backend=options.process_group_backend,
        )

    @property
    def formation_timeout_s(self) -> float:
        """How long forming the process group may take (joining ranks wait this long). The
        workers are up by then: only the rendezvous is left, which takes well under a second; a
        rank lost meanwhile leaves the others waiting this long before they can be re-formed."""
        return min(self.options.start_timeout_s, FORMATION_TIMEOUT_S)


@dataclass(eq=False)
class RunningGroup:
    """The running part of a group: its workers in rank order, their seats and its health."""

    spec: GroupSpec
    workers: list[Worker] = field(default_factory=list)
    pool: Optional[SeatPool] = None
    local: Optional[LocalWorker] = None
    #: The process group is unusable (a worker raised or died) until it is re-formed.
    broken: bool = False
    #: Started (or starting) workers outside the process group (see `spares.py`).
    spares: list[Worker] = field(default_factory=list)
    #: Names the current process group (see `abort_workers`); unique among this driver's groups.
    generation: int = 0
    #: The driver's probes of the remote workers, kept from wait to wait (None: the options ask
    #: for none; see `liveness.py`).
    probes: Optional[Liveness] = None

    def __post_init__(self) -> None:
        bound = self.spec.options.liveness_timeout_s
        if self.probes is None and bound is not None:
            self.probes = Liveness(bound)

    @property
    def world_size(self) -> int:
        """Ranks in the current process group (the live size)."""
        return len(self.workers)

    def form(self) -> None:
        """Form a new process group over `workers` (rank = position); the group is usable again."""
        self.generation = next(_GENERATIONS)
        form_group(
            self.workers,
            backend=self.spec.backend,
            timeout_s=self.spec.options.timeout_s,
            formation_timeout_s=self.spec.formation_timeout_s,
            remote_gpu_index=0 if self.spec.actor.num_gpus else None,
            generation=self.generation,
            liveness=self.probes,
        )
        self.broken = False

    def abort(self, ranks: list[int]) -> None:
        """Abort the current group's collectives on the workers of `ranks` (a peer failed: they
        are let out of the collectives that wait for it), the local rank's included."""
        chosen = [self.workers[r] for r in ranks if r < len(self.workers)]
        abort_workers(chosen, self.generation)
        if self.local is not None and any(w.local is not None for w in chosen):
            self.local.runtime.abort(self.generation)

    def liveness(self, workers: Optional[dict[int, Worker]] = None) -> Optional[Wait]:
        """The probes of one wait on the remote workers among `workers` (by the number the wait
        knows each by; default: the group's, by rank); None when the options ask for none."""
        if self.probes is None:
            return None
        if workers is None:
            workers = {w.rank: w for w in self.workers}
        return self.probes.wait({key: w.actor for key, w in workers.items()})

    def drop(self, worker: Worker, *, unresponsive: bool = False) -> None:
        """Kill a remote worker and give its seat back (the local rank is never killed); the
        seat of a worker killed for not answering (`unresponsive`: silent, or stuck past a
        grace) is not used again but removed at once, which is what takes a stopped process:
        Ray's kill asks the process to exit, which a stopped one never does, while the removal
        of its placement group has the raylet kill whatever runs in it."""
        kill_worker(worker, unresponsive=unresponsive)
        if self.probes is not None and worker.actor is not None:
            self.probes.forget([worker.actor])
        if worker.seat is not None and self.pool is not None:
            self.pool.release(worker.seat, reuse=not worker.unresponsive)
            worker.seat = None
