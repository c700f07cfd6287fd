"""Each rank's slot of the window start, replicated on its ring peer (a replicated state: ``ddp``,
``none``).

Every worker of a replicated state holds the models and optimizers whole, but not what differs
from rank to rank: its random generators, the operator's per-rank state and the loader's seed of
the epoch (`OperatorRunner.rank_slot`). A replacement that takes a lost rank's place needs that
rank's slot as of the step the group goes on from, or its dropout masks, its hidden state and its
data loader's random transforms would not be those the lost rank would have used, and the run
would no longer end with the weights of one never interrupted.

So at every window start (every step without gradient accumulation) each rank sends its slot to
the next rank of the ring and receives the previous rank's: rank r holds its own slot and that of
rank r - 1, as of the same step (`RankReplicas.copies`). Before workers leave on purpose (a move
off a draining node, which may take ring neighbours together) each leaving worker also gives its
slot to one that stays (`RankReplicas.adopt`). The slot is small (a few KB of generator
state, plus the per-rank state the operator keeps), and the exchange is two point-to-point
messages each way, sent before the window's first batch. It runs on the training group when that
is gloo (a lost peer's abort then releases it like any collective), else on a gloo group of its
own (NCCL cannot carry host memory): a peer that died fails it at once on its ring neighbours,
which are the only ranks that wait on it.

A worker lost before its slot reached its peer (in the moment between its last step and the
exchange) leaves its slot unreplicated: the restore plan then says the replacement's random
numbers may differ (`state.replicated.plan_from_peers`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from raysgd_core import get_context
from raysgd_operator import OperatorRunner

__all__ = ["PeerSlot", "RankReplicas", "decode_slot", "encode_slot"]


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
    """A rank slot (`OperatorRunner.rank_slot`) as bytes, to send to a peer. The tensors of the
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
    """The ring predecessor's slot, as received.

    Attributes:
        rank: The predecessor's rank in the group it was sent in.
        group: That group's number (`WorkerContext.generation`).
        step: The window start it describes.
        data: The slot, encoded (`encode_slot`).
    """

    def __init__(self, rank: int, group: int, step: int, data: bytes) -> None:
        self.rank, self.group, self.step, self.data = rank, group, step, data

    def slot(self) -> dict[str, Any]:
        """The slot itself."""
        return decode_slot(self.data)


class RankReplicas:
    """This worker's step hook that swaps slots with its ring neighbours (see the module
    docstring)."""

    def __init__(self, runner: OperatorRunner) -> None:
        self.runner = runner
        #: Other ranks' slots this worker keeps, by rank: its ring predecessor's at the last
        #: window start, and those leaving workers gave it since.
        self.copies: dict[int, PeerSlot] = {}
        self._side_group: Any = None
        self._side_generation = -1
        runner.add_step_hook(self._on_step)

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

    def _on_step(self) -> None:
        if self.runner.at_window_start:
            self.exchange()

    def exchange(self) -> None:
        """Send this rank's slot of the current window start to the next rank and keep the
        previous rank's (every worker calls it at the same window start)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        size, rank = dist.get_world_size(), dist.get_rank()
        if size == 1:
            return
        group = self.group()
        after, before = (rank + 1) % size, (rank - 1) % size
        mine = encode_slot(self.runner.rank_slot())
        length = torch.tensor([len(mine)], dtype=torch.int64)
        incoming = torch.zeros(1, dtype=torch.int64)
        _swap(group, length, after, incoming, before)
        data = torch.empty(int(incoming.item()), dtype=torch.uint8)
        _swap(group, torch.frombuffer(bytearray(mine), dtype=torch.uint8), after, data, before)
        generation = get_context().generation
        self.copies = {
            before: PeerSlot(before, generation, self.runner.window_step, data.numpy().tobytes())
        }

    def adopt(self, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose, at a window start: each gives its
        slot to a worker that stays, which keeps it beside its predecessor's (every worker calls
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
            mine = encode_slot(self.runner.rank_slot())
            payload = {"slot": torch.frombuffer(bytearray(mine), dtype=torch.uint8)}
            sends.append((keeper[rank], payload, None))
        givers = [gone for gone, to in keeper.items() if to == rank]
        received = exchange(self.group(), sends, givers)
        generation = get_context().generation
        for gone, (chunks, _) in zip(givers, received):
            data = chunks["slot"].numpy().tobytes()
            self.copies[gone] = PeerSlot(gone, generation, self.runner.window_step, data)

    def held(self) -> tuple[tuple[int, int, int], ...]:
        """(its rank, its group, the step) of every other rank's slot this worker keeps."""
        return tuple((copy.rank, copy.group, copy.step) for copy in self.copies.values())


def _swap(group: Any, out: torch.Tensor, to: int, into: torch.Tensor, frm: int) -> None:
    """Send `out` to rank `to` while receiving `into` from rank `frm`."""
    import torch.distributed as dist

    sending = dist.isend(out, to, group=group)
    dist.irecv(into, frm, group=group).wait()
    sending.wait()
