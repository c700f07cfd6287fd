"""Where workers go: a placement group of one bundle per worker, or a borrowed group (a Tune trial's).

Every remote worker occupies a *seat*. Each seat owned here is a placement group of its own: Ray can
remove a whole group but not one bundle of it, and a group that lost a bundle with its node stays
in Ray's hands until the bundle is placed again. While the cluster has no room for it Ray keeps
trying, and on Ray 2.60 those attempts keep the GCS busy without pause (one core of the head
node, slower steps on a machine that hosts both). With a group per worker, the group of a lost
worker is removed instead and nothing is left to place again.

`start()` still places the whole set by the group's strategy (SPREAD, PACK, ...): on a cluster of
several nodes it first reserves one multi-bundle group with that strategy, notes the node of each
bundle, removes it, and pins each worker's own group to its node (`bundle_label_selector` on Ray's
node-id label). On a single node there is nothing to choose and the groups are made directly.

The group of a worker that is gone is kept for the next new worker while its node is live and
not draining (a replacement then starts without waiting for Ray to free and reserve room again);
otherwise it is removed. The group of a worker killed because it stopped answering is never
reused: its node may be frozen, and a worker placed there would never start.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "Seat",
    "SeatPool",
    "describe_free_resources",
    "describe_request",
    "estimate_fitting",
    "format_resources",
    "make_bundle",
    "nodes_that_fit",
    "wait_removed",
]

logger = logging.getLogger("raysgd_core")

#: How long start's reservation waits, once removed, for Ray to count its room free again.
REFREE_WAIT_S = 0.5


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
class Seat:
    """Room for one worker: bundle `bundle_index` of `pg` (-1: any bundle with room)."""

    pg: Any
    bundle_index: int
    owned: bool  # this WorkerGroup created `pg` (a group of this one bundle) and must remove it

    def strategy(self) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_index,
        )


class SeatPool:
    """The seats of one WorkerGroup: its own one-bundle placement groups, or a borrowed group."""

    def __init__(self, bundle: dict, strategy: str, borrowed: Any = None) -> None:
        self.bundle = bundle
        self.strategy_name = strategy
        self.borrowed = borrowed  # a placement group we may use but never remove
        #: Groups of workers that are gone, on live nodes that are not draining: the next new
        #: workers take them.
        self.free: list[Seat] = []
        self.owned_pgs: list[Any] = []

    def create_main(self, count: int, timeout_s: float) -> Optional[list[Seat]]:
        """The seats for `start()`: `count` groups placed together by the strategy (None: the
        cluster could not place them within `timeout_s`), or borrowed ones."""
        if self.borrowed is not None:
            return [Seat(self.borrowed, -1, owned=False) for _ in range(count)]
        nodes: list[Optional[str]] = [None] * count
        if count > 1 and nodes_that_fit(self.bundle) != 1:
            placed = self._reserve(count, timeout_s)
            if placed is None:
                return None
            nodes = placed
        return [self._new_seat(node) for node in nodes]

    def _reserve(self, count: int, timeout_s: float) -> Optional[list[Optional[str]]]:
        """Where Ray places `count` bundles by the strategy: a group made, read and removed."""
        import ray
        from ray.util import placement_group_table
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([self.bundle] * count, strategy=self.strategy_name)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        placed = placement_group_table(pg).get("bundles_to_node_id", {}) if ready else {}
        free_before = ray.available_resources()
        remove_placement_group(pg)
        wait_removed([pg], timeout_s)
        if not ready:
            return None
        # Ray's scheduler sees the room free a little after the group reads as removed; a pinned
        # group asked for before that fails once and is tried again only about a second later.
        freed = {
            key: free_before.get(key, 0.0) + count * amount for key, amount in self.bundle.items()
        }
        _wait_free(freed, REFREE_WAIT_S)
        return [str(placed[i]) if placed.get(i) else None for i in range(count)]

    def _new_seat(self, node: Optional[str] = None) -> Seat:
        """A one-bundle group, on `node` when given."""
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        pin = {"bundle_label_selector": [{NODE_ID_LABEL_KEY: node}]} if node else {}
        pg = placement_group([self.bundle], strategy="PACK", **pin)
        self.owned_pgs.append(pg)
        return Seat(pg, 0, owned=True)

    def acquire(self) -> Seat:
        """A seat for one more worker: a free group on a live node that is not draining first,
        else a new group (which Ray does not place on a draining node)."""
        if self.borrowed is not None:
            return Seat(self.borrowed, -1, owned=False)
        self.refresh()
        if self.free:
            return self.free.pop(0)
        return self._new_seat()

    def release(self, seat: Seat, *, reuse: bool = True) -> None:
        """Give a seat back: kept for the next worker while its node is live and not draining
        (and `reuse`), else removed (its resources go back to the cluster)."""
        if not seat.owned or seat in self.free:
            return
        if reuse and _usable(seat, _nodes_to_avoid()):
            self.free.append(seat)
        else:
            self._remove(seat.pg)

    def refresh(self) -> None:
        """Remove the free groups whose node has since gone or started draining."""
        if not self.free:
            return
        avoid = _nodes_to_avoid()
        for seat in list(self.free):
            if not _usable(seat, avoid):
                self.free.remove(seat)
                self._remove(seat.pg)

    def remove_all(self) -> list[Any]:
        """Remove every placement group this pool created (killing anything still in them).

        Returns the groups whose removal was asked for (see `wait_removed`)."""
        removed = [pg for pg in list(self.owned_pgs) if self._remove(pg)]
        self.free.clear()
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


def _wait_free(amounts: dict[str, float], timeout_s: float) -> None:
    """Wait (bounded) until the cluster has `amounts` free (others may take some meanwhile: the
    bound keeps that from costing more than `timeout_s`)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(key, 0.0) >= amount - 1e-6 for key, amount in amounts.items()):
            return
        time.sleep(0.005)


def nodes_that_fit(bundle: dict) -> int:
    """How many live nodes could hold `bundle` when empty."""
    import ray

    return sum(
        1
        for node in ray.nodes()
        if node.get("Alive") and all(node["Resources"].get(k, 0.0) >= v for k, v in bundle.items())
    )


def _nodes_to_avoid() -> set[str]:
    """Nodes a worker must not be placed on: draining ones, and those Ray no longer counts live."""
    import ray

    from raysgd_core.drains import draining_nodes

    dead = {node["NodeID"] for node in ray.nodes() if not node.get("Alive")}
    return set(draining_nodes()) | dead


def _usable(seat: Seat, avoid: set[str]) -> bool:
    node = _bundle_node(seat)
    return node is not None and node not in avoid


def _bundle_node(seat: Seat) -> Optional[str]:
    """The node a seat's bundle is placed on now (None: not placed, or unknown)."""
    from ray.util import placement_group_table

    try:
        nodes = placement_group_table(seat.pg).get("bundles_to_node_id", {})
    except Exception:  # the group is gone
        return None
    node = nodes.get(seat.bundle_index)
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


def estimate_fitting(
    bundle: dict, pool: Optional[SeatPool], freeable: Optional[dict[str, float]] = None
) -> int:
    """How many more `bundle`s fit: free cluster resources (or the borrowed group's) plus
    `freeable` (held by something the group releases when it needs room), plus the groups of our
    workers that are gone and wait for the next one. One reading of a changing number: a guess,
    not a promise."""
    import ray

    available = dict(ray.available_resources())
    for key, amount in (freeable or {}).items():
        available[key] = available.get(key, 0.0) + amount
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
    free_seats = len(pool.free) if pool is not None else 0
    return (min(room) if room else 0) + free_seats
