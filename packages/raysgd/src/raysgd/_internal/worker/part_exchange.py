"""Parts of a sharded snapshot sent from worker to worker, point to point, as the tensors they are.

A part is one rank's chunks of a snapshot (`raysgd_operator.sharded_memory.Chunks`). Parts move
three times: to the ring peer after every snapshot, to the workers that lack one at a restore,
and from a leaving worker to one that stays. One `exchange` serves all three: any number of parts
between any pairs, over the snapshot's gloo group (host memory, beside the training group). Each
transfer sends a small header first (the chunks' keys, shapes and dtypes, and a payload such as
the part's metrics), then every chunk's bytes, with no copy on either side.

Every worker posts all of its sends before it waits for anything, so no two workers wait on each
other. Between two workers, parts arrive in the order they were sent: callers list them in the
same order on both sides.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Outgoing", "exchange"]

#: A part to send: (the rank it goes to, its chunks, a small payload that travels with it).
Outgoing = tuple[int, Mapping[Any, torch.Tensor], Any]


def exchange(
    group: Any, sends: Sequence[Outgoing], receives: Sequence[int]
) -> list[tuple[dict[Any, torch.Tensor], Any]]:
    """Send every part of `sends` and receive one part from each rank of `receives` (a rank may
    appear more than once), over `group`. Returns the parts received, in the order of
    `receives`: (their chunks, in new host memory; their payload)."""
    headers = [
        pickle.dumps(([(key, tuple(t.shape), t.dtype) for key, t in chunks.items()], payload))
        for _, chunks, payload in sends
    ]
    sizes_in = [torch.zeros(1, dtype=torch.int64) for _ in receives]
    _move(
        group,
        [(to, torch.tensor([len(h)], dtype=torch.int64)) for (to, _, _), h in zip(sends, headers)],
        list(zip(receives, sizes_in)),
    )
    headers_in = [torch.empty(int(size.item()), dtype=torch.uint8) for size in sizes_in]
    _move(
        group,
        [
            (to, torch.frombuffer(bytearray(h), dtype=torch.uint8))
            for (to, _, _), h in zip(sends, headers)
        ],
        list(zip(receives, headers_in)),
    )
    layouts = [pickle.loads(bytes(h.numpy())) for h in headers_in]
    received = [_allocate(layout) for layout, _ in layouts]
    _move(
        group,
        [(to, _bytes_of(t)) for to, chunks, _ in sends for t in chunks.values()],
        [(frm, _bytes_of(t)) for frm, part in zip(receives, received) for t in part.values()],
    )
    return [(part, payload) for part, (_, payload) in zip(received, layouts)]


def _allocate(
    layout: Sequence[tuple[Any, tuple[int, ...], torch.dtype]],
) -> dict[Any, torch.Tensor]:
    """Empty chunks for a part with `layout`, all in one buffer (`one_buffer`), which is given
    back to the system whole when the part is dropped."""
    from raysgd_operator.sharded_memory import one_buffer  # it imports DCP: only once in use

    tensors = one_buffer([(shape, dtype) for _, shape, dtype in layout])
    return {key: tensor for (key, _, _), tensor in zip(layout, tensors)}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s memory as bytes (a view of it when it is contiguous, as received chunks are)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _move(
    group: Any,
    outgoing: Sequence[tuple[int, torch.Tensor]],
    incoming: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """Post every send, then receive into each buffer in order, then wait for the sends."""
    sends = [dist.isend(t, to, group=group) for to, t in outgoing if t.numel()]
    for frm, buffer in incoming:
        if buffer.numel():
            dist.irecv(buffer, frm, group=group).wait()
    for request in sends:
        request.wait()
