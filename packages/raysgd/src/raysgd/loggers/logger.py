"""The experiment-logger interface: what `TorchTrainer(loggers=[...])` calls, and when.

A logger records one training run in an experiment tracker (MLflow, Weights & Biases, TensorBoard,
CSV files, or your own). Only the driver (the process holding the `TorchTrainer`) calls it; nothing
runs on the workers. The trainer calls, in this order:

1. ``start(config, options)`` once, when the trainer is built and before any worker starts: the
   user's ``config`` and the trainer's options (``num_workers``, ``use_fp16``, ``strategy``, ...),
   to be recorded as the run's parameters.
2. ``log_metrics(kind, metrics, epoch=..., step=...)`` after every ``train()`` (kind ``"train"``)
   and ``validate()`` (kind ``"validate"``), with the result reduced over the workers: numbers only,
   nested dicts flattened with ``/`` (``profile/mean_fwd_s``), plus ``num_workers``, the number of
   workers that ran the call. ``step`` is the number of ``train()`` calls made so far (1 for the
   first; a ``validate()`` gets the step of the ``train()`` before it, 0 before any), so a run's
   train and validation curves share one x-axis and it never goes back. ``epoch`` is the epoch the
   last ``train()`` result reported.
3. ``log_event(event, step=...)`` for every new recovery event (`TorchTrainer.recovery_events`:
   objects with ``.kind`` -- "failure", "decision", "resize", "restart_failed", "user_error",
   "recovered", "preemption" -- and the other `EVENT_FIELDS`: ``.message``, ``.timestamp``,
   ``.duration_s``, ``.num_workers_before``, ``.num_workers_after``, ``.ranks``, ``.nodes``,
   ``.path``, ``.action``, ``.source``, ``.steps_redone``, ``.preempted``, ``.error``,
   ``.phases``), before the metrics of the call they happened in. `event_fields` gives them as
   plain values, `event_metrics` the numbers among them as metrics.
4. ``finish(status)`` once: ``"success"`` from `TorchTrainer.shutdown()`, ``"failed"`` when
   building the trainer failed at any point after ``start`` or when the logger itself is dropped
   after it raised (the built-in loggers then mark the run failed: MLflow's status FAILED, W&B's
   exit code 1). A logger whose ``finish`` takes no argument is called without it.

A logger that raises in any of these while training is reported once (a WARNING on the
``raysgd`` logger with the error) and dropped: training goes on without it. One that raises in
``start`` fails the trainer's construction (a wrong address or missing permission shows at once).
A logger's own optional library is imported in its constructor, so a missing one raises
ImportError there, with the command that installs it.

Inside a Ray Tune trial (`TorchTrainer.as_trainable(...)` or a function trainable that builds a
trainer), `current_trial()` says which trial this is: the built-in loggers make each trial its own
run and group the trials of one Tune experiment together.

A logger instance records one run: give each trainer its own.
"""

from __future__ import annotations

import abc
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "EVENT_FIELDS",
    "KINDS",
    "Logger",
    "TuneTrial",
    "current_trial",
    "event_fields",
    "event_metrics",
    "flatten_metrics",
    "flatten_params",
]

#: The `kind` values of `Logger.log_metrics`.
KINDS = ("train", "validate")


class Logger(abc.ABC):
    """An experiment logger; subclass it and implement `log_metrics` (the rest is optional).

    See the module docstring for when each method is called and with what.
    """

    #: Short name used in messages (and the registry name of the built-in loggers).
    name: str = "logger"

    def start(self, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:  # noqa: B027
        """Begin the run; record `config` (the trainer's `config=`) and `options` (the trainer's
        other settings, plain values) as its parameters. Called once, before any worker starts."""

    @abc.abstractmethod
    def log_metrics(
        self, kind: str, metrics: Mapping[str, float], *, epoch: int, step: int
    ) -> None:
        """Record one reduced `train()` (kind "train") or `validate()` (kind "validate") result.

        `metrics` holds numbers only (nested results flattened with "/", plus `num_workers`);
        `step` counts the `train()` calls so far and never decreases; `epoch` is the last epoch
        `train()` reported.
        """

    def log_event(self, event: Any, *, step: int) -> None:  # noqa: B027
        """Record one recovery event (a lost worker, a policy decision, a resize, ...) that
        happened at `step`. The default ignores it."""

    def finish(self, status: str = "success") -> None:  # noqa: B027
        """End the run: flush and close. Called once: with status "success" from
        `TorchTrainer.shutdown()`, with "failed" when the trainer's construction failed after
        `start` or when this logger is dropped after it raised."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class TuneTrial:
    """The Ray Tune trial this process runs (see `current_trial`).

    Attributes:
        trial_name: Tune's name of the trial (e.g. ``TorchTrainerTrainable_65f41_00000``).
        trial_id: Tune's id of the trial.
        group: What the trials of one Tune experiment share: the experiment's name (Tune's
            ``RunConfig(name=...)`` or the name it generated; the name of the experiment's
            directory), else, where neither Ray nor the trial's directory tells it, the trials'
            common name prefix (Tune's name without the trial's index).
        trial_dir: The trial's own directory, when known.
    """

    trial_name: str
    trial_id: str
    group: str
    trial_dir: Optional[str] = None


def current_trial() -> Optional[TuneTrial]:
    """The Tune trial running in this process, or None outside Tune.

    Ray Tune is never imported here: a process that has not imported it runs no trial.
    """
    if "ray.tune" not in sys.modules:
        return None
    try:
        from raysgd_tune import current_trial as tune_trial  # the optional extra raysgd[tune]
    except ImportError:
        return None
    info = tune_trial()
    if info is None or not info.trial_name:
        return None
    name = str(info.trial_name)
    group = info.experiment_name or _name_prefix(name)
    return TuneTrial(
        trial_name=name,
        trial_id=str(info.trial_id or name),
        group=str(group),
        trial_dir=info.trial_dir,
    )


def _name_prefix(trial_name: str) -> str:
    # Tune names trials "<trainable>_<run id>_<index>"; the trials of one run share the rest.
    head, _, index = trial_name.rpartition("_")
    return head if head and index.isdigit() else trial_name


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None  # a flag is not a metric
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or array
        return _number(value.item())
    return None


def flatten_metrics(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a (reduced) result, nested dicts flattened with "/": ``{"profile":
    {"mean_fwd_s": 0.1}}`` becomes ``{"profile/mean_fwd_s": 0.1}``. Non-numbers and bools are left
    out; NaN and infinities are kept (a diverging loss must show)."""
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, prefix=f"{name}/"))
            continue
        number = _number(value)
        if number is not None:
            flat[name] = number
    return flat


def _param_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    qualname = getattr(value, "__qualname__", None)
    if isinstance(qualname, str):  # a class or function: its importable name, not its repr
        return f"{getattr(value, '__module__', '?')}.{qualname}"
    return repr(value)


def flatten_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Parameters as plain values (None, bool, int, float or str), nested dicts flattened with
    "/"; classes and functions become their qualified names, anything else its repr."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}/"))
        else:
            flat[name] = _param_value(value)
    return flat


def event_fields(event: Any) -> dict[str, Any]:
    """The `EVENT_FIELDS` of a recovery event as plain values (ranks and nodes joined by spaces,
    `phases` as JSON text; a field the event lacks is None)."""
    fields = {}
    for field in EVENT_FIELDS:
        value = getattr(event, field, None)
        if isinstance(value, (tuple, list)):
            value = " ".join(str(v) for v in value)
        elif isinstance(value, Mapping):
            # One cell of a CSV row or one value of a JSON line: the mapping as JSON text.
            value = json.dumps(dict(value), sort_keys=True, default=str)
        fields[field] = value
    return fields


def event_metrics(event: Any) -> dict[str, float]:
    """The numbers a recovery event carries, as metrics named after its kind:
    ``recovery/<kind>_<field>`` for `duration_s`, `num_workers_before`, `num_workers_after` and
    `steps_redone` when set, and ``recovery/<kind>_phase_<phase>`` for each phase's seconds
    (``recovery/resize_steps_redone``, ``recovery/resize_phase_start_s``). Text, flags and the
    timestamp are not metrics: `event_fields` has them."""
    # Never "recovery/<kind>/...": MLflow's file store keeps a metric as a file at its name's
    # path, and "recovery/<kind>" (the count of that kind) is one.
    kind = str(getattr(event, "kind", "event"))
    values = {field: getattr(event, field, None) for field in _EVENT_NUMBERS}
    phases = getattr(event, "phases", None)
    if isinstance(phases, Mapping):
        values.update({f"phase_{name}": value for name, value in phases.items()})
    metrics = {}
    for name, value in values.items():
        number = _number(value)
        if number is not None:
            metrics[f"recovery/{kind}_{name}"] = number
    return metrics


#: The numeric recovery-event fields `event_metrics` records.
_EVENT_NUMBERS = ("duration_s", "num_workers_before", "num_workers_after", "steps_redone")

#: The recovery-event fields the built-in loggers record (`event_fields`): the plain fields of
#: the trainer's events, in their order.
EVENT_FIELDS = (
    "kind",
    "message",
    "timestamp",
    "duration_s",
    "num_workers_before",
    "num_workers_after",
    "ranks",
    "nodes",
    "path",
    "action",
    "source",
    "steps_redone",
    "preempted",
    "error",
    "phases",
)
