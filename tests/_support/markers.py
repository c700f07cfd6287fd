"""Markers in a folder that tell a test (or another rank) that a process reached a point.

Test modules and the functions they ship to Ray workers import it as ``tests._support.markers``
(the repository root is on every worker's path, see ``rows.py``). A marker is written under a
temporary name and renamed into place, so whoever sees it exists reads all of its content.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Union

#: How long `wait_for` waits by default: far past what any step takes on a loaded machine.
WAIT_S = 60.0


def mark(folder: Union[str, Path], name: str, content: str = "") -> None:
    """Write marker `name` in `folder` with `content`, atomically (rename of a written file)."""
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, name)
    temporary = f"{final}.{os.getpid()}.tmp"
    with open(temporary, "w") as handle:
        handle.write(content)
    os.replace(temporary, final)


def wait_for(folder: Union[str, Path], names: Iterable[str], timeout_s: float = WAIT_S) -> None:
    """Return once every marker in `names` exists in `folder`; TimeoutError naming the missing
    ones after `timeout_s` (a test relying on them would otherwise check something else)."""
    paths = [Path(folder, name) for name in names]
    deadline = time.monotonic() + timeout_s
    missing = [p for p in paths if not p.exists()]
    while missing and time.monotonic() < deadline:
        time.sleep(0.02)
        missing = [p for p in missing if not p.exists()]
    if missing:
        raise TimeoutError(f"after {timeout_s}s still missing: {[p.name for p in missing]}")


def read(folder: Union[str, Path], name: str, timeout_s: float = WAIT_S) -> str:
    """The content of marker `name` once it exists (written whole by `mark`)."""
    wait_for(folder, [name], timeout_s)
    return Path(folder, name).read_text()


def entering(folder: str) -> None:
    """On a worker: mark that this rank is about to enter a collective (see `wait_for_peers`)."""
    from raysgd_core import get_context

    mark(folder, f"entering-{get_context().world_rank}")


#: After every peer marked `entering`, how long a rank waits before it fails: a peer runs only a
#: few lines between its mark and blocking in the collective, which no marker can observe; this
#: is far more than they take on a loaded machine.
INSIDE_S = 1.0


def wait_for_peers(folder: str, ranks: Iterable[int] = ()) -> None:
    """On a worker: return once the peers (`ranks`, by default every other rank) are inside the
    collective they mark with `entering` in `folder`."""
    from raysgd_core import get_context

    ctx = get_context()
    peers = list(ranks) or [r for r in range(ctx.world_size) if r != ctx.world_rank]
    wait_for(folder, [f"entering-{r}" for r in peers])
    time.sleep(INSIDE_S)
