"""Each rank's slot, replicated on its ring peer before the step that ends each window (a
replicated state: ``ddp``, ``none``).

Every worker of a replicated state holds the models and optimizers whole, but not what differs
from rank to rank: its random generators, the operator's per-rank state and the loader's seed of
the epoch (`StateIO.rank_slot`). A replacement that takes a lost rank's place needs that
rank's slot as of the step the group goes on from, or its dropout masks, its hidden state and its
data loader's random transforms would not be those the lost rank would have used, and the run
would no longer end with the weights of one never interrupted.

So each rank sends its slot to the next `COPIES` (two) ranks of the ring and receives those of
the previous two **just before the optimizer step that ends a window**
(`OperatorRunner.add_before_step_hook`: the window's gradients are whole, its forward passes
have drawn their numbers), as the slot of the window start that step leads to. The exchange
waits for the predecessors' slots, so no rank steps before holding them: wherever a rank is
lost, either its successors hold its slot of the new window start, or they have not stepped and
still hold the models and optimizers of the window start before, for which every rank's slot is
held (each keeps its own, and its predecessors', of the last two window starts:
`RankReplicas.held`). The restore planner goes on from the newest of the two that is complete,
so a loss just after a window's step is exact too, and so is the loss of two neighbours at once
(a burst, a node holding both).

A loop may change its generators or per-rank state after the step (a custom `train_batch` that
draws after stepping). At the window start each rank compares its slot with the one it sent and
posts a confirmation without waiting (`_Confirm`: "the same", or the slot as it is); the
successors take it at their next exchange, or when asked what it holds after a failure. A copy
whose confirmation had not arrived is offered as the slot of its step only when its sender has
never changed its slot after a step in this run (the sender says so in every exchange).

A full exchange at a window start (`exchange`) also runs where no step preceded it (a step
skipped for an overflow, the group formed or loaded anew) and after what changes the generators
between calls at a window start (a call's end, `validate()`). Before workers leave on purpose (a
move off a draining node, which may take ring neighbours together) each leaving worker also
gives its slot to one that stays (`RankReplicas.adopt`). The slot is small (a few KB of
generator state, plus the per-rank state the operator keeps). The exchanges run on the training
group when that is gloo (a lost peer's abort then releases them like any collective), else on a
gloo group of its own (NCCL cannot carry host memory): a peer that died fails them at once on its
ring neighbours, which are the only ranks that wait on it. Three or more neighbours lost at once
can take a slot with them: the restore plan says so (`RestorePlan.inexact`).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch

from raysgd._internal.protocol import SlotCopy
from raysgd_core import get_context
from raysgd_operator import OperatorRunner

__all__ = ["PeerSlot", "RankReplicas", "decode_slot", "encode_slot", "same_slot"]


class _Array:
    """A tensor in an encoded slot: its dtype's name and its values as a NumPy array (bfloat16,
    which NumPy lacks, as the same bits in int16)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        self.values = tensor.numpy()

    def tensor(self) -> torch.Tensor:
        tensor = torch.from_numpy(self.values.copy())
        return tensor.view(torch.bfloat16) if self.dtype == "bfloat16" else tensor


def _arrays(tree: Any, into_arrays: bool) -> Any:
    """`tree` with every tensor replaced by an `_Array` (or back)."""
    if into_arrays and isinstance(tree, torch.Tensor):
        return _Array(tree)
    if not into_arrays and isinstance(tree, _Array):
        return tree.tensor()
    if isinstance(tree, dict):
        return type(tree)((key, _arrays(value, into_arrays)) for key, value in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_arrays(value, into_arrays) for value in tree)
    return tree


def encode_slot(slot: dict[str, Any]) -> bytes:
    """A rank slot (`StateIO.rank_slot`) as bytes, to send to a peer. The tensors of the
    operator's per-rank state travel as NumPy arrays: pickling a tensor serialises its storage
    with `torch.save`, many times slower, and this runs at every window start. The generators
    are bytes and numbers already (walking Python's 625 of them would cost more than the rest)."""
    plain = {**slot, "state": _arrays(slot.get("state"), True)}
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def decode_slot(data: bytes) -> dict[str, Any]:
    """The slot `encode_slot` encoded (only ever bytes a peer of this run sent)."""
    slot = pickle.loads(data)
    return {**slot, "state": _arrays(slot.get("state"), False)}


class PeerSlot:
    """Another rank's slot, as received.

    Attributes:
        rank: The rank whose slot it is, in the group it was sent in.
        group: That group's number (`WorkerContext.generation`).
        step: The window start it describes.
        data: The slot, encoded (`encode_slot`).
        confirmed: Its sender confirmed it as the slot of `step` (sent at that window start, or
            sent before the step and found the same there).
        counts: With a confirmation, what the rank had counted in the call at `step` (batches,
            their `num_samples`): a slot sent before the step lacks the batch in flight.
    """

    def __init__(self, rank: int, group: int, step: int, data: bytes, confirmed: bool) -> None:
        self.rank, self.group, self.step, self.data = rank, group, step, data
        self.confirmed = confirmed
        self.counts: Optional[tuple[int, float]] = None

    def slot(self) -> dict[str, Any]:
        """The slot itself, with the counts its confirmation brought."""
        slot = decode_slot(self.data)
        counted = slot.get("counted")
        if self.counts is not None and counted is not None:
            slot["counted"] = (counted[0], *self.counts, 0)
        return slot

    def encoded(self) -> bytes:
        """`slot()`, encoded."""
        return self.data if self.counts is None else encode_slot(self.slot())


#: How many ring successors keep a copy of each rank's slot: two, so that a rank lost together
#: with its next one (a burst, a node holding both) still leaves its slot with a survivor.
COPIES = 2

#: How long a receive that may have arrived is waited for after a failure.
_ARRIVED_WAIT = timedelta(milliseconds=200)

#: What a confirmation says (its first byte).
_SAME, _CHANGED, _CHANGED_OTHER_SIZE = 0, 1, 2
#: A confirmation's last bytes: the sender's counts in the call at the window start (batches,
#: their `num_samples`; batches -1 outside a call).
_COUNTS = struct.Struct("<qd")


class _Ring(NamedTuple):
    """This worker's place in the ring: the ranks it sends its slot to (its next `COPIES`) and
    those it keeps copies of (its previous `COPIES`), distinct, without itself."""

    rank: int
    afters: tuple[int, ...]
    befores: tuple[int, ...]


class _Confirm:
    """The confirmations of one window start (`step`) in flight: this rank's to its successors,
    and those it awaits from its predecessors (rank -> (request, buffer of the size the slot it
    sent before the step had))."""

    def __init__(
        self, step: int, sending: list[Any], receiving: dict[int, tuple[Any, Any]]
    ) -> None:
        self.step, self.sending, self.receiving = step, sending, receiving


class RankReplicas:
    """This worker's hooks that swap slots with its ring neighbours (see the module docstring)."""

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner
        #: Slots this worker keeps, by (rank, step): its predecessors' of the last two window
        #: starts, those leaving workers gave it since, and its own of the window start before
        #: the one in progress (taken when asked what it holds).
        self.copies: dict[tuple[int, int], PeerSlot] = {}
        #: This rank's slot has changed after a step once in this run: what it sends before a
        #: step may not be its slot at the window start, until confirmed.
        self.changes_after_step = False
        #: The predecessors that said so of themselves in their last exchange.
        self._peers_changing: set[int] = set()
        #: (step, the slot, its encoded size) this rank sent before its last step.
        self._sent: Optional[tuple[int, dict[str, Any], int]] = None
        #: The encoded size of the slot each predecessor sent before its last step.
        self._peer_sent: dict[int, int] = {}
        self._confirm: Optional[_Confirm] = None
        #: This worker's (rank, group number) when it last swapped slots: the group whose
        #: window starts its copies describe.
        self._trained_in: Optional[tuple[int, int]] = None
        self._side_group: Any = None
        self._side_generation = -1
        runner.add_before_step_hook(self._before_step)
        runner.add_step_hook(self._on_step)
        runner.position.add_window_start_hook(self.exchange)

    def group(self) -> Any:
        """The group the slots travel over: the training group (None) when it is gloo, else a
        gloo group beside it (made on first use in each process group: every worker asks at the
        same point)."""
        import torch.distributed as dist

        ctx = get_context()
        if dist.get_backend() == "gloo":
            return None
        if self._side_group is None or self._side_generation != ctx.generation:
            self._side_group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=ctx.timeout_s)
            )
            self._side_generation = ctx.generation
        return self._side_group

    @staticmethod
    def _ring() -> Optional[_Ring]:
        """This worker's place in the ring; None outside a group of two or more."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        size, rank = dist.get_world_size(), dist.get_rank()

        def distinct(ranks: list[int]) -> tuple[int, ...]:
            return tuple(dict.fromkeys(r for r in ranks if r != rank))

        return _Ring(
            rank,
            distinct([(rank + i) % size for i in range(1, COPIES + 1)]),
            distinct([(rank - i) % size for i in range(1, COPIES + 1)]),
        )

    # -------------------------------------------------------------------------- the hooks
    def _before_step(self) -> None:
        """Before a step that ends a window: swap the slots of the window start it leads to."""
        ring = self._ring()
        if ring is None:
            return
        self._take_confirm(wait=True)
        step = self.runner.position.step + 1
        slot = self.runner.state.upcoming_rank_slot()
        encoded = encode_slot(slot)
        previous = None
        if self.changes_after_step:
            # The successors' copies of the last window start may be stale: they get it too.
            previous = (
                self.runner.position.window_step,
                encode_slot(self.runner.state.rank_slot()),
            )
        message = {"slot": encoded, "changes": self.changes_after_step, "previous": previous}
        received = self._swap(pickle.dumps(message), ring)
        generation = self._note_group()
        for before, data in received.items():
            theirs = pickle.loads(data)
            if theirs["changes"]:
                self._peers_changing.add(before)
            if theirs["previous"] is not None:
                at, slot_then = theirs["previous"]
                self._keep(PeerSlot(before, generation, at, slot_then, confirmed=True))
            self._keep(PeerSlot(before, generation, step, theirs["slot"], confirmed=False))
            self._peer_sent[before] = len(theirs["slot"])
        self._sent = (step, slot, len(encoded))

    def _on_step(self) -> None:
        """At a window start: confirm the slot sent before the step, or, where no step sent one,
        swap the slots now."""
        if not self.runner.position.at_window_start or self._ring() is None:
            return
        step = self.runner.position.step
        if self._sent is None or self._sent[0] != step:
            self.exchange()
        else:
            self._post_confirm(step)

    def _post_confirm(self, step: int) -> None:
        """Tell the successors, without waiting, whether this rank's slot at the window start
        `step` is the one it sent before the step; post the receives of the predecessors'."""
        import torch.distributed as dist

        assert self._sent is not None
        ring = self._ring()
        assert ring is not None
        _, sent, size = self._sent
        self._sent = None
        now = self.runner.state.rank_slot()
        out = bytearray(1 + size + _COUNTS.size)  # _SAME, unless the slot changed after the step
        counted = now.get("counted")
        out[-_COUNTS.size :] = _COUNTS.pack(
            *((int(counted[1]), float(counted[2])) if counted is not None else (-1, 0.0))
        )
        # The loader's seed is not compared: it is the same while the pass goes on, and unused
        # once the pass ended with the step's batch.
        if not (same_slot(now["state"], sent["state"]) and same_slot(now["rng"], sent["rng"])):
            self.changes_after_step = True
            encoded = encode_slot(now)
            if len(encoded) == size:
                out[0], out[1 : 1 + size] = _CHANGED, encoded
            else:
                out[0] = _CHANGED_OTHER_SIZE
        group = self.group()
        message = torch.frombuffer(out, dtype=torch.uint8)
        sending = [dist.isend(message, after, group=group) for after in ring.afters]
        receiving = {}
        for before in ring.befores:
            into = torch.empty(1 + self._peer_sent.get(before, 0) + _COUNTS.size, dtype=torch.uint8)
            receiving[before] = (dist.irecv(into, before, group=group), into)
        self._confirm = _Confirm(step, sending, receiving)

    def _take_confirm(self, *, wait: bool) -> None:
        """Apply the predecessors' confirmations in flight: waiting for them (`wait`: the
        training thread, which must hold them before it swaps again), or those that have
        arrived (asked what it holds after a failure, when the group they came over may be
        gone)."""
        confirm, self._confirm = self._confirm, None
        if confirm is None:
            return
        if wait:
            for request in confirm.sending:
                request.wait()
        for before, (request, into) in confirm.receiving.items():
            if wait:
                request.wait()
            else:
                # gloo says a receive is complete only once waited for: one that arrived
                # returns at once, also after its group was destroyed; one that did not fails
                # or times out.
                try:
                    request.wait(_ARRIVED_WAIT)
                except Exception:
                    continue
            copy = self.copies.get((before, confirm.step))
            if copy is None:
                continue
            data = into.numpy().tobytes()
            batches, samples = _COUNTS.unpack(data[-_COUNTS.size :])
            data = data[: -_COUNTS.size]
            if data[0] == _SAME:
                copy.confirmed = True
                if batches >= 0:
                    copy.counts = (batches, int(samples) if samples.is_integer() else samples)
            elif data[0] == _CHANGED:
                copy.data, copy.confirmed = data[1:], True
            else:
                # Changed, and of another size: its sender sends it whole with its next exchange.
                self.copies.pop((before, confirm.step))

    def _note_group(self) -> int:
        """Record the group this worker swaps slots in (see `held`); its number."""
        ctx = get_context()
        self._trained_in = (dist_rank(), ctx.generation)
        return ctx.generation

    # -------------------------------------------------------------------------- full exchanges
    def exchange(self) -> None:
        """Send this rank's slot of the current window start to its successors and keep its
        predecessors', confirmed (every worker calls it at the same window start)."""
        ring = self._ring()
        if ring is None:
            return
        self._take_confirm(wait=True)
        received = self._swap(encode_slot(self.runner.state.rank_slot()), ring)
        generation = self._note_group()
        step = self.runner.position.window_step
        for before, data in received.items():
            self._keep(PeerSlot(before, generation, step, data, confirmed=True))
        self._sent = None

    def adopt(self, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose, at a window start: each gives its
        slot to a worker that stays, which keeps it beside its predecessors' (every worker calls
        it at once)."""
        import torch.distributed as dist

        from raysgd._internal.worker.part_exchange import exchange

        rank, size = dist.get_rank(), dist.get_world_size()
        staying = [r for r in range(size) if r not in set(leaving)]
        if not staying:
            return
        keeper = {gone: staying[i % len(staying)] for i, gone in enumerate(sorted(set(leaving)))}
        sends = []
        if rank in keeper:
            mine = encode_slot(self.runner.state.rank_slot())
            payload = {"slot": torch.frombuffer(bytearray(mine), dtype=torch.uint8)}
            sends.append((keeper[rank], payload, None))
        givers = [gone for gone, to in keeper.items() if to == rank]
        received = exchange(self.group(), sends, givers)
        generation = get_context().generation
        for gone, (chunks, _) in zip(givers, received):
            data = chunks["slot"].numpy().tobytes()
            self.copies[(gone, self.runner.position.window_step)] = PeerSlot(
                gone, generation, self.runner.position.window_step, data, confirmed=True
            )

    # -------------------------------------------------------------------------- what is held
    def held(self) -> tuple[SlotCopy, ...]:
        """Every slot this worker offers besides its own of
        the window start it went back to: copies of other ranks' (one sent before a step, when
        its confirmation has arrived or its sender never changed its slot after a step) and its
        own of the window start before (asked after a failure, once the runner went back)."""
        self._take_confirm(wait=False)
        before = self.runner.state.rank_slot_before()
        if before is not None:
            self.keep_own(*before)
        return tuple(
            SlotCopy(copy.rank, copy.group, copy.step)
            for copy in self.copies.values()
            if copy.confirmed or copy.rank not in self._peers_changing
        )

    def keep_own(self, step: int, slot: dict[str, Any]) -> None:
        """Keep this rank's own `slot` of the window start `step` among the copies (offered by
        `held` like another rank's), under the rank and group it last swapped slots in."""
        if self._trained_in is not None:
            rank, group = self._trained_in
            self.copies[(rank, step)] = PeerSlot(rank, group, step, encode_slot(slot), True)

    def _keep(self, copy: PeerSlot) -> None:
        """Keep `copy` and, of its rank, the one slot before it: a slot of its step or a later
        one belongs to a timeline the run left (a window done again, a load)."""
        steps = [step for rank, step in self.copies if rank == copy.rank]
        earlier = max((step for step in steps if step < copy.step), default=None)
        for step in steps:
            if step != earlier:
                self.copies.pop((copy.rank, step))
        self.copies[(copy.rank, copy.step)] = copy

    def _swap(self, mine: bytes, ring: _Ring) -> dict[int, bytes]:
        """Send `mine` to every successor while receiving what each predecessor sends (lengths
        first); predecessor -> its bytes."""
        group = self.group()
        length = torch.tensor([len(mine)], dtype=torch.int64)
        lengths = {before: torch.zeros(1, dtype=torch.int64) for before in ring.befores}
        _move(group, [(after, length) for after in ring.afters], list(lengths.items()))
        data = {b: torch.empty(int(n.item()), dtype=torch.uint8) for b, n in lengths.items()}
        out = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        _move(group, [(after, out) for after in ring.afters], list(data.items()))
        return {before: tensor.numpy().tobytes() for before, tensor in data.items()}


def dist_rank() -> int:
    """This worker's rank in the training group."""
    import torch.distributed as dist

    return dist.get_rank()


def same_slot(a: Any, b: Any) -> bool:
    """Whether two plain slots (or parts of them) hold the same values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_slot(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_slot(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # values that compare element-wise (arrays): not the same as far as known
        return False


def _move(
    group: Any,
    sends: list[tuple[int, torch.Tensor]],
    receives: list[tuple[int, torch.Tensor]],
) -> None:
    """Send each tensor of `sends` to its rank while receiving each of `receives` from its rank;
    return once all are done."""
    import torch.distributed as dist

    sending = [dist.isend(tensor, to, group=group) for to, tensor in sends]
    for request in [dist.irecv(tensor, frm, group=group) for frm, tensor in receives]:
        request.wait()
    for request in sending:
        request.wait()
