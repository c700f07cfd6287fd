"""A persistent pass over a loader, drawn from call by call (RaySGD's ``num_steps`` semantics)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

__all__ = ["BatchStream", "CallBatches"]


def _known_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


class CallBatches:
    """The batches of one train/validate call; ``len()`` works when the count is known (for tqdm)."""

    def __init__(self, batches: Iterator[Any], length: int | None) -> None:
        self._batches, self._length = batches, length

    def __iter__(self) -> Iterator[Any]:
        return self._batches

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the number of batches of this call is unknown")
        return self._length


class BatchStream:
    """Keeps the loader iterator alive between calls.

    ``on_new_pass(resuming)`` is called whenever a new pass over the loader starts; it returns the
    epoch number to give the sampler's ``set_epoch`` (or None). ``resume`` (batches to skip) is set
    after a state load so that the next pass redoes the interrupted epoch from the same place.
    """

    def __init__(
        self, get_loader: Callable[[], Any], on_new_pass: Callable[[bool], int | None]
    ) -> None:
        self._get_loader, self._on_new_pass = get_loader, on_new_pass
        self.iterator: Iterator[Any] | None = None
        self.position = 0
        self.resume: int | None = None
        # A batch drawn ahead to learn whether a pass of unknown length had ended (_END: none).
        self._peeked: Any = _END

    def _exhausted(self) -> bool:
        length = _known_len(self._get_loader())
        return length is not None and self.position >= length

    def consumed(self) -> int:
        """Batches already drawn in the unfinished pass (0 when none is in progress)."""
        if self.iterator is None:
            return self.resume or 0
        return 0 if self._exhausted() else self.position

    def reset(self, resume: int | None = None) -> None:
        """Drop the current pass; the next one skips ``resume`` batches without a new epoch."""
        self.iterator, self.position, self.resume = None, 0, resume or None
        self._peeked = _END

    def begin_call(self, num_steps: int | None) -> CallBatches:
        """Batches for one call: ``num_steps`` of them (wrapping into new passes), else the rest."""
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps must be >= 0 or None, got {num_steps}")
        if self.iterator is not None and self._exhausted():
            self.iterator = None
        if self.iterator is not None and _known_len(self._get_loader()) is None:
            # Of unknown length (an iterable data set, a streamed shard), a pass that the last call
            # drew to its very end has not said so yet: look one batch ahead, so that this call
            # starts the next epoch rather than returning an empty one.
            if self._peek() is _END:
                self.iterator = None
        if self.iterator is None:
            self._new_pass()
        length = num_steps
        if length is None:
            total = _known_len(self._get_loader())
            length = None if total is None else max(total - self.position, 0)
        return CallBatches(self._draw(num_steps), length)

    def end_call(self, num_steps: int | None) -> None:
        """A call without ``num_steps`` finishes its pass, even if the loop stopped early."""
        if num_steps is None:
            self.iterator, self._peeked = None, _END

    def _new_pass(self) -> None:
        loader = self._get_loader()
        skip, self.resume = self.resume or 0, None
        epoch = self._on_new_pass(skip > 0)
        sampler = getattr(loader, "sampler", None)
        if epoch is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        self.iterator, self._peeked = iter(loader), _END
        self.position = 0
        for _ in range(skip):
            if next(self.iterator, _END) is _END:
                break
            self.position += 1
        if skip and (self.position < skip or self._peek() is _END):
            # The saved position was the end of its epoch (a pass of unknown length cannot tell
            # before it is drawn past): that epoch is done, so start the next one.
            self._new_pass()

    def _peek(self) -> Any:
        """Draw the next batch ahead (kept for the next draw); _END when the pass is over."""
        if self._peeked is _END and self.iterator is not None:
            self._peeked = next(self.iterator, _END)
        return self._peeked

    def _batches(self) -> Iterator[Any]:
        if self._peeked is not _END:
            peeked, self._peeked = self._peeked, _END
            yield peeked
        # Not ``yield from``: closing this generator when a call stops mid-pass must not close the
        # loader's iterator, whose pass the next call continues.
        while self.iterator is not None:
            batch = next(self.iterator, _END)
            if batch is _END:
                return
            yield batch

    def _draw(self, num_steps: int | None) -> Iterator[Any]:
        drawn = 0
        if num_steps == 0:
            return
        while True:
            yielded = False
            for batch in self._batches():
                self.position += 1
                drawn += 1
                yielded = True
                yield batch
                if num_steps is not None and drawn >= num_steps:
                    return
            self.iterator = None
            # An empty loader would otherwise wrap forever.
            if num_steps is None or not yielded:
                return
            self._new_pass()


_END = object()
