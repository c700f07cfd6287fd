"""The trainer's experiment loggers: built and started at construction, fed after every reduced
result, finished at shutdown. The only thing `TorchTrainer` knows of `raysgd.loggers`.

It owns the step (the number of `train()` calls so far), the epoch last reported, the recovery
events observed since the last result (`take`, subscribed to the recovery log: an event is passed
on with the result of the call it happened in, so it gets that call's step), and the rule that a
logger raising while training is reported once and dropped, so that a tracker's outage never stops
training.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from raysgd.loggers.logger import Logger, flatten_metrics, flatten_params
from raysgd.loggers.registry import resolve_loggers
from raysgd_base import call_with_accepted

__all__ = ["RunLoggers", "trainer_options"]

logger = logging.getLogger("raysgd")


def trainer_options(training: Any, group: Any, **settings: Any) -> dict[str, Any]:
    """The trainer's options as plain parameters: the fields of the workers' `TrainingOptions`
    and of their `GroupOptions` (its backend resolved), and `settings` (the trainer's own: size,
    failure policy, ...)."""
    fields: dict[str, Any] = {}
    for options in (group, training):
        fields.update(
            (f.name, getattr(options, f.name))
            for f in dataclasses.fields(options)
            if not f.name.startswith("_")
        )
    fields["backend"] = group.process_group_backend
    return flatten_params({**settings, **fields})


class RunLoggers:
    """The loggers of one trainer (private to `TorchTrainer`); falsy when there are none."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self._active: list[Logger] = list(loggers)
        self._step = 0
        self._epoch = 0
        self._pending: list[Any] = []  # recovery events not yet passed on

    @classmethod
    def start(
        cls,
        loggers: Optional[Sequence[Union[str, Logger]]],
        *,
        logdir: Optional[str],
        config: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> RunLoggers:
        """Resolve `loggers` (and `logdir`'s TensorBoard logger) and start each; a logger that
        fails to start fails this (the ones already started are finished first)."""
        run = cls(resolve_loggers(loggers, logdir=logdir))
        tried: list[Logger] = []
        try:
            for item in run._active:
                tried.append(item)
                item.start(dict(config), dict(options))
        except BaseException:
            RunLoggers(tried).finish(status="failed")  # the failed one too: it may hold half a run
            raise
        return run

    def __bool__(self) -> bool:
        return bool(self._active)

    @property
    def loggers(self) -> list[Logger]:
        """The loggers still recording (a failed one is dropped)."""
        return list(self._active)

    def take(self, event: Any) -> None:
        """Observe one recovery event (`RecoveryLog.subscribe`); it is passed on with the next
        result, whose call it happened in."""
        if self._active:
            self._pending.append(event)

    def amend(self, old: Any, new: Any) -> None:
        """Pass on `new` in place of `old` when `old` is still waiting for its result (a loss
        found to be a preemption at the end of its call)."""
        self._pending = [new if event is old else event for event in self._pending]

    def log(self, kind: str, result: Mapping[str, Any], *, num_workers: int) -> None:
        """Pass on one reduced `train`/`validate` result, after the recovery events taken since
        the last one (they happened in this call, so they get its step)."""
        if not self._active:
            return
        if kind == "train":
            self._step += 1
            epoch = result.get("epoch")
            if isinstance(epoch, int) and not isinstance(epoch, bool):
                self._epoch = epoch
        self._pass_events()
        metrics = flatten_metrics(result)
        metrics.setdefault("num_workers", float(num_workers))
        self._each("log_metrics", kind, metrics, epoch=self._epoch, step=self._step)

    def finish(self, *, status: str = "success") -> None:
        """Pass on the events not yet passed on, then finish every logger with `status`
        ("success", or "failed" when the trainer could not be built): each one's error is
        reported and the others are still finished."""
        self._pass_events()
        loggers, self._active = self._active, []
        for item in loggers:
            try:
                _finish(item, status)
            except Exception as exc:
                logger.warning("experiment logger %r failed to finish: %s", item, _describe(exc))

    def _pass_events(self) -> None:
        new, self._pending = self._pending, []
        for event in new:
            self._each("log_event", event, step=self._step)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for item in list(self._active):
            try:
                getattr(item, method)(*args, **kwargs)
            except Exception as exc:
                self._active.remove(item)
                logger.warning(
                    "experiment logger %r failed in %s and is dropped; training goes on "
                    "without it: %s",
                    item,
                    method,
                    _describe(exc),
                )
                try:
                    _finish(item, "failed")  # release what it holds (files, its run)
                except Exception:
                    logger.debug("finishing the dropped logger %r failed too", item, exc_info=True)


def _finish(item: Logger, status: str) -> None:
    """`item.finish(status)`, or `item.finish()` for a logger whose `finish` takes no status."""
    call_with_accepted(item.finish, {"status": status})


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
