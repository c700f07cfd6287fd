"""Where workers go: one placement group per WorkerGroup, or a borrowed one (a Tune trial's).

Every remote worker occupies a *slot*: a bundle of a placement group (or "any bundle with room" of a
borrowed group). `start()` makes one group with a bundle per worker, so the strategy (SPREAD, PACK,
...) holds for the whole set. Workers added later by `recover` first reuse free bundles (a killed
actor gives its bundle back to the group, not to the cluster), then get a one-bundle group each, so
that each of them starts or not on its own and the group can be sized by what actually starts.

A free bundle that sits on a node Ray is draining (see `raysgd_core.drains`) is set aside rather
than reused: a worker placed there would go down with the node. It is reused once the bundle is
somewhere else (Ray places a lost node's bundles again when it has room) or the drain is over.
Until then, and from then until a new worker takes it, it holds one worker's resources that no
worker uses: Ray can remove a placement group but not one bundle of it.

The slot of a worker killed because it stopped answering is held back until its process is known
to be gone (the call it did not answer comes back failed): on a frozen or partitioned node that
takes as long as Ray's health checks, and a worker placed in the slot meanwhile would never start;
on a live node Ray kills a stopped process within seconds, and the slot is used again. New workers
get new one-bundle groups in the meantime.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "Slot",
    "SlotPool",
    "bundle_node",
    "describe_free_resources",
    "describe_request",
    "estimate_fitting",
    "format_resources",
    "make_bundle",
    "wait_removed",
]

logger = logging.getLogger("raysgd_core")


def make_bundle(num_cpus: float, num_gpus: float, resources: Optional[dict[str, float]]) -> dict:
    """One worker's resource bundle (zero entries left out: Ray rejects empty or zero bundles)."""
    bundle = {k: float(v) for k, v in (resources or {}).items() if v}
    if num_cpus:
        bundle["CPU"] = float(num_cpus)
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    return bundle


def describe_request(n: int, bundle: dict, strategy: str) -> str:
    """E.g. '4 workers x {CPU: 1} (SPREAD)'."""
    return f"{n} workers x {format_resources(bundle)} ({strategy})"


def describe_free_resources() -> str:
    """What the cluster has free and in total, without Ray's internal node/group keys."""
    import ray

    def clean(res: dict) -> dict:
        return {
            k: v
            for k, v in res.items()
            if not k.startswith("node:")
            and "_group_" not in k
            and k not in ("memory", "object_store_memory")
        }

    free = format_resources(clean(ray.available_resources()))
    return f"free {free} of {format_resources(clean(ray.cluster_resources()))}"


def format_resources(res: dict) -> str:
    """E.g. '{CPU: 1, GPU: 1}' (whole numbers without a decimal point)."""
    items = ", ".join(
        f"{k}: {int(v) if float(v).is_integer() else v}" for k, v in sorted(res.items())
    )
    return "{" + items + "}"


@dataclass(eq=False)
class Slot:
    """Room for one worker: bundle `bundle_index` of `pg` (-1: any bundle with room)."""

    pg: Any
    bundle_index: int
    owned: bool  # this WorkerGroup created `pg` and must remove it
    single: bool  # `pg` holds only this slot (can be removed when the slot is free)

    def strategy(self) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_index,
        )


class SlotPool:
    """The slots of one WorkerGroup and the placement groups behind them."""

    def __init__(self, bundle: dict, strategy: str, borrowed: Any = None) -> None:
        self.bundle = bundle
        self.strategy_name = strategy
        self.borrowed = borrowed  # a placement group we may use but never remove
        self.free: list[Slot] = []
        #: Free bundles on draining nodes, not handed out until they are elsewhere.
        self.parked: list[Slot] = []
        #: Slots of workers killed for not answering, each with a ref that resolves (to an
        #: error) once the worker's process is gone; not handed out until then.
        self.exiting: list[tuple[Slot, Any]] = []
        self.owned_pgs: list[Any] = []

    def create_main(self, bundles: list[dict]) -> list[Slot]:
        """All slots for `start()`: one placement group with the given bundles, or borrowed ones."""
        if self.borrowed is not None:
            return [Slot(self.borrowed, -1, owned=False, single=False) for _ in bundles]
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles, strategy=self.strategy_name)
        self.owned_pgs.append(pg)
        return [Slot(pg, i, owned=True, single=False) for i in range(len(bundles))]

    def acquire(self) -> Slot:
        """A slot for one more worker: a free bundle off draining nodes first, else a new
        one-bundle group (which Ray does not place on a draining node)."""
        if self.borrowed is not None:
            return Slot(self.borrowed, -1, owned=False, single=False)
        self.refresh()
        if self.free:
            return self.free.pop(0)
        from ray.util.placement_group import placement_group

        pg = placement_group([self.bundle], strategy="PACK")
        self.owned_pgs.append(pg)
        return Slot(pg, 0, owned=True, single=True)

    def release(self, slot: Slot, *, exit_ref: Any = None) -> None:
        """Give a slot back: a one-bundle group is removed (its resources go back to the cluster),
        a bundle of the main group is kept for the next worker. `exit_ref`: the worker was killed
        for not answering and may still hold the slot; the ref resolves once it is gone."""
        if not slot.owned:
            return
        if slot.single:
            self._remove(slot.pg)
        elif exit_ref is not None:
            self.exiting.append((slot, exit_ref))
        elif slot not in self.free:
            self.free.append(slot)

    def refresh(self) -> None:
        """Set aside the free bundles on draining nodes; take back those that moved off them
        (Ray placed a lost node's bundle elsewhere, or the drain is over) and those whose killed
        worker is gone."""
        self._take_back_exited()
        if not self.free and not self.parked:
            return
        from raysgd_core.drains import draining_nodes

        draining = draining_nodes()
        if not draining and not self.parked:
            return
        was_parked = self.parked
        candidates = self.free + self.parked
        self.free, self.parked = [], []
        for slot in candidates:
            node = bundle_node(slot)
            usable = node is not None and node not in draining
            if usable and slot in was_parked:
                logger.info(
                    "A free bundle of the workers' placement group left a draining node and is "
                    "reserved on node %s until the group's next new worker takes it (Ray cannot "
                    "remove one bundle of a placement group)",
                    node,
                )
            (self.free if usable else self.parked).append(slot)

    def _take_back_exited(self) -> None:
        if not self.exiting:
            return
        import ray

        refs = [ref for _, ref in self.exiting]
        gone, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for slot, ref in list(self.exiting):
            if ref in gone:
                self.exiting.remove((slot, ref))
                self.free.append(slot)

    def remove_all(self) -> list[Any]:
        """Remove every placement group this pool created (killing anything still in them).

        Returns the groups whose removal was asked for (see `wait_removed`)."""
        removed = [pg for pg in list(self.owned_pgs) if self._remove(pg)]
        self.free.clear()
        self.parked.clear()
        self.exiting.clear()
        return removed

    def _remove(self, pg: Any) -> bool:
        from ray.util.placement_group import remove_placement_group

        if pg in self.owned_pgs:
            self.owned_pgs.remove(pg)
        try:
            remove_placement_group(pg)
        except Exception:  # already gone (e.g. Ray shut down): nothing left to free
            logger.debug("remove_placement_group failed", exc_info=True)
            return False
        return True


def bundle_node(slot: Slot) -> Optional[str]:
    """The node a slot's bundle is placed on now (None: not placed, or unknown)."""
    from ray.util import placement_group_table

    try:
        nodes = placement_group_table(slot.pg).get("bundles_to_node_id", {})
    except Exception:  # the group is gone
        return None
    node = nodes.get(slot.bundle_index)
    return str(node) if node else None


def wait_removed(pgs: list[Any], timeout_s: float) -> bool:
    """Wait (bounded) until every group in `pgs` is removed and its resources are free again;
    whether they all were.

    `remove_placement_group` only asks for the removal: until the GCS has done it (the group's
    state is REMOVED) and the nodes have reported the freed resources (no ``*_group_<id>`` entry
    left in `ray.available_resources()`), the reserved CPUs are missing from the free ones, and a
    caller that creates the next group right away could find the cluster full.
    """
    import ray
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    pending = list(pgs)
    delay = 0.005
    while pending:
        free = ray.available_resources()
        pending = [pg for pg in pending if not _gone(placement_group_table, free, pg)]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            logger.debug("%d placement group(s) not removed after %gs", len(pending), timeout_s)
            return False
        time.sleep(delay)
        delay = min(0.1, delay * 2)
    return True


def _gone(table: Any, free: dict, pg: Any) -> bool:
    try:
        if str(table(pg).get("state", "REMOVED")) != "REMOVED":
            return False
    except Exception:  # no answer (Ray shut down): nothing is left to wait for
        return True
    # Resources reserved by a placement group show up as "<name>_group_<id>" until released.
    suffix = f"_group_{pg.id.hex()}"
    return not any(key.endswith(suffix) for key in free)


def estimate_fitting(bundle: dict, pool: Optional[SlotPool]) -> int:
    """How many more `bundle`s fit: free cluster resources (or the borrowed group's), plus the
    free bundles of our own group. One reading of a changing number: a guess, not a promise."""
    import ray

    available = ray.available_resources()
    suffix = ""
    if pool is not None and pool.borrowed is not None:
        # Resources reserved by a placement group show up as "<name>_group_<id>".
        suffix = f"_group_{pool.borrowed.id.hex()}"
    room = [
        math.floor(available.get(key + suffix, 0.0) / amount + 1e-9)
        for key, amount in bundle.items()
    ]
    if pool is not None:
        pool.refresh()
    free_slots = len(pool.free) if pool is not None else 0
    return (min(room) if room else 0) + free_slots
