"""The one private Ray call raysgd makes for preemption notices, isolated here.

Ray 2.60 tells which nodes are draining, and until when, only through
``ray._private.state.state.get_draining_nodes()``. `tests/core/test_drains.py` drains a real node
through this function and fails loudly when Ray moves or changes the call; `raysgd_core.drains`
degrades to "no notices" when it raises.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["read_draining_nodes"]


def read_draining_nodes() -> dict[str, Optional[float]]:
    """Draining nodes: node id (hex) -> deadline as a `time.time()` timestamp (None: no deadline).

    Raises whatever Ray raises when the call is gone or answers in another form.
    """
    from ray._private import state

    raw = state.state.get_draining_nodes()
    return {str(node): (ms / 1000.0 if ms else None) for node, ms in dict(raw).items()}
