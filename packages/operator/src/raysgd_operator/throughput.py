"""Throughput of a `train()` call: samples (or tokens) per second, FLOP/s and MFU.

Every worker times its training loop in each call (`OperatorRunner.train_epoch`) and reports,
next to its metrics:

- ``loop_s``: the seconds the call's training loop ran, from drawing its first batch to the end
  of its last step, device work included (the device is synchronised once, at the end of the
  call: never per step). A call that goes on after a lost worker counts the time of the steps it
  kept (the time up to the step the group went on from, then the time after it); the recovery
  itself and the steps lost and done again are not counted (`goodput()` accounts for those).
- ``samples_per_s``: ``num_samples / loop_s``. When the batches count something other than their
  rows as ``num_samples`` (a language model's ``train_batch`` counting tokens), the same rate is
  called ``tokens_per_s`` instead.
- ``flops_per_s``: with the ``flops_per_sample`` option, that times the rate of ``num_samples``
  (the model's FLOPs, not the hardware's: a recomputed activation is not counted twice).
- ``mfu``: model FLOPs utilisation, ``flops_per_s`` over the device's peak (the
  ``peak_flops_per_s`` option, else `raysgd_operator.flops.peak_flops_per_s` of the device and the
  precision's compute dtype; on a CPU, or a GPU its table does not know, none unless the option
  gives it).

`group_throughput` combines the workers' into the group's, as `reduce_worker_results` reports
them: ``loop_s`` is the longest worker's (the group finishes with its slowest worker), the rates
are the whole group's count over that time, and ``mfu`` is the mean of the workers'
utilisations over it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any, Optional

__all__ = [
    "FLOPS_PER_S",
    "LOOP_S",
    "MFU",
    "SAMPLES_PER_S",
    "THROUGHPUT_KEYS",
    "TOKENS_PER_S",
    "group_throughput",
    "worker_throughput",
]

#: Metric key: seconds the call's training loop ran (see the module docstring).
LOOP_S = "loop_s"
#: Metric key: ``num_samples`` per second, when the batches count their rows.
SAMPLES_PER_S = "samples_per_s"
#: Metric key: ``num_samples`` per second, when the batches count something else (tokens).
TOKENS_PER_S = "tokens_per_s"
#: Metric key: the model's FLOPs per second (with the ``flops_per_sample`` option).
FLOPS_PER_S = "flops_per_s"
#: Metric key: model FLOPs utilisation, 0 to 1 (with a known peak).
MFU = "mfu"
#: Every key above: `reduce_worker_results` reduces them by `group_throughput`.
THROUGHPUT_KEYS = (LOOP_S, SAMPLES_PER_S, TOKENS_PER_S, FLOPS_PER_S, MFU)


def _number(value: Any) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def worker_throughput(
    num_samples: Any,
    loop_s: float,
    *,
    counts_rows: bool = True,
    flops_per_sample: Optional[float] = None,
    peak: Optional[float] = None,
) -> dict[str, float]:
    """One worker's throughput keys for a call in which it counted `num_samples` in `loop_s`
    seconds of training loop (see the module docstring): ``loop_s`` always; the rate, called
    ``samples_per_s`` (`counts_rows`) or ``tokens_per_s``, when there is a count and time;
    ``flops_per_s`` with `flops_per_sample`; ``mfu`` with both and a `peak` FLOP/s."""
    stats: dict[str, float] = {LOOP_S: float(loop_s)}
    if not _number(num_samples) or not loop_s > 0:
        return stats
    rate = float(num_samples) / loop_s
    stats[SAMPLES_PER_S if counts_rows else TOKENS_PER_S] = rate
    if flops_per_sample is not None:
        stats[FLOPS_PER_S] = flops_per_sample * rate
        if peak:
            stats[MFU] = stats[FLOPS_PER_S] / peak
    return stats


def group_throughput(
    results: Sequence[Mapping[str, Any]], num_samples: Optional[float] = None
) -> dict[str, float]:
    """The group's throughput keys from the workers' results of one call.

    ``loop_s`` is the longest worker's; the rate is the group's ``num_samples`` (`num_samples`,
    else the sum of the workers') over it; ``flops_per_s`` is the group's FLOPs over it; ``mfu``
    is the mean over the workers of each one's FLOPs over that time and its peak (the group's
    FLOPs over the summed peaks when every worker has the same device). A group count other than
    the workers' sum (a call that lost a worker: the rows the whole group trained) scales the
    FLOPs with it. Empty when no worker reported ``loop_s``.
    """
    timed = [r for r in results if _number(r.get(LOOP_S))]
    if not timed:
        return {}
    loop_s = max(float(r[LOOP_S]) for r in timed)
    stats: dict[str, float] = {LOOP_S: loop_s}
    counted = sum(float(r.get("num_samples", 0)) for r in timed if _number(r.get("num_samples")))
    total = counted if num_samples is None else float(num_samples)
    if not loop_s > 0:
        return stats
    # A worker's own FLOPs are its rate times its time; the group's count may differ from the
    # workers' sum (see above), which scales them.
    scale = total / counted if counted > 0 else 1.0
    if any(TOKENS_PER_S in r for r in timed):
        stats[TOKENS_PER_S] = total / loop_s
    elif any(SAMPLES_PER_S in r for r in timed):
        stats[SAMPLES_PER_S] = total / loop_s
    flops = [r for r in timed if _number(r.get(FLOPS_PER_S))]
    if flops:
        done = sum(float(r[FLOPS_PER_S]) * float(r[LOOP_S]) for r in flops)
        stats[FLOPS_PER_S] = scale * done / loop_s
    utilised = [r for r in timed if _number(r.get(MFU))]
    if utilised:
        values = [float(r[MFU]) * float(r[LOOP_S]) / loop_s for r in utilised]
        mean = math.fsum(values) / len(values)
        stats[MFU] = scale * mean
    return stats
