"""Where a worker is in training, counted in finished steps: what recovery chooses a source by.

A step is one batch of the training loop, finished when the loop comes back for the next batch (or
its call returns). Every worker counts them the same way, so after a lost worker the survivors
compare their counts, the one furthest along (and not torn, see `Progress.clean`) gives its state
to the others, and the interrupted `train()` call goes on from there (`CallRecord`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any, Optional

__all__ = ["CallRecord", "Progress"]


@dataclass(frozen=True)
class Progress:
    """One worker's answer to "how far did you get?", asked after a failure.

    Attributes:
        step: The step the worker can go on from: the start of the accumulation window it was
            in (its last finished step without accumulation), to which it went back. Counted
            since training began, over every call (a loaded state sets it).
        epoch: The epoch that step is in.
        clean: The worker's state is that of `step`: no optimizer of the batch it was in the
            middle of has stepped, or those steps were rolled back. A worker that is not clean is
            never the source of a restore.
        in_batch: The worker was in the middle of a batch when its call stopped.
        call: The `train()` call it was in, or last finished, as of `step`.
        finished_at: When its last step finished (`time.time()`), None before the first.
        reached: The steps it had started (finished, plus the one it was in): those from `step`
            on are done again. None: `step`, plus the batch it was in.
        interleaved: A validation ran after the window's start, which a redo of the window
            follows instead of preceding: the random numbers it drew come in another order.
        validated_at: The step of the last window start a validation ran at, since the worker
            last loaded a state (None: none did): what it drew belongs to the state from there
            on, so a restore to an earlier step goes on without it.
    """

    step: int
    epoch: int
    clean: bool
    in_batch: bool
    call: Optional[CallRecord] = None
    finished_at: Optional[float] = None
    reached: Optional[int] = None
    interleaved: bool = False
    validated_at: Optional[int] = None


@dataclass(frozen=True)
class CallRecord:
    """One `train()` call as a worker saw it; a call interrupted by a failure goes on from here.

    Attributes:
        call_id: What the trainer named the call (the same on every worker).
        num_steps: Steps asked for (None: the rest of the epoch `epoch`).
        start_step: `Progress.step` when the call began.
        steps: Steps of the call finished so far (by the whole group: the same on every worker).
            Negative after a restore from a snapshot older than the call: the steps before the
            call that are done again first.
        rows: Rows the whole group trained in the call's own steps, when the loader's split is
            known: raysgd's own sampler, or a dataset shard without a `collate_fn` (None
            otherwise, e.g. with the user's own sampler).
        epoch: The epoch a call without `num_steps` finishes (None until its first batch).
        finished: The call returned on this worker.
        recovered: The call went on after a failure (its metrics then cover the steps since it
            began, including those finished before the failure by workers that survived it).
        loop_s: Seconds the training loop ran for the call's own steps up to `steps` (see
            `raysgd_operator.throughput`): a record a recovery goes back to holds the time of
            the steps it kept, so that the call's rate covers those steps once.

    A step's `batch_idx` is its place in its call: `steps` before it, 0 for the call's first.
    """

    call_id: Hashable
    num_steps: Optional[int]
    start_step: int
    steps: int = 0
    rows: Optional[int] = 0
    epoch: Optional[int] = None
    finished: bool = False
    recovered: bool = False
    loop_s: float = 0.0

    def remaining(self) -> Optional[int]:
        """Steps still to take (None: to the end of `epoch`)."""
        if self.num_steps is None:
            return None
        return max(0, self.num_steps - self.steps)

    def after_step(self, rows: Optional[int], loop_s: float = 0.0) -> CallRecord:
        """The record once one more step, of `rows` rows (None: unknown), is finished, the
        call's loop having run `loop_s` seconds for its own steps."""
        total: Any = self.rows
        if self.steps >= 0:  # a step of the call itself (not one redone from before it)
            total = None if rows is None or self.rows is None else self.rows + rows
        return replace(self, steps=self.steps + 1, rows=total, loop_s=loop_s)

    def same_call(self, other: CallRecord) -> bool:
        """Whether `other` is a record of this same call (at another step)."""
        return (self.call_id, self.start_step) == (other.call_id, other.start_step)

    def resumed_at(self, step: int, rows: Optional[int] = 0, loop_s: float = 0.0) -> CallRecord:
        """This call going on from a state at `step` (`rows`: the call's rows up to there;
        `loop_s`: the seconds its loop ran for them)."""
        own = step >= self.start_step
        return replace(
            self,
            steps=step - self.start_step,
            rows=rows if own else 0,
            finished=False,
            recovered=True,
            loop_s=loop_s if own else 0.0,
        )
