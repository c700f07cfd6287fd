"""`TrainingOperator`: the user's training components and the per-batch/per-epoch loops."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable
from typing import Any, Callable

import torch

from raysgd_operator._internal.base import OperatorBase
from raysgd_operator._internal.precision import Precision
from raysgd_operator._internal.stream import CallBatches
from raysgd_operator.components import Components
from raysgd_operator.creator import from_creators as _from_creators
from raysgd_operator.metrics import NUM_SAMPLES, AverageMeterCollection, TimerCollection
from raysgd_operator.options import TrainingOptions
from raysgd_operator.parallel_strategy import ParallelStrategy

__all__ = ["TrainingOperator"]


#: Seconds between progress-bar redraws when stderr is not a terminal.
_NON_TTY_BAR_INTERVAL_S = 30.0


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _rows(batch: Any) -> int | None:
    """The rows of a batch (its first tensor's first dimension), None when it has no tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)):
        return next((r for r in map(_rows, batch) if r is not None), None)
    if isinstance(batch, dict):
        return next((r for r in map(_rows, batch.values()) if r is not None), None)
    return None


def _counts_other_than_rows(num_samples: Any, batch: Any) -> bool:
    """Whether a batch's `num_samples` is plainly not its rows (tokens, say). A count given as
    a tensor is not read (that would wait for the device at every batch)."""
    rows = _rows(batch)
    return isinstance(num_samples, int) and rows is not None and num_samples != rows


def _own_loss(output: Any) -> torch.Tensor | None:
    """The loss in what a model that computes its own returned (see `TrainingOperator._forward`)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, (list, tuple)) and output:
        last = output[-1]
        return last if isinstance(last, torch.Tensor) and last.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


class _BarRate:
    """The group's samples (or tokens) per second for a progress bar's postfix, from rank 0's
    own counts: rank 0's count times the workers, over the time since the bar began. A count
    returned as a tensor is read here (a bar reads every batch's loss anyway)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.count = 0.0
        self.start = time.perf_counter()
        self.name = "samples/s"

    def add(self, num_samples: Any, counts_other_than_rows: bool) -> dict[str, str]:
        """Count one batch; the postfix entry of the rate so far."""
        if counts_other_than_rows:
            self.name = "tokens/s"
        self.count += float(num_samples)
        elapsed = time.perf_counter() - self.start
        if elapsed <= 0:
            return {}
        return {self.name: f"{self.count * self.world_size / elapsed:.4g}"}


def _length(iterator: Any) -> int | None:
    try:
        return len(iterator)
    except TypeError:
        return None


class TrainingOperator(OperatorBase):
    """Defines what one worker trains: subclass it and implement ``setup(config)``.

    The runner constructs the operator (users never call ``__init__``); the constructor stores the
    worker's settings and then calls ``setup(config)``, in which the user calls ``register`` and
    ``register_data``. The loops ``train_epoch``/``train_batch``/``validate``/``validate_batch`` and
    ``state_dict``/``load_state_dict`` may be overridden. Custom loops go through ``autocast``,
    ``backward``, ``clip_grad_norm`` and ``optimizer_step`` so that the precision backend (loss
    scaling, skipped steps) stays in charge.
    """

    def __init__(self, config: dict[str, Any], *, components: Components) -> None:
        """Called by the runner with this worker's `Components` (which the operator registers
        into); then runs ``setup(config)``."""
        self._init_registration(components)
        self.global_step = 0
        self.timers = TimerCollection()
        self.setup(config)

    @classmethod
    def from_creators(
        cls,
        model_creator: Callable[[dict[str, Any]], Any],
        optimizer_creator: Callable[[Any, dict[str, Any]], Any],
        data_creator: Callable[[dict[str, Any]], Any] | None = None,
        loss_creator: Any = None,
        scheduler_creator: Callable[[Any, dict[str, Any]], Any] | None = None,
        serialize_data_creation: bool = True,
    ) -> type[TrainingOperator]:
        """An operator class built from RaySGD creator functions (see `raysgd_operator.creator`)."""
        return _from_creators(
            cls,
            model_creator,
            optimizer_creator,
            data_creator,
            loss_creator,
            scheduler_creator,
            serialize_data_creation,
        )

    def setup(self, config: dict[str, Any]) -> None:
        """Create and ``register`` the models, optimizers, loss, schedulers and data."""
        raise NotImplementedError("TrainingOperator subclasses must implement setup(config)")

    # -- properties --------------------------------------------------------------------------
    @property
    def components(self) -> Components:
        """Everything this worker trains with (owned by the runner; see `Components`)."""
        return self._components

    @property
    def config(self) -> dict[str, Any]:
        """This worker's config (``BATCH_SIZE`` already split)."""
        return self._components.config

    @property
    def world_rank(self) -> int:
        """Rank of this worker among all workers."""
        return self._components.rank_info.world_rank

    @property
    def local_rank(self) -> int:
        """Rank of this worker among the workers on its node."""
        return self._components.rank_info.local_rank

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._components.rank_info.world_size

    @property
    def device(self) -> torch.device:
        """The device models and batches are put on."""
        return self._components.rank_info.device

    @property
    def device_ids(self) -> list[int] | None:
        """``[device.index]`` on a GPU (what DDP wants), else None."""
        return self._components.rank_info.device_ids

    @property
    def options(self) -> TrainingOptions:
        """All of this worker's training options (read-only)."""
        return self._components.options

    @property
    def use_gpu(self) -> bool:
        """Whether this worker trains on a GPU."""
        return self.options.use_gpu and torch.cuda.is_available()

    @property
    def use_fp16(self) -> Any:
        """The ``use_fp16`` choice the trainer was given."""
        return self.options.use_fp16

    @property
    def precision(self) -> Precision:
        """The precision backend (autocast, loss scaling, optimizer steps)."""
        return self._components.precision

    @property
    def use_tqdm(self) -> bool:
        """Whether progress bars are shown (on rank 0)."""
        return self.options.use_tqdm

    @property
    def strategy(self) -> ParallelStrategy:
        """How the models are spread over the workers (`ddp`, `fsdp`, `none`, ...)."""
        return self._components.strategy

    @property
    def scheduler_step_freq(self) -> str | None:
        """``"batch"``, ``"epoch"``, ``"manual"`` or None."""
        return self.options.scheduler_step_freq

    @property
    def accumulate_grad_batches(self) -> int:
        """Batches whose gradients are summed before each optimizer step."""
        return self.options.accumulate_grad_batches

    # Assignable, because an operator written for RaySGD may keep its own attribute of that name:
    # assigning stores the user's value for the user's reads and leaves the runner's loader alone.
    @property
    def train_loader(self) -> Any:
        """The registered training loader as the runner uses it (with its DistributedSampler when
        distributed), or None when none was registered."""
        return self._own_loaders.get("train", self._components.loaders.get("train"))

    @train_loader.setter
    def train_loader(self, value: Any) -> None:
        self._own_loaders["train"] = value

    @property
    def validation_loader(self) -> Any:
        """The registered validation loader as the runner uses it, or None."""
        return self._own_loaders.get("validation", self._components.loaders.get("validation"))

    @validation_loader.setter
    def validation_loader(self, value: Any) -> None:
        self._own_loaders["validation"] = value

    def get_dataset_shard(self, name: str) -> Any:
        """This worker's shard of the trainer's ``datasets[name]`` (a Ray Data ``DataIterator``), or
        None when the trainer was given no such dataset.

        The trainer feeds the ``"train"`` and ``"validation"`` shards to the loops itself; other
        names are for custom loops. After a resize or a recovery every worker gets a new shard, so
        fetch it when iterating rather than keeping the one seen in ``setup``.
        """
        return self._components.dataset_iterators.get(name)

    # -- helpers for custom loops ---------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for forward pass and loss under the precision backend."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """``loss.backward()`` through the backend (scaled when the backend scales)."""
        self.precision.backward(loss, optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Step ``optimizer`` (default: the first) through the backend; returns a truth value,
        false if the step was skipped (fp16's overflow check: asking for it waits for the device,
        not asking costs nothing).

        The batch in which a loop steps (or tries to: a skipped step counts) ends its
        accumulation window: a loop that accumulates gradients itself steps through here, or
        calls ``optimizer.step()``, and raysgd follows its windows without being told their size.
        """
        self._components.optimizer_steps += 1
        return self.precision.step(optimizer if optimizer is not None else self.optimizer)

    def clip_grad_norm(
        self, max_norm: float, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters to ``max_norm`` (unscaled first)."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.strategy.clip_grad_norm(params, max_norm, optimizer, self.precision)

    def no_sync(
        self, model: torch.nn.Module | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Context for batches after which the optimizer does not step: gradients stay local."""
        model = model if model is not None else self.model
        return self.strategy.no_sync(self._components.uncompiled(model))

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {key: self._to_device(value) for key, value in batch.items()}
        return batch

    def _progress(self, iterator: Any, desc: str) -> Any:
        """A tqdm bar on rank 0 when ``use_tqdm``; None otherwise."""
        if not (self.options.use_tqdm and self.world_rank == 0):
            return None
        from tqdm.auto import tqdm

        stream = sys.stderr
        interactive = "notebook" in getattr(tqdm, "__module__", "") or _is_tty(stream)
        if interactive:
            return tqdm(total=_length(iterator), desc=desc, unit="batch", leave=False, file=stream)
        # Not a terminal (a log file, a pipe, Ray's log forwarding): carriage-return redraws would
        # pile up as text, so redraw rarely and end the bar with its own line, so that whatever is
        # printed next (a metrics table) starts on a fresh line.
        return tqdm(
            total=_length(iterator),
            desc=desc,
            unit="batch",
            leave=True,
            file=stream,
            mininterval=_NON_TTY_BAR_INTERVAL_S,
        )

    # -- default loops -----------------------------------------------------------------------
    def train_epoch(self, iterator: Iterable[Any], info: dict[str, Any]) -> dict[str, Any]:
        """Train over ``iterator`` (this call's batches) and return the averaged metrics.

        Each batch's ``batch_info`` holds ``batch_idx`` (its place in this call: 0 for the call's
        first batch; a call that a recovery continues goes on counting), ``epoch_batch_idx`` (its
        place in its epoch: 0 for an epoch's first batch, however many calls, loads, resumes or
        recoveries the epoch took), ``epoch_idx`` (its epoch, 0 for the first), ``global_step``
        (batches trained since training began, which accumulation windows are aligned on) and the
        call's ``info``.

        Calls ``train_batch`` per batch, steps "batch" schedulers after each optimizer step and
        "epoch" schedulers after an epoch's last batch (once per epoch, however many calls it
        took; with batches other than the runner's, at the end of the call), and averages the returned dicts weighted by their ``num_samples``.
        The metrics go into the meters the runner hands over with the batches (``iterator.meters``),
        so that a call that goes on after a recovery reports all of its steps.
        Metrics returned as one-element tensors are read from the device once, at the end of the call
        (`AverageMeterCollection`), so the loop never waits for the GPU between batches.
        """
        for model in self._components.wrapped:
            model.train()
        meters = getattr(iterator, "meters", None)
        if meters is None:
            meters = AverageMeterCollection()
        first = getattr(iterator, "first_index", 0)
        epoch_name = str(info.get("epoch_idx", 0) + 1)
        if info.get("num_epochs"):
            epoch_name += f"/{info['num_epochs']}"
        bar = self._progress(iterator, f"{epoch_name}e")
        rate = _BarRate(self.world_size) if bar is not None else None
        # The runner's batches say where an epoch ends, however many calls it takes: "epoch"
        # schedulers step there. Batches of another kind end their epoch with the call.
        epoch_due = getattr(iterator, "end_of_epoch_due", None)
        try:
            for batch_idx, batch in enumerate(iterator, start=first):
                batch_info = {
                    "batch_idx": batch_idx,
                    "epoch_batch_idx": getattr(iterator, "epoch_batch_idx", batch_idx),
                    "global_step": self.global_step,
                    **info,
                }
                # The batch's own epoch: a call that a recovery took back into the epoch before
                # its own crosses into its own epoch on the way.
                epoch_idx = getattr(iterator, "epoch_idx", None)
                if epoch_idx is not None:
                    batch_info["epoch_idx"] = epoch_idx
                metrics = self.train_batch(batch, batch_info)
                # With accumulation the optimizer steps every k batches, and so does the schedule.
                stepped = (self.global_step + 1) % self.options.accumulate_grad_batches == 0
                if self.options.scheduler_step_freq == "batch" and stepped:
                    self._step_schedulers()
                if self.options.scheduler_step_freq == "epoch" and epoch_due is not None:
                    if epoch_due():
                        self._step_schedulers()
                num_samples = metrics.pop(NUM_SAMPLES, 1)
                other_than_rows = _counts_other_than_rows(num_samples, batch)
                if other_than_rows and isinstance(iterator, CallBatches):
                    iterator.counts_other_than_rows = True
                meters.update(metrics, n=num_samples)
                self.global_step += 1
                if bar is not None and rate is not None:
                    postfix: dict[str, Any] = {}
                    if "train_loss" in metrics:
                        # Reading the loss waits for the device: only with a bar to show it.
                        postfix["loss"] = float(metrics["train_loss"])
                    postfix.update(rate.add(num_samples, other_than_rows))
                    # No redraw of its own: `update` redraws at the bar's pace.
                    bar.set_postfix(postfix, refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        # A call stopped early to move workers goes on later: its epoch has not ended.
        if self.options.scheduler_step_freq == "epoch" and epoch_due is None:
            if not getattr(iterator, "yielded", False):
                self._step_schedulers()
        return meters.summary()

    def _step_schedulers(self) -> None:
        for scheduler in self._components.schedulers:
            scheduler.step()

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """One optimization step on ``batch`` (``*features, target``): returns the loss and sample count.

        ``train_loss`` is the detached loss tensor (``float()`` it if you need the number here).

        With ``accumulate_grad_batches=k`` the loss is divided by k and the optimizer steps every
        k-th global step; the batches in between skip the gradient sync (``no_sync``). A
        recovery, a load or a resume goes back to the start of the window it falls in, so every
        batch of a window is counted once.
        """
        model, optimizer = self.model, self.optimizer
        batch = self._to_device(batch)
        k = self.options.accumulate_grad_batches
        window_start = self.global_step % k == 0
        will_step = (self.global_step + 1) % k == 0
        sync = contextlib.nullcontext() if will_step else self.no_sync(model)
        if window_start:
            optimizer.zero_grad()
        with sync:
            with self.timers.record("fwd"), self.autocast():
                _, loss, rows = self._forward(model, batch)
            with self.timers.record("grad"):
                self.backward(loss / k if k > 1 else loss, optimizer)
        if will_step:
            with self.timers.record("apply"):
                if self.options.clip_grad_norm is not None:
                    self.clip_grad_norm(self.options.clip_grad_norm, optimizer)
                self.optimizer_step(optimizer)
        # The loss stays a tensor: `train_epoch` reads all of a call's losses in one transfer at the
        # end instead of waiting for the device after every batch.
        return {"train_loss": loss.detach(), NUM_SAMPLES: rows}

    def _forward(self, model: Any, batch: Any) -> tuple[Any, torch.Tensor, int]:
        """(the model's output, the loss, the batch's rows) of the default loops. With a
        registered criterion the batch is ``*features, target``: ``criterion(model(*features),
        target)``. Without one the model is given the whole batch (its items, or a dict's as
        keywords) and returns its own loss: a 0-dim tensor, a tuple or list ending with one
        (``logits, loss``), or a dict or an object (Hugging Face's outputs) with a ``loss``."""
        criterion = self.criterion
        if criterion is not None:
            *features, target = batch
            output = model(*features)
            return output, criterion(output, target), target.size(0)
        need = (
            "the default loops need a criterion (register(criterion=...)), or a model that takes "
            "the whole batch and returns its own loss: a 0-dim tensor, a tuple ending with one, "
            "or an object or dict with a 'loss'"
        )
        try:
            output = model(**batch) if isinstance(batch, dict) else model(*batch)
        except TypeError as exc:  # a model that does not take the targets
            raise RuntimeError(f"{need}; calling this one with the batch failed: {exc}") from exc
        loss = _own_loss(output)
        if loss is None:
            raise RuntimeError(f"{need}; this one returned {type(output).__name__}")
        return output, loss, _rows(batch) or 1

    def validate(self, val_iterator: Iterable[Any], info: dict[str, Any]) -> dict[str, Any]:
        """Evaluate over ``val_iterator`` without gradients; averaged ``validate_batch`` results."""
        for model in self._components.wrapped:
            model.eval()
        meters = AverageMeterCollection()
        bar = self._progress(val_iterator, "val")
        try:
            with torch.no_grad():
                for batch_idx, batch in enumerate(val_iterator):
                    metrics = self.validate_batch(batch, {"batch_idx": batch_idx, **info})
                    meters.update(metrics, n=metrics.pop(NUM_SAMPLES, 1))
                    if bar is not None:
                        if "val_loss" in metrics:
                            bar.set_postfix(loss=float(metrics["val_loss"]), refresh=False)
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return meters.summary()

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        """Loss and argmax accuracy on one batch (``*features, target``), as tensors (see
        ``train_batch``; a model that returns its own loss: the loss, and an accuracy of 0)."""
        batch = self._to_device(batch)
        with self.timers.record("eval_fwd"), self.autocast():
            output, loss, num_samples = self._forward(self.model, batch)
        # Tensors, read once per call by `validate` (see `train_batch`); float64 division of the
        # count gives exactly the float a Python ``correct / num_samples`` would.
        accuracy: Any = 0.0
        if self.criterion is not None and output.dim() > 1:
            target = batch[-1]
            accuracy = (output.argmax(dim=1) == target).sum().double() / num_samples
        return {"val_loss": loss.detach(), "val_accuracy": accuracy, NUM_SAMPLES: num_samples}

    # -- extra state -------------------------------------------------------------------------
    def state_dict(self) -> Any:
        """Extra operator state to checkpoint (models, optimizers and schedulers are saved anyway)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what ``state_dict`` returned."""
        return None

    def rank_state_dict(self) -> Any:
        """State that differs from worker to worker (a hidden state carried across batches, a
        stateful data iterator's position, a per-rank random stream): plain tensors and
        containers, as ``state_dict``. None (the default): there is none.

        Every rank's is saved in checkpoints (`save`, `checkpoint_every`, ``checkpoint="auto"``)
        and in ``fsdp``'s in-memory snapshots, and comes back through `load_rank_state_dict`:
        on a load, to the worker of the same rank; after a lost worker, a survivor keeps its
        own (restored with the snapshot under ``fsdp``), and its replacement gets the lost
        worker's where a snapshot or a checkpoint being restored holds it.
        """
        return None

    def load_rank_state_dict(self, state: Any) -> None:
        """Take back what `rank_state_dict` returned for this worker's place, or None: there is
        none for it (a replacement for a worker whose state went with it, a rank the saved run
        did not have), so this worker starts its own afresh."""
