"""CSV files, one per kind of record: no dependency, readable by anything."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from raysgd.loggers._paths import run_directory
from raysgd.loggers.logger import EVENT_FIELDS, Logger, event_fields, flatten_params

__all__ = ["CSVLogger"]


class CSVLogger(Logger):
    """One CSV file per kind of record in `directory`:

    - ``train.csv`` and ``validate.csv``: one row per call, columns ``step``, ``epoch``, then the
      metrics in the order they first appeared. When a call brings a new metric the file is
      rewritten with the wider header (earlier rows get an empty cell there).
    - ``events.csv``: one row per recovery event: ``step`` and the event's fields (``kind``,
      ``message``, ``timestamp``, ``num_workers_before``, ``num_workers_after``, ...).
    - ``params.csv``: ``name,value`` rows of the config (``config/<key>``) and the trainer's
      options (``trainer/<option>``), written at start.

    A run starts these files afresh: files of an earlier run in the same directory are replaced.
    Every row is flushed when written.

    Args:
        directory: Where the files go (created); in a Tune trial, its subdirectory named after the
            trial.
    """

    name = "csv"

    def __init__(self, directory: str = "raysgd_logs") -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(f"directory must be a directory path, got {directory!r}")
        self.directory = os.fspath(directory)
        self.run_dir: Optional[str] = None
        self._headers: dict[str, list[str]] = {}

    def start(self, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        self.run_dir = run_directory(self.directory)
        os.makedirs(self.run_dir, exist_ok=True)
        for name in ("train", "validate", "events"):
            path = self._path(name)
            if os.path.exists(path):
                os.remove(path)
        self._headers = {"events": ["step", *EVENT_FIELDS]}
        params = flatten_params({"config": dict(config), "trainer": dict(options)})
        self._write(
            self._path("params"),
            ["name", "value"],
            [{"name": k, "value": v} for k, v in params.items()],
        )

    def log_metrics(
        self, kind: str, metrics: Mapping[str, float], *, epoch: int, step: int
    ) -> None:
        self._append(kind, {"step": step, "epoch": epoch, **metrics})

    def log_event(self, event: Any, *, step: int) -> None:
        self._append("events", {"step": step, **event_fields(event)})

    def _path(self, name: str) -> str:
        assert self.run_dir is not None, "start() first"
        return os.path.join(self.run_dir, f"{name}.csv")

    def _append(self, name: str, row: Mapping[str, Any]) -> None:
        path = self._path(name)
        header = self._headers.get(name)
        if header is None or not os.path.exists(path):
            header = list(row) if header is None else header
            header += [key for key in row if key not in header]
            self._headers[name] = header
            self._write(path, header, [row])
            return
        new_keys = [key for key in row if key not in header]
        if new_keys:
            # A wider header: the file is rewritten whole (rows are few, one per call).
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            header = header + new_keys
            self._headers[name] = header
            self._write(path, header, [*rows, row])
            return
        with open(path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=header).writerow(row)

    @staticmethod
    def _write(path: str, header: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
        # Written beside the file and renamed over it: a reader never sees half a file.
        tmp = f"{path}.tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(header))
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)

    def __repr__(self) -> str:
        return f"CSVLogger(directory={self.directory!r})"
