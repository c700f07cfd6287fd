"""Growing the group back to the size asked for, when no worker is being lost: at the start of a
`train()` call (GROWING) when the cluster has room, and inside a call when spares are up (JOINING:
the workers stop together at a step boundary for them). The scaling policy sizes every grow; a
grow that started nobody makes later calls skip growing for a while (`decide.grow_backoff`), so
that a lasting shortage does not slow every call."""

from __future__ import annotations

import logging
import time
from typing import Any

from raysgd._internal.driver.decide import grow_backoff
from raysgd._internal.driver.events import EventKind, RecoveryLog
from raysgd._internal.driver.group_view import ElasticGroup, RestorableState
from raysgd._internal.driver.phases import Phase, PhaseWriter
from raysgd._internal.driver.policies import Policies
from raysgd._internal.driver.resize import Resizer
from raysgd_core import WorkerDiedError
from raysgd_fault import Action

__all__ = ["Growth"]


class Growth:
    """The grows of `group` (its `state` handed over before spares join) towards the size
    `policies` want; each resize by `resizer`, each phase entered through `run`."""

    def __init__(
        self,
        *,
        group: ElasticGroup,
        state: RestorableState,
        policies: Policies,
        resizer: Resizer,
        log: RecoveryLog,
        run: PhaseWriter,
    ) -> None:
        self._group = group
        self._state = state
        self._policies = policies
        self._resizer = resizer
        self._log = log
        self._run = run
        self._backoff_s = 0.0
        self._next_grow_at = 0.0
        self._join_declined = False  # the scaling policy kept the size at a join: until next call

    def joining(self) -> list[tuple[Any, ...]]:
        """While the group is below its size: for each spare, the refs that are all done once it
        is up (the workers stop at a step boundary for it to join: `join_spares`)."""
        if self._group.world_size >= self._policies.num_workers or self._join_declined:
            return []
        return self._group.spare_readiness()

    def join_spares(self) -> bool:
        """JOINING, at a step boundary inside a call, the group below its size: let the spares
        that are up join, as the scaling policy sizes the grow; the state of this boundary is
        first made restorable (`RestorableState.hand_over`: a sharded state is snapshotted, the
        joining workers take it, and nothing is redone). Returns whether the group grew. A spare
        lost while joining is one more loss; the group is then re-formed at its old size. A
        worker lost in the hand-over is counted and left to the next attempt, which recovers the
        group first."""
        current = self._group.world_size
        up = len(self._group.spares)
        if current >= self._policies.num_workers or not up:
            return False
        decision = self._policies.size("grow", running=current, fitting=up)
        if decision.num_workers <= current:
            # Not asked again in this call: the workers would otherwise stop at every look.
            self._join_declined = True
            return False
        try:
            self._state.hand_over(())
        except WorkerDiedError as err:
            self._run.note(lost=err, alive=current - len(err.ranks))
            return False
        self._grow_to(decision.num_workers, current)
        return self._group.world_size > current

    def maybe_grow(self) -> bool:
        """GROWING, at the start of a `train()` call: grow back towards the size wanted if the
        scaling policy says so. Returns True if the group grew (the new workers took the state
        of the others). A grow that fails is logged and the group is put back to its old size;
        neither fails the call."""
        self._run.enter(Phase.GROWING, new_count=True)  # a new train() call starts here
        self._join_declined = False
        current = self._group.world_size
        if current >= self._policies.num_workers or time.monotonic() < self._next_grow_at:
            return False
        if self._group.spares_starting:
            return False  # replacements on their way join at a step boundary (`join_spares`)
        fitting = self._policies.room(self._group)
        if fitting <= 0:
            return False  # nothing to ask the policy: the cheap check keeps train() fast
        decision = self._policies.size("grow", running=current, fitting=fitting)
        if decision.num_workers <= current:
            return False
        self._grow_to(decision.num_workers, current)
        if self._group.world_size > current:
            self._backoff_s = 0.0
            return True
        # The room the cluster reported was not real.
        self._backoff_s = grow_backoff(self._backoff_s)
        self._next_grow_at = time.monotonic() + self._backoff_s
        self._log.record(
            EventKind.DECISION,
            f"grow to {decision.num_workers} worker(s) started none; not trying again for "
            f"{self._backoff_s:g} s",
            level=logging.WARNING,
            action=Action.WAIT.value,
            duration_s=self._backoff_s,
            num_workers_before=current,
            num_workers_after=self._group.world_size,
        )
        return False

    def _grow_to(self, num_workers: int, current: int) -> None:
        if not self._resizer.resize(num_workers, "grow").ok:
            # A new worker failed while joining; the old members may have left their process
            # group already, so re-form at the old size. Should that fail too, the next attempt
            # sees a broken group and the failure path takes over.
            self._resizer.resize(max(1, current), "repair after a failed grow")
