"""Which rows every worker process trained, kept in files that outlive a killed worker.

Test modules import it as ``tests._support.rows``: the suite runs from the repository root, which
is on the path of the driver and of every Ray worker, so workers import it as the driver does.

An operator calls `record_rows` once a step is finished (after its optimizer stepped); a test reads
every process's records back with `rows_by_epoch` and checks that each epoch trained every row once,
the rows of workers that died since included.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Union


def record_rows(folder: Optional[str], epoch: int, ids: Any) -> None:
    """Append this process's finished rows of `epoch` (an iterable of ids) under `folder`."""
    if not folder:
        return
    line = " ".join(f"{epoch}:{int(i)}" for i in ids)
    with open(os.path.join(folder, f"rows-{os.getpid()}.txt"), "a") as handle:
        handle.write(line + "\n")


def rows_by_epoch(folder: Union[str, Path]) -> dict[int, list[int]]:
    """Every recorded row id, by epoch, over all processes (a row trained twice appears twice)."""
    rows: dict[int, list[int]] = defaultdict(list)
    for path in Path(folder).glob("rows-*.txt"):
        for token in path.read_text().split():
            epoch, row = token.split(":")
            rows[int(epoch)].append(int(row))
    return dict(rows)


def writers(folder: Union[str, Path]) -> set[int]:
    """The ids of the processes that recorded rows under `folder`."""
    return {int(path.stem.split("-", 1)[1]) for path in Path(folder).glob("rows-*.txt")}
