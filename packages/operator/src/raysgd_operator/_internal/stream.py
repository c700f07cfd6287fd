"""A persistent pass over a loader, drawn from call by call (RaySGD's ``num_steps`` semantics).

The stream also knows where the pass is, counting only batches the loop has finished with: a batch
counts as done when the loop asks for the next one (or its call returns normally), never when it is
merely handed out, so that a call interrupted mid-batch leaves the position at the last finished
step. For a loader split by a `PlannedBatchSampler` the position is also kept in rows of the epoch,
which a group of another size can resume from.

A pass resumed in the middle of its epoch (after a load, or a recovery) reads the rows it would
have read, and draws what it would have drawn: a `DataLoader`'s iterator takes a seed for its
worker processes from the loader's generator (torch's global one by default) when it is made, so
the stream keeps that generator's state from the start of the pass, with the row the iterator
began at (`PassSeed`), and makes the resumed iterator draw from a copy of it. The global
generator is then left alone, and the worker processes get the seeds they had. Worker processes
also draw inside the pass (a random crop, a random mask), each from its own generator, batch after
batch: a resumed pass of a loader with worker processes therefore begins where the seeded
iterator began and draws the batches before its place again, discarding them (they cost their
loading, not a step), so that every worker process has drawn what it had. Only a pass resumed by
a group of another size (its steps no longer fall on the same rows) skips to its row instead, and
says once that the draws inside the worker processes differ.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch.utils.data import DataLoader

from raysgd_base import check_int
from raysgd_operator._internal.epoch_plan import EpochSampler
from raysgd_operator._internal.loaders import planned_sampler
from raysgd_operator._internal.rng import generator_state, set_generator_state

logger = logging.getLogger(__name__)

__all__ = [
    "BatchStream",
    "CallBatches",
    "LoaderSource",
    "PassListener",
    "PassSeed",
    "missing_loader_error",
]


class PassSeed(NamedTuple):
    """How a pass's loader iterator was made: the state of the generator it drew its worker seed
    from (`seed_state`), and, for a planned loader, the epoch's row it began at (None: unknown)."""

    generator: bytes
    first_row: Optional[int] = None

    def to_plain(self) -> tuple[bytes, Optional[int]]:
        """As a plain tuple (what checkpoints keep and `torch.load(weights_only=True)` reads)."""
        return (self.generator, self.first_row)

    @classmethod
    def from_plain(cls, value: Any) -> Optional[PassSeed]:
        """From `to_plain` (or a generator state alone, as states written before the row was
        kept); None stays None."""
        if value is None:
            return None
        if isinstance(value, (bytes, bytearray)):
            return cls(bytes(value))
        generator, first_row = value
        return cls(bytes(generator), None if first_row is None else int(first_row))


class LoaderSource(Protocol):
    """Where a stream finds its loader: asked each time, since a resize or a load may replace it."""

    def loader(self, kind: str) -> Any:
        """The batches of `kind` ("train" or "validation"); None when there are none."""


class PassListener(Protocol):
    """Told by a stream where its passes are (the runner, for the training stream)."""

    def pass_started(self, resuming: bool) -> int | None:
        """A pass over the loader begins (`resuming`: it goes on with an epoch already begun);
        returns the epoch to give the sampler's ``set_epoch``, or None."""

    def step_finished(self, rows: int | None) -> None:
        """The loop finished a batch; `rows` is what the whole group read in that step, when
        the loader is planned or can tell from the batch (a dataset shard), else None."""

    def end_of_epoch_due(self, epoch: int | None) -> bool:
        """A loop reached the last batch of `epoch`: whether that end is to be acted on now
        (True once per epoch: not when the batch is done again after a recovery or a load)."""


def missing_loader_error(kind: str) -> ValueError:
    """The error of drawing batches of `kind` without a loader of that kind."""
    call = "train()" if kind == "train" else "validate()"
    return ValueError(
        f"{call} needs a {kind} loader: call self.register_data({kind}_loader=...) in setup() "
        "(or return (train_loader, validation_loader) from data_creator), or give the trainer "
        f'datasets={{"{kind}": ...}}'
    )


def _group_rows(loader: Any, batch: Any) -> int | None:
    """Rows the whole group reads in the step of `batch`, for a loader that can tell (None)."""
    count = getattr(loader, "group_rows", None)
    return count(batch) if callable(count) else None


def seed_state(loader: Any) -> Optional[bytes]:
    """The state of the generator `iter(loader)` draws its worker seed from (None: `loader` is
    not a `DataLoader`)."""
    if not isinstance(loader, DataLoader):
        return None
    generator = loader.generator if loader.generator is not None else torch.default_generator
    return generator_state(generator)


def _iterate_seeded(loader: Any, state: Optional[bytes]) -> Iterator[Any]:
    """`iter(loader)`, its worker seed drawn from a generator in `state` (None: as usual) rather
    than from the loader's own generator, which is left as it is."""
    if state is None or not isinstance(loader, DataLoader):
        return iter(loader)
    generator = torch.Generator()
    set_generator_state(generator, state)
    own = loader.generator
    loader.generator = generator
    try:
        return iter(loader)
    finally:
        loader.generator = own


def _worker_processes(loader: Any) -> int:
    return int(getattr(loader, "num_workers", 0) or 0)


def _warn_worker_draws(loader: Any) -> bool:
    """Say that a pass resumed mid-epoch from its row (not by drawing the batches before it) is
    not exact for random draws inside the loader's worker processes: each worker's generator
    starts again with the pass, and the rows it skipped drew nothing. Whether it said so."""
    workers = _worker_processes(loader)
    if not workers:
        return False
    logger.warning(
        "a pass of a DataLoader with worker processes (num_workers=%d) goes on in the middle of "
        "its epoch at another group size (or from a state that did not keep where its pass "
        "began): random draws inside the worker processes (random transforms) now differ from "
        "those of the run never interrupted. Draw them in the training process, or seed them "
        "from the sample's index and the epoch, for an exact result",
        workers,
    )
    return True


def _replayed_steps(sampler: EpochSampler, first_row: int, start: int) -> Optional[int]:
    """The steps from `first_row` whose rows end exactly at `start` (the sampler begun at
    `first_row`), or None when no number of steps does (the group's size changed)."""
    sampler.set_start(first_row)
    rows, steps = first_row, 0
    for size in sampler.step_sizes():
        if rows >= start:
            break
        rows, steps = rows + size, steps + 1
    return steps if rows == start else None


def _known_len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


class CallBatches:
    """The batches of one train/validate call; ``len()`` works when the count is known (for tqdm).

    `meters` (an `AverageMeterCollection` or None) is where the default loops record this call's
    metrics: the runner keeps it across a recovery, so that a call that goes on after a lost worker
    reports every step once. `first_index` is the index of the first batch here within the call.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        length: int | None,
        *,
        meters: Any = None,
        first_index: int = 0,
        stream: Optional[BatchStream] = None,
    ) -> None:
        self._batches, self._length, self._stream = batches, length, stream
        self.meters, self.first_index = meters, first_index
        #: The place in its epoch of the batch handed out last: the steps of that epoch finished
        #: before it (0: the epoch's first batch), however many calls, loads or recoveries
        #: those steps took.
        self.epoch_batch_idx = 0
        #: The epoch of the batch handed out last (0: the first), which a call that goes back to
        #: a window begun in an earlier epoch changes as it reaches the next one (None: the
        #: batches are not a stream's).
        self.epoch_idx: Optional[int] = None
        #: The call was asked to stop at a step boundary before its end (to move workers off a
        #: node about to be reclaimed); it goes on later. A loop should then skip what it does at
        #: the end of an epoch (the default loop skips its "epoch" scheduler step).
        self.yielded = False
        #: Set by a loop whose batches reported a `num_samples` other than their rows (tokens,
        #: say): the call's rows are then not its num_samples.
        self.counts_other_than_rows = False

    def __iter__(self) -> Iterator[Any]:
        return self._batches

    def end_of_epoch_due(self) -> bool:
        """Whether the batch handed out last is the last of its epoch, and that end was not
        acted on before: True once per epoch, however many calls, recoveries or loads it
        took. Asked by a loop once it is done with the batch, before it asks for the next (the
        default loop steps its "epoch" schedulers there, so that the state at the epoch's last
        step, a checkpoint's included, holds that step)."""
        return self._stream is not None and self._stream.end_of_epoch_due()

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the number of batches of this call is unknown")
        return self._length


class BatchStream:
    """Keeps the loader iterator alive between calls.

    The loader is ``source.loader(kind)``, or None while none is registered (an operator that
    only validates, or whose own loop brings its data): the stream then stays at position 0 with
    no pass in progress, and only drawing from it (`begin_call`) raises (`missing_loader_error`).
    The `listener`, when given, is told when a pass starts (and gives the epoch for the
    sampler's ``set_epoch``) and when the loop finishes a batch (see `PassListener`).
    ``resume`` (batches to skip) or ``resume_rows`` (the epoch's first unread row, for a planned
    loader) are set after a state load so that the next pass goes on from the same place, with
    `epoch_steps` and `pass_seed` as they were there.
    """

    def __init__(
        self, source: LoaderSource, kind: str, listener: Optional[PassListener] = None
    ) -> None:
        self._source, self.kind, self._listener = source, kind, listener
        self.iterator: Iterator[Any] | None = None
        #: Batches finished in the current pass (since `rows_start` for a planned loader).
        self.position = 0
        self.resume: int | None = None
        self.resume_rows: int | None = None
        #: Planned loaders: the epoch's first unread row when this pass (segment) began, and the
        #: rows of the epoch finished so far.
        self.rows_start = 0
        self.rows = 0
        #: Steps of the current epoch finished (over every pass of it: a resumed one goes on).
        self.epoch_steps = 0
        #: How the epoch's iterator was made (`PassSeed`); a pass that resumes the epoch draws
        #: its worker seed from a copy of the same generator.
        self.pass_seed: Optional[PassSeed] = None
        #: A batch was handed to the loop and the loop has not finished with it yet.
        self.in_flight = False
        #: Rows the whole group reads in the in-flight batch's step, for a loader that can tell
        #: from the batch (a dataset shard); None when unknown.
        self._flight_rows: int | None = None
        #: The epoch `on_new_pass` gave the current pass.
        self.epoch_of_pass: int | None = None
        #: Set at a step boundary (by a step hook) to end the call's batches right there.
        self.stop_requested = False
        self._current: CallBatches | None = None
        # A batch drawn ahead to learn whether a pass of unknown length had ended (_END: none).
        self._peeked: Any = _END
        # Whether this stream said once that a resumed pass's worker processes draw otherwise.
        self._warned_worker_draws = False

    def _loader(self) -> Any:
        return self._source.loader(self.kind)

    def _planned(self) -> EpochSampler | None:
        loader = self._loader()
        return None if loader is None else planned_sampler(loader)

    def _exhausted(self) -> bool:
        length = _known_len(self._loader())
        return length is not None and self.position >= length

    def consumed(self) -> int:
        """Batches already finished in the unfinished pass (0 when none is in progress)."""
        if self.iterator is None:
            return self.resume or 0
        return 0 if self._exhausted() else self.position

    def consumed_rows(self) -> int | None:
        """For a planned loader, rows of the unfinished epoch the group has read (0 when no pass
        is in progress or the last one ended); None for any other loader and without one."""
        sampler = self._planned()
        if sampler is None:
            return None
        if self.iterator is None:
            return self.resume_rows or 0
        return 0 if self._exhausted() else self.rows

    def is_open(self) -> bool:
        """Whether a pass is in progress (its epoch is not over): the next call goes on with it
        rather than starting a new epoch, even when none of its batches is finished yet."""
        if self.iterator is None:
            return self.resume is not None or self.resume_rows is not None
        return not self._exhausted()

    def reset(
        self,
        resume: int | None = None,
        resume_rows: int | None = None,
        *,
        epoch_steps: int = 0,
        pass_seed: Optional[PassSeed] = None,
    ) -> None:
        """Drop the current pass. With `resume` (batches to skip) or `resume_rows` (the epoch's
        first unread row, for a planned loader) the next pass goes on with the same epoch from
        there, even from 0, the epoch's `epoch_steps` finished and its iterator seeded from
        `pass_seed` (None: as a new one would be); without either it starts a new epoch."""
        self.iterator, self.position, self.in_flight = None, 0, False
        self.resume, self.resume_rows = resume, resume_rows
        resuming = resume is not None or resume_rows is not None
        self.epoch_steps = epoch_steps if resuming else 0
        self.pass_seed = pass_seed if resuming else None
        self._peeked = _END

    def begin_call(
        self,
        num_steps: int | None,
        *,
        meters: Any = None,
        first_index: int = 0,
        until_epoch: int | None = None,
    ) -> CallBatches:
        """Batches for one call: ``num_steps`` of them (wrapping into new passes), else the rest
        of the pass, or with `until_epoch`, of every pass up to the end of that epoch."""
        if self._loader() is None:
            raise missing_loader_error(self.kind)
        if num_steps is not None:
            check_int("num_steps", num_steps, minimum=0)
        if self.iterator is not None and self._exhausted():
            self.iterator = None
        if self.iterator is not None and _known_len(self._loader()) is None:
            # Of unknown length (an iterable data set, a streamed shard), a pass that the last call
            # drew to its very end has not said so yet: look one batch ahead, so that this call
            # starts the next epoch rather than returning an empty one.
            if self._peek() is _END:
                self.iterator = None
        if self.iterator is None:
            self._new_pass()
        length = num_steps
        if length is None:
            total = _known_len(self._loader())
            length = None if total is None else max(total - self.position, 0)
        if until_epoch is not None and (self.epoch_of_pass or 0) < until_epoch:
            length = None  # several passes: not known ahead
        self.stop_requested = False
        self._current = CallBatches(
            self._draw(num_steps, until_epoch),
            length,
            meters=meters,
            first_index=first_index,
            stream=self,
        )
        return self._current

    def end_call(self, num_steps: int | None, *, finished: bool) -> None:
        """After the loop of a call. With `finished` (it returned normally) a batch still in its
        hands counts as done, and a call without ``num_steps`` finishes its pass; a call that
        raised leaves the position at its last finished batch, for a recovery to go on from."""
        if not finished:
            return
        if self.in_flight:
            self._complete()
        yielded = self._current is not None and self._current.yielded
        if num_steps is None and not yielded:
            self.iterator, self._peeked = None, _END

    def _new_pass(self) -> None:
        loader = self._loader()
        sampler = self._planned()
        resuming = self.resume is not None or self.resume_rows is not None
        skip, self.resume = self.resume or 0, None
        start, self.resume_rows = self.resume_rows or 0, None
        epoch = None if self._listener is None else self._listener.pass_started(resuming)
        self.epoch_of_pass = epoch
        target = sampler if sampler is not None else getattr(loader, "sampler", None)
        if epoch is not None and hasattr(target, "set_epoch"):
            target.set_epoch(epoch)
        if not resuming:
            self.epoch_steps, self.pass_seed = 0, None
        first_row: Optional[int] = None
        if sampler is not None:
            start = first_row = min(start, sampler.num_rows)
            known = self.pass_seed.first_row if self.pass_seed is not None else None
            replayed = None
            inside = known is not None and known < start < sampler.num_rows
            if inside and _worker_processes(loader):
                # Begin where the seeded iterator began and draw the batches up to `start` again.
                replayed = _replayed_steps(sampler, known, start)
            if replayed is not None:
                assert known is not None
                first_row, skip = known, replayed
            elif 0 < start < sampler.num_rows and known != start and not self._warned_worker_draws:
                self._warned_worker_draws = _warn_worker_draws(loader)
            sampler.set_start(first_row)
        self.rows_start = self.rows = first_row or 0
        if self.pass_seed is None:
            # A new epoch (or one resumed from a state that did not keep it): its iterator draws
            # as usual, from the generator's state now.
            seed = seed_state(loader)
            self.pass_seed = None if seed is None else PassSeed(seed, first_row)
            self.iterator = iter(loader)
        else:
            self.iterator = _iterate_seeded(loader, self.pass_seed.generator)
            # The worker processes now draw from this row on (a resume at another size skips
            # to its row): a later resume replays from here.
            self.pass_seed = self.pass_seed._replace(first_row=first_row)
        self._peeked = _END
        self.position = 0
        for _ in range(skip):
            if next(self.iterator, _END) is _END:
                break
            if sampler is not None:
                self.rows += sampler.step_rows(self.position)
            self.position += 1
        done = resuming and (
            (sampler is not None and sampler.num_batches() == 0)
            or (skip > 0 and (self.position < skip or self._peek() is _END))
        )
        if done:
            # The saved position was the end of its epoch (a pass of unknown length cannot tell
            # before it is drawn past): that epoch is done, so start the next one.
            self._new_pass()

    def end_of_epoch_due(self) -> bool:
        """Whether the batch in the loop's hands is the last of its pass (one of unknown length
        is drawn ahead to tell) and the listener has that epoch's end still to act on."""
        if not self.in_flight or self.iterator is None:
            return False
        length = _known_len(self._loader())
        last = self.position + 1 >= length if length is not None else self._peek() is _END
        if not last:
            return False
        return self._listener is not None and self._listener.end_of_epoch_due(self.epoch_of_pass)

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

    def _complete(self) -> None:
        """The loop finished the batch it was given."""
        sampler = self._planned()
        rows = sampler.step_rows(self.position) if sampler is not None else self._flight_rows
        self.position += 1
        self.epoch_steps += 1
        self.in_flight = False
        if sampler is not None:
            self.rows += rows
        if self._listener is not None:
            self._listener.step_finished(rows)

    def _draw(self, num_steps: int | None, until_epoch: int | None = None) -> Iterator[Any]:
        drawn = 0
        if num_steps == 0:
            return
        while True:
            yielded = False
            for batch in self._batches():
                drawn += 1
                yielded = True
                self.in_flight = True
                self._flight_rows = _group_rows(self._loader(), batch)
                if self._current is not None:
                    self._current.epoch_batch_idx = self.epoch_steps
                    if self.epoch_of_pass is not None:
                        self._current.epoch_idx = self.epoch_of_pass - 1
                yield batch
                # The loop came back for more: it is done with the batch it had.
                self._complete()
                if self.stop_requested:
                    self.stop_requested = False
                    if self._current is not None:
                        self._current.yielded = True
                    return
                if num_steps is not None and drawn >= num_steps:
                    return
            self.iterator = None
            # An empty loader would otherwise wrap forever.
            if not yielded:
                return
            if num_steps is None:
                behind = until_epoch is not None and (self.epoch_of_pass or 0) < until_epoch
                if not behind:
                    return
            self._new_pass()


_END = object()
