"""`OperatorRunner`: the long-lived per-worker object that drives a `TrainingOperator`."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Hashable, Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from raysgd_operator._internal.loaders import planned_sampler
from raysgd_operator._internal.precision import get_precision
from raysgd_operator._internal.rng import rng_state, set_rng_state
from raysgd_operator._internal.step_journal import StepJournal
from raysgd_operator._internal.stream import BatchStream, CallBatches, missing_loader_error
from raysgd_operator._internal.tensors import cpu_copy, host_like, on_device, same_device_copy
from raysgd_operator._internal.window import RankSlot, WindowStart
from raysgd_operator.batch import BATCH_SIZE
from raysgd_operator.components import Components, RankInfo
from raysgd_operator.flops import peak_flops_per_s
from raysgd_operator.metrics import BATCH_COUNT, NUM_SAMPLES, AverageMeterCollection
from raysgd_operator.operator import TrainingOperator
from raysgd_operator.options import TrainingOptions
from raysgd_operator.progress import CallRecord, Progress
from raysgd_operator.throughput import worker_throughput

__all__ = ["OperatorRunner", "on_device"]


def _dcp() -> Any:
    # Imported on first use: torch.distributed.checkpoint takes most of a second to import, paid by
    # every new worker (start, recovery), although only sharded runs and checkpoints need it.
    from raysgd_operator._internal import sharded

    return sharded


logger = logging.getLogger(__name__)


class _MissingLoader:
    """Stands in for the batches when no loader was registered: only iterating it is an error,
    so that a custom loop that brings its own data still works."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __iter__(self) -> Any:
        raise missing_loader_error(self.kind)


class OperatorRunner:
    """Builds one worker's precision backend and operator, and runs its train/validate calls.

    It owns the worker's `Components`, the persistent train and validation iterators
    (``num_steps`` continues where the last call stopped and wraps into a new epoch), the epoch and
    step counters, the sampler's ``set_epoch``, profiling, and the state dict: ``epoch``,
    ``operator``, ``models``, ``optimizers``, ``schedulers``, ``precision``, ``position``,
    ``epoch_rows``, ``step`` and ``global_step``, all plain tensors and containers
    (``torch.load(weights_only=True)`` reads them).

    It counts finished steps (`progress`) and keeps the start of the accumulation window in
    progress (`raysgd_operator._internal.window`): a `train_epoch` call interrupted by a failure
    can be continued, on the survivors and on workers that took over their state, from the start
    of the window the group was in (`call_id`), every batch of that window done again, and its
    metrics then count every step of the call once. The state it saves is that window start's.

    ``datasets`` maps names to this worker's dataset shards (objects with ``iter_torch_batches``,
    such as Ray Data ``DataIterator``s); the ``"train"`` and ``"validation"`` shards replace the
    loaders registered under those names, drawn in batches of ``config[BATCH_SIZE]`` on ``device``
    as ``options.dataset_options`` says. One pass over a shard is one epoch.
    """

    def __init__(
        self,
        operator_cls: type[TrainingOperator],
        config: dict[str, Any],
        *,
        world_rank: int = 0,
        local_rank: int = 0,
        world_size: int = 1,
        device: torch.device = torch.device("cpu"),
        datasets: Mapping[str, Any] | None = None,
        options: TrainingOptions | None = None,
        restoring: bool = False,
        group: int = 0,
        **option_overrides: Any,
    ) -> None:
        """`options` is the trainer's `TrainingOptions`; keyword options (``use_fp16="bf16"``,
        ``scheduler_step_freq="epoch"``, ...) build or override one, for direct use and tests.
        `restoring`: a state is loaded right after (a recovery): wrapping does not sync from
        rank 0. `group`: which process group the worker is in (`RankInfo.group`)."""
        if not (isinstance(operator_cls, type) and issubclass(operator_cls, TrainingOperator)):
            raise TypeError(
                f"operator_cls must be a TrainingOperator subclass, got {operator_cls!r}"
            )
        options = TrainingOptions.build(options, **option_overrides)
        if options.num_threads is not None:
            # One intra-op thread pool per CPU the worker reserved: workers sharing a node do not
            # oversubscribe its cores (the same setting torchrun users get from OMP_NUM_THREADS).
            torch.set_num_threads(options.num_threads)
        if datasets and BATCH_SIZE not in config:
            raise ValueError(
                "datasets need config[BATCH_SIZE] (each worker's share is its batch size)"
            )
        device = torch.device(device)
        config = dict(config)
        self.options = options
        self.components = Components(
            options=options,
            rank_info=RankInfo(world_rank, local_rank, world_size, device, group),
            precision=get_precision(options.use_fp16, device=device, apex_args=options.apex_args),
            config=config,
            datasets=datasets,
            restoring=restoring,
        )
        self.epoch = 0
        #: Steps finished since training began (see `progress`).
        self.step = 0
        # The furthest step trained. A recovery or a load that goes back to the start of a window
        # leaves `step` behind it: the steps up to it belong to calls already made, and the next
        # call does them again before its own.
        self._trained_to = 0
        #: `RankSlot.counted` of the rank slot loaded last (`load_rank_slot`).
        self._slot_counted: Optional[tuple[Any, int, float, int]] = None
        # The last epoch whose end a loop acted on (`end_of_epoch_due`): like the schedulers it
        # steps, it is not taken back when a window is done again.
        self._epoch_ended = 0
        self._call: CallRecord | None = None
        self._finished_at: float | None = None
        self._meters: AverageMeterCollection | None = None
        # The call's loop time (`throughput`): the seconds it had before this attempt of the
        # call, and when this attempt's loop began (`time.perf_counter`).
        self._loop_base = 0.0
        self._loop_start = time.perf_counter()
        #: Whether the missing peak FLOP/s of this device was logged (once per worker).
        self._peak_warned = False
        #: The last `train_epoch` call stopped at a boundary on request (`request_stop`).
        self.yielded = False
        #: Every batch so far reported its rows as its `num_samples` (the default loop's count):
        #: a call's rows, which the group knows across a lost worker, are then its num_samples.
        self.counts_rows = True
        self._step_hooks: list[Callable[[], None]] = []
        # Without a loader of its kind a stream is at position 0 with no epoch in progress, so that
        # the state and position of a runner that only validates (or whose own loop brings its
        # data) can be read; only drawing batches from it says what is missing.
        # The training stream tells this runner where its passes are (`pass_started`,
        # `step_finished`); validation passes count nothing.
        self._train = BatchStream(self.components, "train", listener=self)
        self._val = BatchStream(self.components, "validation")
        self.operator = operator_cls(config, components=self.components)
        self._before_step_hooks: list[Callable[[], None]] = []
        self._window_start_hooks: list[Callable[[], None]] = []
        self.journal = StepJournal(
            self.components.optimizers, self.components.models, before_step=self._before_step
        )
        #: Validation calls since the window start (see `progress`).
        self._validations_in_window = 0
        self._window = self._mark_window_start()
        #: The start of the window before the one in progress: a worker that finished a window
        #: its peers did not (a collective that ended here but failed on them) goes back to it.
        self._window_before: WindowStart | None = None

    @property
    def device(self) -> torch.device:
        """This worker's device."""
        return self.components.rank_info.device

    @property
    def precision(self) -> Any:
        """This worker's precision backend."""
        return self.components.precision

    def _loader(self, kind: str) -> Any:
        loader = self.components.loader(kind)
        if loader is None:
            raise missing_loader_error(kind)
        return loader

    def _has_loader(self, kind: str) -> bool:
        return self.components.loader(kind) is not None

    def _base_info(self, num_steps: int | None) -> dict[str, Any]:
        # The dunder keys are the ones RaySGD 1.x operators read (its NUM_STEPS/USE_FP16 constants).
        return {
            "num_steps": num_steps,
            "__num_steps__": num_steps,
            "__use_fp16__": self.options.use_fp16,
        }

    def end_of_epoch_due(self, epoch: int | None) -> bool:
        """The training loop reached `epoch`'s last batch: True the first time only."""
        epoch = self.epoch if epoch is None else epoch
        if epoch <= self._epoch_ended:
            return False
        self._epoch_ended = epoch
        return True

    def pass_started(self, resuming: bool) -> int:
        """A training pass begins (called by the training stream): a new one is a new epoch."""
        if not resuming:
            self.epoch += 1
        return self.epoch

    # -- calls -------------------------------------------------------------------------------
    def train_epoch(
        self,
        num_steps: int | None = None,
        profile: bool = False,
        info: dict[str, Any] | None = None,
        call_id: Hashable | None = None,
    ) -> dict[str, Any]:
        """Train ``num_steps`` batches (or the rest of the epoch); returns this worker's metrics.

        With the `call_id` of a call that a failure interrupted, the call goes on where the group
        left it (see `adopt`) instead of starting again, and its metrics cover all of it.
        """
        op = self.operator
        op.timers.enabled = profile
        op.timers.reset()
        call = self._call
        # The same call again after it ended here (a peer was lost once this worker was done):
        # its record and metrics stand, and nothing is left to train.
        done = call is not None and call.finished and call_id is not None
        done = done and call.call_id == call_id
        if not done and (
            call is None or call.finished or call_id is None or call.call_id != call_id
        ):
            # A new call's own steps begin where training had got to: steps a recovery or a load
            # went back over are done again first, and are not the call's.
            start = max(self.step, self._trained_to)
            call = CallRecord(
                call_id=call_id, num_steps=num_steps, start_step=start, steps=self.step - start
            )
            self._meters = AverageMeterCollection()
        self._call = call
        # The loop's time runs from here, where it starts drawing batches (a loader's first
        # batch of an epoch is part of it), and adds to the time of the steps the call kept.
        self._loop_base, self._loop_start = call.loop_s, time.perf_counter()
        meters = self._meters
        remaining = call.remaining()
        meters.recording = self.step >= call.start_step
        if not self._has_loader("train"):
            # A custom train_epoch may bring its own data; each call is then one epoch (which a
            # call going on after a failure does not start again).
            if call.epoch is None:
                self.epoch += 1
                self._call = call = dataclasses.replace(call, epoch=self.epoch)
            batches: Any = _MissingLoader("train")
        elif (
            done
            or remaining == 0
            or (
                remaining is None
                and call.epoch is not None
                and self.epoch >= call.epoch
                and not self._train.is_open()
            )
        ):
            # The call had reached its end when it stopped (a peer lost after its last batch):
            # nothing is left of it. No pass begins: beginning one draws its iterator's seed.
            batches = CallBatches(iter(()), 0, meters=meters, first_index=call.steps)
        else:
            # A call restored to a snapshot from an earlier epoch first finishes the epochs
            # before its own.
            until = call.epoch if remaining is None else None
            batches = self._train.begin_call(
                remaining, meters=meters, first_index=max(0, call.steps), until_epoch=until
            )
            if call.epoch is None:
                self._call = call = dataclasses.replace(call, epoch=self.epoch)
        call_info = {**self._base_info(num_steps), "epoch_idx": self.epoch - 1, **(info or {})}
        finished = False
        try:
            with op.timers.record("train_epoch"):
                metrics = dict(op.train_epoch(batches, call_info))
            finished = True
        finally:
            self._train.end_call(remaining, finished=finished)
        self.yielded = bool(getattr(batches, "yielded", False))
        self.counts_rows = self.counts_rows and not getattr(
            batches, "counts_other_than_rows", False
        )
        # The device's queued work is the loop's too: waited for once per call, never per step
        # (reading the metrics usually did already).
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        loop_s = self._loop_time()
        # A call stopped at a step boundary on request goes on later: it is not finished.
        self._call = call = dataclasses.replace(
            self._call, finished=not self.yielded, loop_s=loop_s
        )
        if self.at_window_start:
            # What the loop did after its last batch belongs to the window start it ended at.
            self._remark_window_start()
        metrics["epoch"] = self.epoch
        if call.recovered and BATCH_COUNT in metrics:
            metrics[BATCH_COUNT] = call.steps  # the call's steps, before and after the recovery
        metrics.update(
            worker_throughput(
                metrics.get(NUM_SAMPLES),
                loop_s,
                counts_rows=self.counts_rows,
                flops_per_sample=self.options.flops_per_sample,
                peak=self._peak_flops_per_s(),
            )
        )
        if profile:
            metrics["profile"] = op.timers.stats()
        return metrics

    def _loop_time(self) -> float:
        """Seconds the call's loop has run for its own steps (see `CallRecord.loop_s`)."""
        return self._loop_base + time.perf_counter() - self._loop_start

    def _peak_flops_per_s(self) -> float | None:
        """This device's peak FLOP/s for ``mfu`` (None: no ``mfu``), read at every call: the
        float32 matmul precision that chooses between fp32 and tf32 may change in between."""
        options = self.options
        if options.flops_per_sample is None:
            return None
        if options.peak_flops_per_s is not None:
            return options.peak_flops_per_s
        peak = peak_flops_per_s(self.device, self.precision.dtype)
        if peak is None and self.device.type == "cuda" and not self._peak_warned:
            self._peak_warned = True
            if self.components.rank_info.world_rank == 0:
                logger.warning(
                    "no mfu: the peak FLOP/s of %s in %s is not known here; give the trainer "
                    "peak_flops_per_s=",
                    torch.cuda.get_device_name(self.device),
                    self.precision.dtype,
                )
        return peak

    def step_finished(self, rows: int | None) -> None:
        """A training batch is finished (called by the training stream)."""
        self.step += 1
        self._trained_to = max(self._trained_to, self.step)
        self._finished_at = time.time()
        if self._call is not None:
            own = self._call.steps >= 0  # not a step redone from before the call
            self._call = self._call.after_step(rows, self._loop_time() if own else 0.0)
            if not own:
                # The call's own time begins where the steps redone from before it end.
                self._loop_base, self._loop_start = 0.0, time.perf_counter()
            if self._meters is not None:
                # The next batch is the call's own once the step count reaches the call's start.
                self._meters.recording = self.step >= self._call.start_step
        # The batch ended its window when an optimizer stepped in it, or the loop asked the
        # precision backend to step (a skipped step ends its window too).
        window = self._window
        if self.journal.dirty or self.components.optimizer_steps != window.optimizer_steps:
            self._window_before, self._window = window, self._mark_window_start()
        for hook in self._step_hooks:
            hook()

    @property
    def at_window_start(self) -> bool:
        """Whether the last finished step ended an accumulation window (always without
        accumulation): a boundary where nothing is accumulated, at which workers can leave and
        join and a checkpoint is that of this very step."""
        return self._window.step == self.step

    @property
    def window_step(self) -> int:
        """The step the accumulation window in progress started at (`step` at a window start):
        the step a recovery goes back to, and the step a checkpoint taken now describes."""
        return self._window.step

    def _live_position(self) -> dict[str, Any]:
        """The counters and place in the epoch as they are now."""
        in_epoch = self._train.is_open()
        return {
            "epoch": self.epoch,
            "position": self._train.consumed(),
            "epoch_rows": self._train.consumed_rows(),
            "in_epoch": in_epoch,
            "epoch_steps": self._train.epoch_steps if in_epoch else 0,
            "step": self.step,
            "global_step": self.operator.global_step,
        }

    def _rank_slot_now(self, in_flight: int = 0) -> RankSlot:
        """This rank's own part as it is now (see `RankSlot`), `in_flight` batches of the call
        not counted yet."""
        rank_state = (
            same_device_copy(self.operator.rank_state_dict()) if self.has_rank_state else None
        )
        call, meters = self._call, self._meters
        counted = None
        if call is not None and not call.finished and meters is not None:
            counted = (call.call_id, *meters.counts, in_flight)
        return RankSlot(
            state=rank_state,
            rng=rng_state(),
            pass_seed=self._train.pass_seed if self._train.is_open() else None,
            counted=counted,
        )

    def _mark_window_start(self) -> WindowStart:
        """This moment as the start of a window (see `window`): what going back to it restores."""
        parts, meters = self.components, self._meters
        rank = self._rank_slot_now()
        self.journal.commit()
        self._validations_in_window = 0
        return WindowStart(
            position=self._live_position(),
            call=self._call,
            meters=(meters, meters.mark()) if meters is not None else None,
            rank=rank,
            optimizer_steps=parts.optimizer_steps,
        )

    def _rewind(self) -> None:
        """Go back to the start of the window in progress (see `progress`)."""
        window, parts = self._window, self.components
        for optimizer in parts.optimizers:
            # Whatever the window had accumulated: its batches are all done again.
            optimizer.zero_grad(set_to_none=True)
        self._set_position(window.position, pass_seed=window.rank.pass_seed)
        window.rank.restore_generators()
        if self.has_rank_state:
            self.operator.load_rank_state_dict(same_device_copy(window.rank.state))
        call, marked = self._call, window.call
        if call is not None and (marked is None or not call.same_call(marked)):
            # The call began inside the window: the window's steps before it are done again
            # first, and are not the call's.
            self._call = call.resumed_at(window.step, 0)
            self._meters = AverageMeterCollection()
            self._meters.recording = False
        else:
            self._call = window.call
            if window.meters is not None:
                meters, mark = window.meters
                meters.rewind(mark)
                self._meters = meters

    def _remark_window_start(self) -> None:
        """Mark the window start in progress again, at the same step, with what changed since
        (see `add_window_start_hook`)."""
        self._window = self._mark_window_start()
        for hook in self._window_start_hooks:
            hook()

    def add_window_start_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` whenever the window start in progress is marked again at the same step
        because what it holds changed: a call ended there (what its loop did after its last
        batch belongs to it) or a validation ran there (its draws do). Every worker does so at
        the same point."""
        self._window_start_hooks.append(hook)

    def add_before_step_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` just before each optimizer step (so at the end of an accumulation
        window, once its gradients are whole), on the training thread. `upcoming_rank_slot` is
        then what the window start after this batch will hold, unless the loop changes the
        generators or the per-rank state after the step."""
        self._before_step_hooks.append(hook)

    def _before_step(self) -> None:
        for hook in self._before_step_hooks:
            hook()

    def upcoming_rank_slot(self) -> dict[str, Any]:
        """This rank's slot as it is now (see `rank_slot`), plain, on the CPU: from a
        before-step hook, that of the window start this batch ends at (`step` + 1)."""
        return self._rank_slot_now(in_flight=1 if self._train.in_flight else 0).to_plain()

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` every time a training step is finished (after the counters moved and,
        at the end of a window, its successor's start was marked: see `at_window_start`)."""
        self._step_hooks.append(hook)

    def request_stop(self) -> None:
        """From a step hook: end the call at this step boundary. `train_epoch` then returns the
        metrics so far with `yielded` True, and the same call id goes on with the call later."""
        self._train.stop_requested = True

    def validate(
        self,
        num_steps: int | None = None,
        profile: bool = False,
        info: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Validate ``num_steps`` batches (or the rest of the pass); returns this worker's metrics."""
        op = self.operator
        op.timers.enabled = profile
        op.timers.reset()
        if not self._has_loader("validation"):
            batches: Any = _MissingLoader("validation")
        else:
            self._check_validation_split()
            batches = self._val.begin_call(num_steps)
        at_start = self.at_window_start
        self._validations_in_window += 1
        finished = False
        try:
            with op.timers.record("validation"):
                metrics = dict(op.validate(batches, {**self._base_info(num_steps), **(info or {})}))
            finished = True
        finally:
            self._val.end_call(num_steps, finished=finished)
        if at_start:
            # A validation between windows draws from the generators (its loader's iterator
            # takes a seed): those draws belong to the window start, as to the uninterrupted
            # run, which goes on after them.
            self._remark_window_start()
        if profile:
            metrics["profile"] = op.timers.stats()
        return metrics

    def _check_validation_split(self) -> None:
        sampler = planned_sampler(self._loader("validation"))
        size = self.components.rank_info.world_size
        if sampler is not None and size > 1 and sampler.num_rows < size:
            # Each row is validated once, so some worker would have none; its peers could then
            # wait for it in a forward pass that gathers parameters (fsdp) or syncs buffers (ddp).
            raise ValueError(
                f"validate(): the validation data has {sampler.num_rows} row(s) for {size} "
                "workers; every worker needs at least one"
            )

    # -- state -------------------------------------------------------------------------------
    def _progress_state(self) -> dict[str, Any]:
        """The part of the state that is not a model tensor, as of the window start (the same on
        every worker but ``rng``, this worker's generators: every rank's are in `rank_slot`)."""
        return {
            **self.position_state(),
            "operator": cpu_copy(self.operator.state_dict()),
            "schedulers": [cpu_copy(s.state_dict()) for s in self.components.schedulers],
            "precision": cpu_copy(self.precision.state_dict()),
            "rng": self._window.rank.rng,
        }

    def state_dict(
        self, *, live: bool = False, into: Optional[dict[str, Any]] = None
    ) -> dict[str, Any]:
        """A CPU snapshot of everything needed to continue training exactly from the start of the
        accumulation window in progress (`window_step`: this step at a window start). Inside a
        window the models and optimizers are those of its start; the batches since are done
        again by whoever loads it, so that no part of a window's gradient is lost.

        With `live`, the model and optimizer tensors are the worker's own, on its device, not
        copies (to send them to another worker without a copy; training must not run meanwhile).
        With `into`, an earlier snapshot that nothing reads any more, the model and optimizer
        tensors are copied into its tensors (a periodic checkpoint's host copy, reused).
        Not available with a sharded strategy (no worker holds the whole model): use
        `save_sharded`.
        """
        parts = self.components
        models, optimizers = parts.strategy.whole_state(parts.models, parts.optimizers)
        if not live:
            earlier = into or {}
            models = cpu_copy(models, earlier.get("models"))
            optimizers = cpu_copy(optimizers, earlier.get("optimizers"))
        return {**self._progress_state(), "models": models, "optimizers": optimizers}

    @staticmethod
    def host_buffers(live: Mapping[str, Any]) -> dict[str, Any]:
        """Host memory for a later `state_dict(into=...)`, shaped like `live` (a
        ``state_dict(live=True)`` taken on the training thread), with every page already mapped:
        the first copy into it then costs what later ones do. Its values mean nothing until that
        copy. Reads only shapes and dtypes, so it can run in a thread beside the training loop."""
        return {"models": host_like(live["models"]), "optimizers": host_like(live["optimizers"])}

    # -- recovery ------------------------------------------------------------------------------
    def progress(self) -> Progress:
        """How far this worker got (asked after a failure), once it went back to the start of the
        accumulation window it was in (the last finished step without accumulation): counters,
        place in the epoch, call and metrics, generators, per-rank state, running statistics of
        normalisation layers as they were then, and no gradient accumulated, so
        that every batch of the window is done again and counts once. A worker left in the
        middle of a batch with some of its optimizers stepped is first rolled back where the
        journal can (several optimizers); otherwise it reports itself as not clean."""
        reached = self.step + (1 if self._train.in_flight else 0)
        in_batch = self._train.in_flight
        interleaved = self._validations_in_window > 0 and self.step > self._window.step
        clean = self.journal.rollback()
        self._rewind()
        return Progress(
            step=self.step,
            epoch=self.epoch,
            clean=clean,
            in_batch=in_batch,
            call=self._call,
            finished_at=self._finished_at,
            reached=reached,
            interleaved=interleaved,
        )

    @property
    def finished_epochs(self) -> int:
        """Epochs trained to their end (the one in progress, if any, not counted)."""
        return self.epoch - (1 if self._train.is_open() else 0)

    def position_state(self) -> dict[str, Any]:
        """This worker's counters and place in the epoch at the start of the accumulation window
        in progress (a part of `state_dict`), and ``trained_to``, the furthest step trained."""
        return {
            **self._window.position,
            "trained_to": self._trained_to,
            "epoch_ended": self._epoch_ended,
        }

    def adopt(self, position: Mapping[str, Any], call: CallRecord | None) -> None:
        """Go on from the recovery source's `position_state` and call: the next `train_epoch` with
        the same call id continues that call. Metrics this worker recorded in the call are kept
        (a survivor's: up to `position`'s step, when it had finished the window before it); a
        worker new to the call starts its metrics empty."""
        before, self._window_before = self._window_before, None
        if before is not None and before.step == int(position["step"]) and before.meters:
            # This worker finished the window the source goes on from (its state, loaded already,
            # may have set the step back): that window's batches are recorded again.
            meters, mark = before.meters
            if meters is self._meters:
                meters.rewind(mark)
        # This worker's own generator state for the loader's seed (its peers' differ).
        self._set_position(position, pass_seed=self._train.pass_seed)
        self._trained_to = int(position.get("trained_to", self.step))
        self._epoch_ended = _epoch_ended(position, self._epoch_ended)
        self._val.reset()
        if call is None:
            self._call = None
        else:
            mine = self._call
            if mine is None or not mine.same_call(call):
                self._meters = AverageMeterCollection()
            self._call = dataclasses.replace(call, recovered=not call.finished or call.recovered)
        self._window = self._mark_window_start()

    def adopt_snapshot(
        self, call: CallRecord | None, meters: AverageMeterCollection | None
    ) -> None:
        """After a restore from a snapshot (already loaded: it set the step and place): go on with
        `call` from the snapshot's step, with `meters` as the call's metrics up to there."""
        if call is None:
            self._call, self._meters = None, None
            return
        # The snapshot's record holds the call's rows up to its step (this runner is new: it has
        # no call of its own to count from).
        self._call = call.resumed_at(self.step, call.rows, call.loop_s)
        self._meters = meters if meters is not None and self.step >= call.start_step else None
        if self._meters is None:
            self._meters = AverageMeterCollection()
        self._count_on()
        self._window = self._mark_window_start()

    def take_over(self, old: OperatorRunner) -> None:
        """Become `old` (a runner this worker had to build again after a resize): its state, its
        own per-rank state, its place and the call it was in, with the metrics it recorded."""
        self.load_state_dict(old.state_dict(live=True))
        self._call, self._meters, self._trained_to = old._call, old._meters, old._trained_to
        self._epoch_ended = old._epoch_ended
        self.load_rank_slot(old.rank_slot())

    @property
    def has_rank_state(self) -> bool:
        """Whether the operator keeps a per-rank state (overrides `rank_state_dict`); the same
        on every worker."""
        return type(self.operator).rank_state_dict is not TrainingOperator.rank_state_dict

    def rank_slot(self) -> dict[str, Any]:
        """What this worker holds of the window start that its peers do not hold the same: the
        operator's per-rank state (`TrainingOperator.rank_state_dict`, None without one), the
        random generators and the loader's seed of the epoch; plain, on the CPU."""
        return self._window.rank.to_plain()

    def rank_slot_before(self) -> Optional[tuple[int, dict[str, Any]]]:
        """(its step, this rank's slot) of the window start before the one in progress, plain,
        on the CPU (see `rank_slot`); None when none is kept (before the first window ended,
        and after a restore or a load)."""
        before = self._window_before
        return None if before is None else (before.step, before.rank.to_plain())

    def load_rank_slot(self, slot: Optional[Mapping[str, Any]]) -> None:
        """Take `slot` (a `rank_slot` of the rank whose place this worker takes) as this worker's:
        None when no such slot exists (a rank the saved run did not have, a lost worker's whose
        holders are gone too): the operator then starts its per-rank state afresh and the
        generators stay as they are."""
        slot = slot or {}
        if self.has_rank_state:
            self.operator.load_rank_state_dict(slot.get("state"))
        if slot.get("rng") is not None:
            set_rng_state(slot["rng"])
        if slot.get("pass_seed") is not None and self._train.iterator is None:
            self._train.pass_seed = slot["pass_seed"]
        self._slot_counted = slot.get("counted")
        self._count_on()
        self._window = self._mark_window_start()

    def _count_on(self) -> None:
        """Count the call on from what the rank slot last loaded had counted in it, when it is
        the call this worker goes on with: the rank's batches before the window start, whoever
        ran them, stay in the call's count (see `RankSlot.counted`)."""
        counted, call, meters = self._slot_counted, self._call, self._meters
        if counted is None or call is None or meters is None or call.call_id != counted[0]:
            return
        _, batches, samples, in_flight = counted
        if in_flight and batches:
            # The batch's own count went with the rank: its mean batch stands for it.
            mean = samples / batches
            samples += in_flight * (round(mean) if isinstance(samples, int) else mean)
        meters.count_from(int(batches) + int(in_flight), samples)

    @property
    def call(self) -> CallRecord | None:
        """The `train_epoch` call this worker is in or last finished."""
        return self._call

    def sharded_parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this worker's part of the model and optimizer tensors, in the form
        `torch.distributed.checkpoint` saves; the rest of the state: plain, small, the same on
        every worker). Training must not run until the tensors are saved or copied."""
        parts = self.components
        tensors, others = _dcp().tensor_state(parts.models, parts.optimizers)
        return tensors, {
            **self._progress_state(),
            "tensor_others": others,
            "strategy": parts.strategy.name,
        }

    def save_sharded(self, directory: str) -> dict[str, Any]:
        """Write this worker's part of the models and optimizers under `directory` in
        `torch.distributed.checkpoint` format (a collective: every worker calls it at once) and
        return the rest of the state (plain, small, the same on every worker)."""
        tensors, state = self.sharded_parts()
        _dcp().save_files(tensors, directory)
        return state

    def call_meters(self) -> AverageMeterCollection | None:
        """A copy of the metrics of the call in progress so far (None outside a call)."""
        if self._call is None or self._call.finished or self._meters is None:
            return None
        return self._meters.snapshot()

    def load_sharded(self, source: Any, state: dict[str, Any]) -> None:
        """Load a checkpoint directory written by `save_sharded` (with any number of workers), or
        a state kept in memory (a `sharded_memory.reader`), resharded to this group, plus the
        `state` that came with it. A collective, for any strategy."""
        _dcp().load_files(
            self.components.models,
            self.components.optimizers,
            source,
            dict(state.get("tensor_others") or {}),
        )
        self._load_progress(state)

    def needed_parts(self, metadata: bytes) -> set[Any]:
        """The parts of a sharded state with `metadata` that loading it here reads: a checkpoint
        folder's data files, or the ranks whose kept chunks it reads (empty: all of them)."""
        parts = self.components
        return _dcp().needed_parts(parts.models, parts.optimizers, metadata)

    def _load_progress(self, state: dict[str, Any]) -> None:
        op, schedulers = self.operator, self.components.schedulers
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        if len(state.get("schedulers", [])) != len(schedulers):
            raise ValueError(
                f"state has {len(state.get('schedulers', []))} schedulers but this operator "
                f"registered {len(schedulers)}"
            )
        for sched, sd in zip(schedulers, state["schedulers"]):
            sched.load_state_dict(sd)
        if state.get("precision") is not None:
            self.precision.load_state_dict(state["precision"])
        op.load_state_dict(state.get("operator"))
        self._set_position(state)
        self._trained_to = int(state.get("trained_to", self.step))
        self._epoch_ended = _epoch_ended(state, self._epoch_ended)
        self._val.reset()
        self._window = self._mark_window_start()

    def _set_position(self, state: Mapping[str, Any], pass_seed: Optional[bytes] = None) -> None:
        """Counters and the place in the epoch from a state dict (the next pass goes on there,
        its loader iterator seeded from `pass_seed`)."""
        op = self.operator
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the next train call redoes the saved epoch from its position."""
        parts = self.components
        for key, have in (
            ("models", parts.models),
            ("optimizers", parts.optimizers),
            ("schedulers", parts.schedulers),
        ):
            if len(state.get(key, [])) != len(have):
                raise ValueError(
                    f"state has {len(state.get(key, []))} {key} but this operator registered {len(have)}"
                )
        parts.strategy.load_whole_state(
            parts.models, parts.optimizers, state["models"], state["optimizers"]
        )
        self._load_progress(state)

    # -- misc --------------------------------------------------------------------------------
    def get_models(
        self, to_cpu: bool = False, *, cpu_if_on_device: bool = False
    ) -> list[nn.Module]:
        """The registered models, unwrapped (no DDP ``.module``).

        ``to_cpu``: CPU copies of every model. ``cpu_if_on_device``: CPU copies of the models that
        hold a tensor off the CPU, the others as they are (what a caller without that device, such
        as a driver without CUDA, needs to be able to unpickle and use them). With a sharded
        strategy this is a collective: every parameter is gathered into new, whole modules on the
        CPU on rank 0 (the other ranks return an empty list).
        """
        strategy = self.components.strategy
        models = self.components.models
        # Every model first: under a sharded strategy each one is a collective on every rank.
        whole = [strategy.whole_model(m) for m in models]
        if any(m is None for m in whole):
            return []  # gathered on rank 0
        copies = []
        for model, made in zip(models, whole):
            assert made is not None
            if to_cpu or (cpu_if_on_device and on_device(made)):
                # A module made for this call (a sharded model gathered) is the caller's own:
                # moved, not copied again; the live one is copied.
                made = (copy.deepcopy(made) if made is strategy.unwrap(model) else made).cpu()
            copies.append(made)
        return copies

    def models_nbytes(self) -> int:
        """What `get_models` brings into one process, in bytes (parameters and buffers)."""
        parts = self.components
        return sum(parts.strategy.whole_model_nbytes(m) for m in parts.models)

    def update_scheduler(self, metric: Any) -> None:
        """Step every registered scheduler with ``metric`` (for ``scheduler_step_freq="manual"``)."""
        for scheduler in self.components.schedulers:
            scheduler.step(metric)

    def apply_operator(self, fn: Callable[[TrainingOperator], Any]) -> Any:
        """``fn(operator)``."""
        return fn(self.operator)

    def rebind(
        self,
        *,
        world_rank: int,
        local_rank: int,
        world_size: int,
        config: dict[str, Any],
        datasets: Mapping[str, Any] | None = None,
        group: int = 0,
    ) -> bool:
        """Adopt a re-formed process group (`group`: `RankInfo.group`), keeping the operator: re-wrap DDP, re-shard the
        loaders the runner built. Sharded models are replaced by copies sharded over the new group
        (`Components.rebind`): their values are undefined until the caller loads a state, and the
        operator's own attributes that held the old modules hold the new ones.

        ``config`` is the new per-worker config (``BATCH_SIZE`` already split) and ``datasets`` this
        worker's shards of the datasets split over the new group. Returns False when the models or
        a loader cannot follow (a strategy without unwrapped copies, the user's own sampler or an
        IterableDataset whose batch size or sharding would have to change); the caller should then
        build a new runner.
        """
        rank_info = RankInfo(world_rank, local_rank, world_size, self.device, group)
        replaced = self.components.rebind(rank_info, dict(config), datasets)
        if replaced is None:
            return False
        if replaced:
            _swap_references(self.operator, replaced)
            # The journal copies the running statistics of the models' normalisation layers.
            self.journal.close()
            self.journal = StepJournal(
                self.components.optimizers, self.components.models, before_step=self._before_step
            )
        # The pass in progress was split for the old group: the next one re-splits from the same
        # place (the caller then adopts the position the restore chose).
        self._set_position(self._live_position(), pass_seed=self._train.pass_seed)
        self._val.reset()
        self._window = self._mark_window_start()
        return True

    def shutdown(self) -> None:
        """Drop the data iterators (and with them any DataLoader worker processes)."""
        self._train.reset()
        self._val.reset()
        self._window = self._mark_window_start()


def _epoch_ended(state: Mapping[str, Any], default: int) -> int:
    """The last epoch whose end was acted on, from a state's position (one saved before it was
    kept: every epoch before the state's, and the state's own when it had ended)."""
    if "epoch_ended" in state:
        return int(state["epoch_ended"])
    if "epoch" not in state:
        return default
    epoch = int(state["epoch"])
    return epoch - 1 if state.get("in_epoch", False) else epoch


def _swap_references(operator: TrainingOperator, replaced: Mapping[int, nn.Module]) -> None:
    """Point the operator's own attributes (and the lists, tuples and dicts they hold) that
    hold a replaced module (`replaced`: ``{id(old): new}``) at its replacement."""

    def swap(value: Any) -> Any:
        if isinstance(value, nn.Module):
            return replaced.get(id(value), value)
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    attributes = vars(operator)
    for name, value in list(attributes.items()):
        if name != "_components" and _holds(value, replaced):
            attributes[name] = swap(value)


def _holds(value: Any, replaced: Mapping[int, nn.Module]) -> bool:
    if isinstance(value, nn.Module):
        return id(value) in replaced
    if isinstance(value, (list, tuple)):
        return any(_holds(v, replaced) for v in value)
    if isinstance(value, dict):
        return any(_holds(v, replaced) for v in value.values())
    return False
