"""Weights & Biases: one W&B run per trainer (offline by default: no account or network needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from raysgd.loggers.logger import (
    EVENT_FIELDS,
    Logger,
    current_trial,
    event_fields,
    event_metrics,
    flatten_params,
)

__all__ = ["WandbLogger"]

INSTALL_HINT = "pip install 'raysgd[wandb]'"
MODES = ("offline", "online", "disabled")
#: The history key of the table of recovery events.
EVENTS_KEY = "recovery/events"


class WandbLogger(Logger):
    """Metrics ``train/<metric>`` and ``validate/<metric>`` (and ``epoch``) at each call's step,
    the config and the trainer's options as the run's config (``config/<key>``,
    ``trainer/<option>``), recovery events as metrics (``recovery/<kind>``: how many of that kind
    so far; ``recovery/num_workers`` when the group's size changed; the event's numbers,
    `event_metrics`: ``recovery/resize_steps_redone``, ...) and whole, every field and the
    message, as the table ``recovery/events`` (one row an event, ``step`` first; logged again
    with each event, so the latest holds them all). `finish` ends the run with exit code 0, or 1
    (W&B: failed) when it ends by a failure (`finish` with status "failed").

    Args:
        project: The W&B project.
        mode: "offline" (default: the run is written under `dir` and uploaded later with
            ``wandb sync``), "online" (needs ``wandb login`` or ``WANDB_API_KEY``) or "disabled".
        dir: Where W&B writes the run (its ``wandb/`` folder); default: W&B's (the working
            directory).
        group: The run's group. Default: none; in a Ray Tune trial, the Tune experiment's name
            (`TuneTrial.group`), so that the trials of one Tune run are grouped together.
        name: The run's name. Default: W&B's; in a Tune trial, the trial's name.
        **init_kwargs: Anything else `wandb.init` takes (``entity``, ``tags``, ``notes``,
            ``settings``, ...). Unless given, ``reinit="create_new"``, so several trainers in one
            process each get their own run.

    Raises:
        ImportError: wandb is not installed (``pip install 'raysgd[wandb]'``).
    """

    name = "wandb"

    def __init__(
        self,
        project: str = "raysgd",
        mode: str = "offline",
        dir: Optional[str] = None,
        *,
        group: Optional[str] = None,
        name: Optional[str] = None,
        **init_kwargs: Any,
    ) -> None:
        if not isinstance(project, str) or not project:
            raise TypeError(f"project must be a non-empty str, got {project!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ImportError(
                f"WandbLogger needs wandb, which is not installed: {INSTALL_HINT}"
            ) from None
        self.project = project
        self.mode = mode
        self.dir = None if dir is None else os.fspath(dir)
        self.group = group
        self.run_name = name
        self.init_kwargs = dict(init_kwargs)
        self.run: Any = None
        self._event_counts: dict[str, int] = {}
        self._events: list[list[Any]] = []

    def start(self, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        import wandb

        trial = current_trial()
        group, name = self.group, self.run_name
        if trial is not None:
            group = group or trial.group
            name = name or trial.trial_name
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        kwargs = {"reinit": "create_new", **self.init_kwargs}
        self.run = wandb.init(
            project=self.project,
            mode=self.mode,
            dir=self.dir,
            group=group,
            name=name,
            # Plain values only: W&B stores the config as JSON.
            config=flatten_params({"config": dict(config), "trainer": dict(options)}),
            **kwargs,
        )
        self._event_counts, self._events = {}, []

    def log_metrics(
        self, kind: str, metrics: Mapping[str, float], *, epoch: int, step: int
    ) -> None:
        values = {f"{kind}/{key}": value for key, value in metrics.items()}
        self.run.log({**values, "epoch": epoch}, step=step)

    def log_event(self, event: Any, *, step: int) -> None:
        import wandb

        kind = str(event.kind)
        self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
        values: dict[str, Any] = {f"recovery/{kind}": self._event_counts[kind]}
        values.update(event_metrics(event))
        after = getattr(event, "num_workers_after", None)
        if after is not None:
            values["recovery/num_workers"] = after
        fields = event_fields(event)
        self._events.append([step, *(fields[name] for name in EVENT_FIELDS)])
        # A W&B table cannot grow once logged: the whole list each time (the events are few).
        values[EVENTS_KEY] = wandb.Table(
            columns=["step", *EVENT_FIELDS],
            data=[list(row) for row in self._events],
            # A column's cells are None for the kinds that lack the field: never a type error.
            allow_mixed_types=True,
        )
        self.run.log(values, step=step)

    def finish(self, status: str = "success") -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1 if status == "failed" else 0)

    def __repr__(self) -> str:
        return f"WandbLogger(project={self.project!r}, mode={self.mode!r}, dir={self.dir!r})"
