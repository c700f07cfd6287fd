"""TensorBoard event files (what `TorchTrainer(logdir=...)` writes), through tensorboardX."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from raysgd.loggers._paths import run_directory
from raysgd.loggers.logger import Logger, event_metrics, flatten_params

__all__ = ["TensorBoardLogger"]

INSTALL_HINT = "pip install 'raysgd[tensorboard]'"


class TensorBoardLogger(Logger):
    """Scalars ``train/<metric>`` and ``validate/<metric>`` at each call's step, the config and
    options as one text summary, and recovery events as text under ``recovery/<kind>`` (with a
    ``recovery/num_workers`` scalar when an event changes the group's size, and the event's
    numbers as scalars, `event_metrics`: ``recovery/resize_steps_redone``, ...).

    Args:
        logdir: Directory of the event files (created); in a Tune trial, its subdirectory named
            after the trial. View with ``tensorboard --logdir <logdir>``.

    Raises:
        ImportError: tensorboardX is not installed (``pip install 'raysgd[tensorboard]'``).
    """

    name = "tensorboard"

    def __init__(self, logdir: str = "raysgd_logs") -> None:
        if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
            raise TypeError(f"logdir must be a directory path, got {logdir!r}")
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ImportError(
                f"TensorBoardLogger (and logdir=) writes with tensorboardX, which is not "
                f"installed: {INSTALL_HINT}"
            ) from None
        self.logdir = os.fspath(logdir)
        self.run_dir: Optional[str] = None
        self._writer: Any = None

    def start(self, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.run_dir = run_directory(self.logdir)
        os.makedirs(self.run_dir, exist_ok=True)
        self._writer = SummaryWriter(logdir=self.run_dir)
        params = flatten_params({"config": dict(config), "trainer": dict(options)})
        table = "\n".join(f"| {key} | {value!r} |" for key, value in params.items())
        self._writer.add_text("parameters", "| name | value |\n|---|---|\n" + table, 0)

    def log_metrics(
        self, kind: str, metrics: Mapping[str, float], *, epoch: int, step: int
    ) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{kind}/{key}", value, global_step=step)
        # One event file read live by TensorBoard: make every call's scalars visible at once.
        self._writer.flush()

    def log_event(self, event: Any, *, step: int) -> None:
        self._writer.add_text(f"recovery/{event.kind}", str(event.message), step)
        after = getattr(event, "num_workers_after", None)
        if after is not None:
            self._writer.add_scalar("recovery/num_workers", after, global_step=step)
        for key, value in event_metrics(event).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self, status: str = "success") -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardLogger(logdir={self.logdir!r})"
