"""The chaos soak's schedule of faults (`bench.chaos`): which, and when."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["KINDS", "Fault", "plan_faults"]

#: The faults, in the order a short run takes them (`plan_faults`).
KINDS = (
    "sigkill",
    "driver",
    "drain",
    "exit:after_step",
    "sigstop",
    "remove",
    "burst",
    "sigkill:checkpoint",
    "exit:forward",
    "exit:backward",
    "exit:step",
)
#: How the faults beyond one of each are drawn.
_EXTRA_WEIGHTS = {
    "sigkill": 5,
    "exit:forward": 1,
    "exit:backward": 1,
    "exit:step": 1,
    "exit:after_step": 1,
    "burst": 1,
    "sigstop": 1,
    "drain": 1,
    "remove": 1,
    "sigkill:checkpoint": 1,
}


@dataclass
class Fault:
    """One fault of the schedule: when (seconds from the start) and what; what happened to it.
    `eager_after_s`: injected that long after the fault before it, while the group is still
    recovering from that one (None: at `at_s`, once the group is whole)."""

    at_s: float
    kind: str
    injected_s: Optional[float] = None
    detail: dict[str, Any] = field(default_factory=dict)
    eager_after_s: Optional[float] = None


#: The share of the faults after the first that do not wait for the group to be whole.
EAGER_SHARE = 0.25


def plan_faults(
    count: int, duration_s: float, seed: int, kinds_allowed: tuple[str, ...] = KINDS
) -> list[Fault]:
    """`count` faults of `kinds_allowed` over the run: one of each kind first (in `KINDS` order
    when fewer), the rest drawn by `_EXTRA_WEIGHTS`; the driver's kill (once at most) in the
    middle, the others shuffled, each at a random moment of its own slot of the run (from 3% to
    93% of it)."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if k in kinds_allowed][:count]
    extra = [k for k in _EXTRA_WEIGHTS if k in kinds_allowed] or kinds
    weights = [_EXTRA_WEIGHTS.get(k, 1) for k in extra]
    if count > len(kinds):
        kinds += rng.choices(extra, weights, k=count - len(kinds))
    others = [k for k in kinds if k != "driver"]
    rng.shuffle(others)
    if "driver" in kinds:
        others.insert(len(others) // 2, "driver")
    start, span = 0.03 * duration_s, 0.9 * duration_s
    slot = span / max(1, len(others))
    faults = [
        Fault(round(start + i * slot + rng.uniform(0.15, 0.85) * slot, 1), kind)
        for i, kind in enumerate(others)
    ]
    # Some faults come while the group still recovers from the one before, right after it.
    for before, fault in zip(faults, faults[1:]):
        if fault.kind != "driver" and before.kind != "driver" and rng.random() < EAGER_SHARE:
            fault.eager_after_s = round(rng.uniform(1.0, 5.0), 1)
            fault.at_s = round(before.at_s + fault.eager_after_s, 1)
    return faults
