"""`OperatorRunner`: the long-lived per-worker object that drives a `TrainingOperator`."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Hashable, Mapping
from typing import Any, Callable

import torch
from torch import nn

from raysgd_operator._internal.loaders import planned_sampler
from raysgd_operator._internal.precision import get_precision
from raysgd_operator._internal.stream import BatchStream, CallBatches, missing_loader_error
from raysgd_operator._internal.tensors import on_device
from raysgd_operator.batch import BATCH_SIZE
from raysgd_operator.components import Components, RankInfo
from raysgd_operator.flops import peak_flops_per_s
from raysgd_operator.metrics import BATCH_COUNT, NUM_SAMPLES, AverageMeterCollection
from raysgd_operator.operator import TrainingOperator
from raysgd_operator.options import TrainingOptions
from raysgd_operator.position import RunPosition
from raysgd_operator.progress import CallRecord
from raysgd_operator.state_io import StateIO
from raysgd_operator.throughput import worker_throughput

__all__ = ["OperatorRunner", "on_device"]


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
    (``num_steps`` continues where the last call stopped and wraps into a new epoch), the
    sampler's ``set_epoch``, profiling and the calls' metrics. Two parts beside the loop:
    `position` (`RunPosition`: the counters, the place in the epoch, the call in progress and the
    start of the accumulation window in progress) and `state` (`StateIO`: the state saved and
    loaded, whole, in parts and per rank). A `train_epoch` call interrupted by a failure can be
    continued, on the survivors and on workers that took over their state, from the start of the
    window the group was in (`call_id`), every batch of that window done again, and its metrics
    then count every step of the call once.

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
        self._before_step_hooks: list[Callable[[], None]] = []
        # Without a loader of its kind a stream is at position 0 with no epoch in progress, so that
        # the state and position of a runner that only validates (or whose own loop brings its
        # data) can be read; only drawing batches from it says what is missing.
        # The training stream tells this runner where its passes are (`pass_started`,
        # `step_finished`); validation passes count nothing.
        self._train = BatchStream(self.components, "train", listener=self)
        self._val = BatchStream(self.components, "validation")
        self.operator = operator_cls(config, components=self.components)
        #: Where this worker's training is (counters, place, call, window start).
        self.position = RunPosition(
            self.components, self.operator, self._train, self._val, self._before_step
        )
        #: This worker's state, saved and loaded.
        self.state = StateIO(self.components, self.operator, self.position)

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

    # -- told by the training stream (`PassListener`) ------------------------------------------
    def end_of_epoch_due(self, epoch: int | None) -> bool:
        """The training loop reached `epoch`'s last batch: True the first time only."""
        return self.position.end_of_epoch_due(epoch)

    def pass_started(self, resuming: bool) -> int:
        """A training pass begins: a new one is a new epoch."""
        return self.position.pass_started(resuming)

    def step_finished(self, rows: int | None) -> None:
        """A training batch is finished: the position moves on, then the step hooks run."""
        call = self.position.call
        own = call is None or call.steps >= 0  # not a step redone from before the call
        self.position.step_finished(rows, self._loop_time() if own else 0.0)
        if not own:
            # The call's own time begins where the steps redone from before it end.
            self._loop_base, self._loop_start = 0.0, time.perf_counter()
        for hook in self._step_hooks:
            hook()

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
        left it (see `RunPosition.adopt`) instead of starting again, and its metrics cover all of it.
        """
        op, pos = self.operator, self.position
        op.timers.enabled = profile
        op.timers.reset()
        call = pos.call
        # The same call again after it ended here (a peer was lost once this worker was done):
        # its record and metrics stand, and nothing is left to train.
        done = call is not None and call.finished and call_id is not None
        done = done and call.call_id == call_id
        if not done and (
            call is None or call.finished or call_id is None or call.call_id != call_id
        ):
            # A new call's own steps begin where training had got to: steps a recovery or a load
            # went back over are done again first, and are not the call's.
            start = max(pos.step, pos.trained_to)
            call = CallRecord(
                call_id=call_id, num_steps=num_steps, start_step=start, steps=pos.step - start
            )
            pos.meters = AverageMeterCollection()
        pos.call = call
        # The loop's time runs from here, where it starts drawing batches (a loader's first
        # batch of an epoch is part of it), and adds to the time of the steps the call kept.
        self._loop_base, self._loop_start = call.loop_s, time.perf_counter()
        meters = pos.meters
        remaining = call.remaining()
        meters.recording = pos.step >= call.start_step
        if not self._has_loader("train"):
            # A custom train_epoch may bring its own data; each call is then one epoch (which a
            # call going on after a failure does not start again).
            if call.epoch is None:
                pos.epoch += 1
                pos.call = call = dataclasses.replace(call, epoch=pos.epoch)
            batches: Any = _MissingLoader("train")
        elif (
            done
            or remaining == 0
            or (
                remaining is None
                and call.epoch is not None
                and pos.epoch >= call.epoch
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
                pos.call = call = dataclasses.replace(call, epoch=pos.epoch)
        call_info = {**self._base_info(num_steps), "epoch_idx": pos.epoch - 1, **(info or {})}
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
        pos.call = call = dataclasses.replace(pos.call, finished=not self.yielded, loop_s=loop_s)
        if pos.at_window_start:
            # What the loop did after its last batch belongs to the window start it ended at.
            pos.remark_window_start()
        metrics["epoch"] = pos.epoch
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

    def add_before_step_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` just before each optimizer step (so at the end of an accumulation
        window, once its gradients are whole), on the training thread. `StateIO.upcoming_rank_slot` is
        then what the window start after this batch will hold, unless the loop changes the
        generators or the per-rank state after the step."""
        self._before_step_hooks.append(hook)

    def _before_step(self) -> None:
        for hook in self._before_step_hooks:
            hook()

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` every time a training step is finished (after the counters moved and,
        at the end of a window, its successor's start was marked: see `RunPosition.at_window_start`)."""
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
        at_start = self.position.validation_started()
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
            self.position.remark_window_start()
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
            self.position.new_journal()
        # The pass in progress was split for the old group: the next one re-splits from the same
        # place (the caller then adopts the position the restore chose).
        position = self.position
        position.set_position(position.live_position(), pass_seed=self._train.pass_seed)
        self._val.reset()
        position.window = position.mark_window_start()
        return True

    def shutdown(self) -> None:
        """Drop the data iterators (and with them any DataLoader worker processes)."""
        self._train.reset()
        self._val.reset()
        self.position.window = self.position.mark_window_start()


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
