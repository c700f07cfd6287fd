"""TensorBoard scalars of every `train`/`validate` result, written on the driver.

Writing on the driver (not in a worker) means one event file per trainer, from the already reduced
results, and no extra work or dependency on the workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ScalarLogger"]


def _flatten(prefix: str, values: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    for key, value in values.items():
        tag = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            # Nested dicts (the `profile` timers) become tags like train/profile/mean_fwd_s.
            yield from _flatten(tag, value)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            yield tag, float(value)
        elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            item = value.item()
            if isinstance(item, (int, float)) and math.isfinite(float(item)):
                yield tag, float(item)


class ScalarLogger:
    """Writes numeric results under `train/...` and `validate/...`, one step per call."""

    def __init__(self, logdir: str) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(
                "logdir= writes TensorBoard files with tensorboardX, which is not installed: "
                "pip install 'raysgd[tensorboard]'"
            ) from None
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self._writer = SummaryWriter(logdir=logdir)
        self._steps = {"train": 0, "validate": 0}

    def log(self, kind: str, result: Mapping[str, Any]) -> None:
        """Write every numeric value of `result` (a reduced train or validate result)."""
        self._steps[kind] = self._steps.get(kind, 0) + 1
        step = self._steps[kind]
        for tag, value in _flatten(kind, result):
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
