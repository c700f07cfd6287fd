"""Per-batch metric averaging, reduction across workers, and profiling timers (RaySGD semantics)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from numbers import Number
from typing import Any, Optional

import torch

from raysgd_operator.throughput import THROUGHPUT_KEYS, group_throughput

__all__ = [
    "BATCH_COUNT",
    "NUM_SAMPLES",
    "AverageMeter",
    "AverageMeterCollection",
    "MetersMark",
    "TimerCollection",
    "reduce_worker_results",
]

#: Metric key: how many samples the reported averages cover (summed across workers).
NUM_SAMPLES = "num_samples"
#: Metric key: how many batches a worker ran (averaged across workers).
BATCH_COUNT = "batch_count"


class AverageMeter:
    """Running sample-weighted mean of one value; ``val`` is the last value seen."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every value."""
        self.val: float = 0.0
        self.sum: float = 0.0
        self.count: int = 0
        self.avg: float = 0.0

    def update(self, val: float, n: int = 1) -> None:
        """Add ``val`` observed over ``n`` samples (NaN propagates into ``avg`` on purpose)."""
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count if self.count else 0.0


#: Tensor metrics read back in one transfer at the latest after this many batches, so that a very
#: long call keeps a bounded number of them alive.
_MAX_PENDING = 1024


def _is_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _read_scalars(tensors: list[torch.Tensor]) -> list[Any]:
    """The Python numbers of one-element tensors, as ``.item()`` gives them, in one transfer.

    Stacking them and reading the stack once costs one device synchronisation instead of one per
    tensor; ``tolist`` converts every element exactly as ``item`` would.
    """
    first = tensors[0]
    if all(t.dtype == first.dtype and t.device == first.device for t in tensors):
        return torch.stack([t.detach().reshape(()) for t in tensors]).tolist()
    return [t.item() for t in tensors]


@dataclass(frozen=True)
class MetersMark:
    """An `AverageMeterCollection` as it was at one point (`AverageMeterCollection.mark`)."""

    batch_count: int
    n: int
    #: key -> the meter's (val, sum, count, avg) then.
    meters: dict[str, tuple[Any, float, int, float]]
    #: key -> (the list of values not read yet then, its length then).
    pending: dict[str, tuple[list[tuple[torch.Tensor, Any]], int]]


class AverageMeterCollection:
    """One `AverageMeter` per metric key, fed with the dicts a ``train_batch`` returns.

    ``summary()`` gives ``batch_count``, ``num_samples`` (the sum of the ``n`` passed to ``update``),
    each key's sample-weighted mean and ``last_<key>`` (the value of the last batch).

    A metric given as a one-element tensor (the default loops return the loss that way) is not read
    at once: reading a CUDA tensor waits for the GPU, and doing that every batch stalls the
    pipeline. Such values are kept and read together, in one transfer, by ``summary()`` (or every
    ``_MAX_PENDING`` batches), which then averages them exactly as if they had been numbers. So a
    tensor must not be modified in place after it was passed to ``update``.
    """

    def __init__(self) -> None:
        #: While False, `update` records nothing (the runner turns it off for steps that a
        #: recovery redoes from before the call they are redone in).
        self.recording = True
        self._batch_count = 0
        self.n = 0
        self._meters: dict[str, AverageMeter] = {}
        # key -> [(tensor, n)] not yet read from the device, in batch order.
        self._pending: dict[str, list[tuple[torch.Tensor, Any]]] = {}

    def update(self, metrics: Mapping[str, Any], n: int = 1) -> None:
        """Record one batch's ``metrics`` (numbers or one-element tensors) over ``n`` samples."""
        if not self.recording:
            return
        self._batch_count += 1
        self.n += n
        for key, value in metrics.items():
            meter = self._meters.get(key)
            if meter is None:
                meter = self._meters[key] = AverageMeter()
            if _is_scalar_tensor(value):
                pending = self._pending.setdefault(key, [])
                pending.append((value.detach(), n))
                if len(pending) >= _MAX_PENDING:
                    self._flush(key)
            else:
                if key in self._pending:
                    self._flush(key)  # keep the batch order: ``val`` is the last batch's value
                meter.update(value, n=n)

    def _flush(self, key: str) -> None:
        pending = self._pending.pop(key, None)
        if not pending:
            return
        meter = self._meters[key]
        for value, n in zip(_read_scalars([t for t, _ in pending]), (n for _, n in pending)):
            meter.update(value, n=n)

    @property
    def counts(self) -> tuple[int, float]:
        """(batches recorded, the sum of their ``n``): what ``summary()`` gives as ``batch_count``
        and ``num_samples``."""
        return self._batch_count, self.n

    def count_from(self, batches: int, n: float) -> None:
        """Count on from `batches` and `n` (another worker's counts, for the same share of the
        work, which this one goes on with); the metrics' averages stay this collection's."""
        self._batch_count, self.n = batches, n

    def snapshot(self) -> AverageMeterCollection:
        """A copy of the metrics so far, all read from the device (one transfer): a copy taken
        with a recovery snapshot, so that a restore can go on from those metrics."""
        for key in list(self._pending):
            self._flush(key)
        copy = AverageMeterCollection()
        copy._batch_count, copy.n = self._batch_count, self.n
        for key, meter in self._meters.items():
            twin = copy._meters[key] = AverageMeter()
            twin.val, twin.sum, twin.count, twin.avg = meter.val, meter.sum, meter.count, meter.avg
        return copy

    def mark(self) -> MetersMark:
        """Where the metrics stand now, for `rewind` (nothing is read from the device: the
        values not read yet are kept by reference)."""
        return MetersMark(
            self._batch_count,
            self.n,
            {key: (m.val, m.sum, m.count, m.avg) for key, m in self._meters.items()},
            {key: (pending, len(pending)) for key, pending in self._pending.items()},
        )

    def rewind(self, mark: MetersMark) -> None:
        """Forget every batch recorded since `mark` (batches a recovery does again)."""
        self._batch_count, self.n = mark.batch_count, mark.n
        self._meters = {}
        for key, (val, total, count, avg) in mark.meters.items():
            meter = self._meters[key] = AverageMeter()
            meter.val, meter.sum, meter.count, meter.avg = val, total, count, avg
        # A list of values not read yet only grows until it is read (`_flush` replaces it), so
        # its first entries are still those it had at the mark.
        self._pending = {key: pending[:length] for key, (pending, length) in mark.pending.items()}

    def merge(self, other: AverageMeterCollection) -> None:
        """Add `other`'s batches to these (the metrics of a worker that is no longer there)."""
        self._batch_count += other._batch_count
        self.n += other.n
        for key in list(other._pending):
            other._flush(key)
        for key, meter in other._meters.items():
            mine = self._meters.setdefault(key, AverageMeter())
            mine.sum += meter.sum
            mine.count += meter.count
            mine.avg = mine.sum / mine.count if mine.count else 0.0
            if not mine.count - meter.count:
                mine.val = meter.val

    def summary(self) -> dict[str, Any]:
        """The averaged metrics of every batch so far."""
        for key in list(self._pending):
            self._flush(key)
        stats: dict[str, Any] = {BATCH_COUNT: self._batch_count, NUM_SAMPLES: self.n}
        for key, meter in self._meters.items():
            stats[key] = meter.avg
            stats[f"last_{key}"] = meter.val
        return stats


def _is_number(value: Any) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


# Keys that are counters rather than per-sample quantities: a plain mean across workers.
_PLAIN_MEAN_KEYS = (BATCH_COUNT, "epoch")


def reduce_worker_results(
    results: list[dict[str, Any]], num_samples: Optional[float] = None
) -> dict[str, Any]:
    """Combine per-worker metric dicts into one.

    ``num_samples`` is summed; ``batch_count`` and ``epoch`` are averaged plainly; every other number
    (``last_*`` included) is averaged weighted by each worker's ``num_samples``, so that a worker that
    saw more samples counts more; a NaN on any worker makes that key NaN. Anything else (the
    ``profile`` dict, strings) is taken from worker 0. The throughput keys (``loop_s``,
    ``samples_per_s`` or ``tokens_per_s``, ``flops_per_s``, ``mfu``) are the group's: the longest
    worker's loop time, and the group's count over it (`raysgd_operator.throughput`).

    `num_samples`, when given, is the group's count instead of the workers' sum (the rows a call
    that lost a worker trained, those of the lost worker included); the rates are computed from it.
    """
    if not results:
        raise ValueError("reduce_worker_results needs at least one worker result")
    weights = [float(r.get(NUM_SAMPLES, 1)) for r in results]
    # Rates do not average: the group's count over the group's time.
    group = group_throughput(results, num_samples)
    timed = bool(group)
    reduced: dict[str, Any] = {}
    for key, first in results[0].items():
        values = [r[key] for r in results if key in r]
        if key in group:
            reduced[key] = group.pop(key)
        elif not all(_is_number(v) for v in values):
            reduced[key] = first
        elif key == NUM_SAMPLES:
            reduced[key] = sum(values) if num_samples is None else num_samples
        elif key in _PLAIN_MEAN_KEYS:
            # Keep an int when every worker agrees (the usual case for ``epoch``).
            reduced[key] = first if all(v == first for v in values) else sum(values) / len(values)
        elif timed and key in THROUGHPUT_KEYS:
            continue  # worker 0's rate under the name the group's does not have
        else:
            pairs = [(float(r[key]), w) for r, w in zip(results, weights) if key in r]
            if any(math.isnan(v) for v, _ in pairs):
                reduced[key] = float("nan")
                continue
            total = sum(w for _, w in pairs)
            if total > 0:
                reduced[key] = sum(v * w for v, w in pairs) / total
            else:
                reduced[key] = sum(v for v, _ in pairs) / len(pairs)
    reduced.update(group)  # a key worker 0 did not report (another worker's name for the rate)
    return reduced


_NO_TIMER = contextlib.nullcontext()


class TimerCollection:
    """Named wall-clock timers for ``profile=True``; ``record`` does nothing while disabled."""

    def __init__(self) -> None:
        self.enabled = False
        self._samples: dict[str, list[float]] = {}

    def reset(self) -> None:
        """Drop every sample (done at the start of each train/validate call)."""
        self._samples = {}

    def record(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Time the ``with`` body under ``key``."""
        # The loops enter three of these per batch: while disabled they cost one shared object.
        return self._record(key) if self.enabled else _NO_TIMER

    @contextlib.contextmanager
    def _record(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._samples.setdefault(key, []).append(time.perf_counter() - start)

    def stats(self) -> dict[str, float]:
        """``{"mean_<key>_s": mean seconds}`` for every timer that recorded something."""
        return {f"mean_{k}_s": sum(v) / len(v) for k, v in self._samples.items() if v}
