"""`RunPosition`: where one worker's training is, and the way back to its window's start.

The runner's loop moves it forward (a pass begins, a step finishes, a validation runs); a
failure moves it back (`progress`: to the start of the accumulation window in progress, see
`raysgd_operator._internal.window`); a recovery or a load moves it to where the group goes on
(`adopt`, `adopt_snapshot`, `restore`). The state saved and loaded (`state_io`) reads and sets
it; nothing else does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

from raysgd_operator._internal.rng import rng_state
from raysgd_operator._internal.step_journal import StepJournal
from raysgd_operator._internal.stream import BatchStream, PassSeed
from raysgd_operator._internal.tensors import same_device_copy
from raysgd_operator._internal.window import RankSlot, WindowStart
from raysgd_operator.components import Components
from raysgd_operator.metrics import AverageMeterCollection
from raysgd_operator.operator import TrainingOperator
from raysgd_operator.progress import CallRecord, Progress

__all__ = ["RunPosition", "has_rank_state"]


def has_rank_state(operator: TrainingOperator) -> bool:
    """Whether `operator` keeps a per-rank state (overrides `rank_state_dict`); the same on every
    worker."""
    return type(operator).rank_state_dict is not TrainingOperator.rank_state_dict


class RunPosition:
    """One worker's counters, its place in the epoch, the `train()` call it is in with the call's
    metrics, and the start of the accumulation window in progress (`WindowStart`) with the one
    before it.

    `before_step` is called just before each optimizer step (the step journal calls it).
    """

    def __init__(
        self,
        components: Components,
        operator: TrainingOperator,
        train: BatchStream,
        validation: BatchStream,
        before_step: Callable[[], None],
    ) -> None:
        self._parts, self._operator = components, operator
        self._train, self._val = train, validation
        self._before_step = before_step
        self.rank_state = has_rank_state(operator)
        self.epoch = 0
        #: Steps finished since training began (see `progress`).
        self.step = 0
        #: The furthest step trained. A recovery or a load that goes back to the start of a
        #: window leaves `step` behind it: the steps up to it belong to calls already made, and
        #: the next call does them again before its own.
        self.trained_to = 0
        #: The last epoch whose end a loop acted on (`end_of_epoch_due`): like the schedulers it
        #: steps, it is not taken back when a window is done again.
        self.epoch_ended = 0
        #: `RankSlot.counted` of the rank slot loaded last (`count_on`).
        self.slot_counted: Optional[tuple[Any, int, float, int]] = None
        #: The `train_epoch` call this worker is in or last finished, and its metrics.
        self.call: CallRecord | None = None
        self.meters: AverageMeterCollection | None = None
        self.finished_at: float | None = None
        self._window_start_hooks: list[Callable[[], None]] = []
        self.journal = StepJournal(components.optimizers, components.models, before_step)
        #: Validation calls since the window start, and the step of the last window start one
        #: ran at since the last load (see `progress`).
        self._validations_in_window = 0
        self._validated_at: Optional[int] = None
        self.window = self.mark_window_start()
        #: The start of the window before the one in progress: a worker that finished a window
        #: its peers did not (a collective that ended here but failed on them) goes back to it.
        self.window_before: WindowStart | None = None

    # -- forward -------------------------------------------------------------------------------
    def end_of_epoch_due(self, epoch: int | None) -> bool:
        """The training loop reached `epoch`'s last batch: True the first time only."""
        epoch = self.epoch if epoch is None else epoch
        if epoch <= self.epoch_ended:
            return False
        self.epoch_ended = epoch
        return True

    def pass_started(self, resuming: bool) -> int:
        """A training pass begins: a new one is a new epoch."""
        if not resuming:
            self.epoch += 1
        return self.epoch

    def step_finished(self, rows: int | None, loop_s: float) -> None:
        """A training batch is finished; `loop_s` is the call's loop time so far (0 for a step
        redone from before the call)."""
        self.step += 1
        self.trained_to = max(self.trained_to, self.step)
        self.finished_at = time.time()
        if self.call is not None:
            self.call = self.call.after_step(rows, loop_s)
            if self.meters is not None:
                # The next batch is the call's own once the step count reaches the call's start.
                self.meters.recording = self.step >= self.call.start_step
        # The batch ended its window when an optimizer stepped in it, or the loop asked the
        # precision backend to step (a skipped step ends its window too).
        window = self.window
        if self.journal.dirty or self._parts.optimizer_steps != window.optimizer_steps:
            self.window_before, self.window = window, self.mark_window_start()

    def validation_started(self) -> bool:
        """A validation call begins; returns whether it is at a window start (its draws then
        belong to that start: call `remark_window_start` once it ended)."""
        self._validations_in_window += 1
        if self.at_window_start:
            self._validated_at = self.step
        return self.at_window_start

    @property
    def at_window_start(self) -> bool:
        """Whether the last finished step ended an accumulation window (always without
        accumulation): a boundary where nothing is accumulated, at which workers can leave and
        join and a checkpoint is that of this very step."""
        return self.window.step == self.step

    @property
    def window_step(self) -> int:
        """The step the accumulation window in progress started at (`step` at a window start):
        the step a recovery goes back to, and the step a checkpoint taken now describes."""
        return self.window.step

    @property
    def validated_at(self) -> Optional[int]:
        """The step of the last window start a validation ran at since the last load (None:
        none did)."""
        return self._validated_at

    @property
    def in_batch(self) -> bool:
        """Whether the loop is inside a training batch (drawn, not finished)."""
        return bool(self._train.in_flight)

    @property
    def finished_epochs(self) -> int:
        """Epochs trained to their end (the one in progress, if any, not counted)."""
        return self.epoch - (1 if self._train.is_open() else 0)

    # -- the window start ----------------------------------------------------------------------
    def live_position(self) -> dict[str, Any]:
        """The counters and place in the epoch as they are now."""
        in_epoch = self._train.is_open()
        return {
            "epoch": self.epoch,
            "position": self._train.consumed(),
            "epoch_rows": self._train.consumed_rows(),
            "in_epoch": in_epoch,
            "epoch_steps": self._train.epoch_steps if in_epoch else 0,
            "step": self.step,
            "global_step": self._operator.global_step,
        }

    def rank_slot_now(self, in_flight: int = 0) -> RankSlot:
        """This rank's own part as it is now (see `RankSlot`), `in_flight` batches of the call
        not counted yet."""
        rank_state = same_device_copy(self._operator.rank_state_dict()) if self.rank_state else None
        call, meters = self.call, self.meters
        counted = None
        if call is not None and not call.finished and meters is not None:
            counted = (call.call_id, *meters.counts, in_flight)
        return RankSlot(
            state=rank_state,
            rng=rng_state(),
            pass_seed=self._train.pass_seed if self._train.is_open() else None,
            counted=counted,
        )

    def mark_window_start(self) -> WindowStart:
        """This moment as the start of a window: what going back to it restores."""
        meters = self.meters
        rank = self.rank_slot_now()
        self.journal.commit()
        self._validations_in_window = 0
        return WindowStart(
            position=self.live_position(),
            call=self.call,
            meters=(meters, meters.mark()) if meters is not None else None,
            rank=rank,
            optimizer_steps=self._parts.optimizer_steps,
        )

    def remark_window_start(self) -> None:
        """Mark the window start in progress again, at the same step, with what changed since
        (see `add_window_start_hook`)."""
        self.window = self.mark_window_start()
        for hook in self._window_start_hooks:
            hook()

    def add_window_start_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` whenever the window start in progress is marked again at the same step
        because what it holds changed: a call ended there (what its loop did after its last
        batch belongs to it) or a validation ran there (its draws do). Every worker does so at
        the same point."""
        self._window_start_hooks.append(hook)

    def new_journal(self) -> None:
        """Journal the optimizers and models the components hold now (after they were
        replaced: the journal copies the running statistics of normalisation layers)."""
        self.journal.close()
        parts = self._parts
        self.journal = StepJournal(parts.optimizers, parts.models, self._before_step)

    # -- backward ------------------------------------------------------------------------------
    def progress(self) -> Progress:
        """How far this worker got (asked after a failure), once it went back to the start of the
        accumulation window it was in (the last finished step without accumulation): counters,
        place in the epoch, call and metrics, generators, per-rank state, running statistics of
        normalisation layers as they were then, and no gradient accumulated, so
        that every batch of the window is done again and counts once. A worker left in the
        middle of a batch with some of its optimizers stepped is first rolled back where the
        journal can (several optimizers); otherwise it reports itself as not clean."""
        in_batch = self._train.in_flight
        reached = self.step + (1 if in_batch else 0)
        interleaved = self._validations_in_window > 0 and self.step > self.window.step
        clean = self.journal.rollback()
        self._rewind()
        return Progress(
            step=self.step,
            epoch=self.epoch,
            clean=clean,
            in_batch=in_batch,
            call=self.call,
            finished_at=self.finished_at,
            reached=reached,
            interleaved=interleaved,
            validated_at=self._validated_at,
        )

    def _rewind(self) -> None:
        """Go back to the start of the window in progress (see `progress`)."""
        window = self.window
        for optimizer in self._parts.optimizers:
            # Whatever the window had accumulated: its batches are all done again.
            optimizer.zero_grad(set_to_none=True)
        self.set_position(window.position, pass_seed=window.rank.pass_seed)
        window.rank.restore_generators()
        if self.rank_state:
            self._operator.load_rank_state_dict(same_device_copy(window.rank.state))
        call, marked = self.call, window.call
        if call is not None and (marked is None or not call.same_call(marked)):
            # The call began inside the window: the window's steps before it are done again
            # first, and are not the call's.
            self.call = call.resumed_at(window.step, 0)
            self.meters = AverageMeterCollection()
            self.meters.recording = False
        else:
            self.call = window.call
            if window.meters is not None:
                meters, mark = window.meters
                meters.rewind(mark)
                self.meters = meters

    # -- going on elsewhere --------------------------------------------------------------------
    def position_state(self) -> dict[str, Any]:
        """This worker's counters and place in the epoch at the start of the accumulation window
        in progress (a part of a state dict), and ``trained_to``, the furthest step trained."""
        return {
            **self.window.position,
            "trained_to": self.trained_to,
            "epoch_ended": self.epoch_ended,
        }

    def set_position(self, state: Mapping[str, Any], pass_seed: Optional[PassSeed] = None) -> None:
        """Counters and the place in the epoch from a state dict (the next pass goes on there,
        its loader iterator seeded from `pass_seed`)."""
        op = self._operator
        op.global_step = int(state.get("global_step", op.global_step))
        self.step = int(state.get("step", self.step))
        self.epoch = int(state["epoch"])
        position, rows = int(state.get("position", 0)), state.get("epoch_rows")
        # States written before "in_epoch" existed: an epoch was in progress iff it had a position.
        in_epoch = bool(state.get("in_epoch", position > 0 or bool(rows)))
        # States written before "epoch_steps" existed: the batches of the pass.
        done = int(state.get("epoch_steps", position))
        if not in_epoch:
            self._train.reset()
        elif rows is not None and self._train.consumed_rows() is not None:
            self._train.reset(resume_rows=int(rows), epoch_steps=done, pass_seed=pass_seed)
        else:
            self._train.reset(resume=position, epoch_steps=done, pass_seed=pass_seed)

    def restore(self, state: Mapping[str, Any], pass_seed: Optional[PassSeed] = None) -> None:
        """Go to the position a state dict (or a `position_state`) describes, as the start of
        a window: the next pass goes on from its place, seeded from `pass_seed`."""
        self.set_position(state, pass_seed=pass_seed)
        self._validated_at = None
        self.trained_to = int(state.get("trained_to", self.step))
        self.epoch_ended = _epoch_ended(state, self.epoch_ended)
        self._val.reset()
        self.window = self.mark_window_start()

    def take_pass_seed(self, pass_seed: Optional[PassSeed]) -> None:
        """Seed the next pass's loader iterator from `pass_seed` (a rank slot's), unless it is
        None or a pass is being drawn already."""
        if pass_seed is not None and self._train.iterator is None:
            self._train.pass_seed = pass_seed

    def adopt(self, position: Mapping[str, Any], call: CallRecord | None) -> None:
        """Go on from the recovery source's `position_state` and call: the next `train_epoch` with
        the same call id continues that call. Metrics this worker recorded in the call are kept
        (a survivor's: up to `position`'s step, when it had finished the window before it); a
        worker new to the call starts its metrics empty."""
        before, self.window_before = self.window_before, None
        if before is not None and before.step == int(position["step"]) and before.meters:
            # This worker finished the window the source goes on from (its state, loaded already,
            # may have set the step back): that window's batches are recorded again.
            meters, mark = before.meters
            if meters is self.meters:
                meters.rewind(mark)
        if call is None:
            self.call = None
        else:
            mine = self.call
            if mine is None or not mine.same_call(call):
                self.meters = AverageMeterCollection()
            self.call = dataclasses.replace(call, recovered=not call.finished or call.recovered)
        # This worker's own generator state for the loader's seed (its peers' differ).
        self.restore(position, pass_seed=self._train.pass_seed)

    def adopt_snapshot(
        self, call: CallRecord | None, meters: AverageMeterCollection | None
    ) -> None:
        """After a restore from a snapshot (already loaded: it set the step and place): go on with
        `call` from the snapshot's step, with `meters` as the call's metrics up to there."""
        if call is None:
            self.call, self.meters = None, None
            return
        # The snapshot's record holds the call's rows up to its step (this runner is new: it has
        # no call of its own to count from).
        self.call = call.resumed_at(self.step, call.rows, call.loop_s)
        self.meters = meters if meters is not None and self.step >= call.start_step else None
        if self.meters is None:
            self.meters = AverageMeterCollection()
        self.count_on()
        self.window = self.mark_window_start()

    def count_on(self) -> None:
        """Count the call on from what the rank slot last loaded had counted in it, when it is
        the call this worker goes on with: the rank's batches before the window start, whoever
        ran them, stay in the call's count (see `RankSlot.counted`)."""
        counted, call, meters = self.slot_counted, self.call, self.meters
        if counted is None or call is None or meters is None or call.call_id != counted[0]:
            return
        _, batches, samples, in_flight = counted
        if in_flight and batches:
            # The batch's own count went with the rank: its mean batch stands for it.
            mean = samples / batches
            samples += in_flight * (round(mean) if isinstance(samples, int) else mean)
        meters.count_from(int(batches) + int(in_flight), samples)

    def call_meters(self) -> AverageMeterCollection | None:
        """A copy of the metrics of the call in progress so far (None outside a call)."""
        if self.call is None or self.call.finished or self.meters is None:
            return None
        return self.meters.snapshot()


def _epoch_ended(state: Mapping[str, Any], default: int) -> int:
    """The last epoch whose end was acted on, from a state's position (one saved before it was
    kept: every epoch before the state's, and the state's own when it had ended)."""
    if "epoch_ended" in state:
        return int(state["epoch_ended"])
    if "epoch" not in state:
        return default
    epoch = int(state["epoch"])
    return epoch - 1 if state.get("in_epoch", False) else epoch
