"""Which rows of an epoch each worker reads, step by step: every row once, from any point on.

An epoch is one order of the data set's rows (a seeded permutation when the loader shuffled, else
the rows in order). The workers read it in steps: step i takes the next `world_size * batch_size`
rows of that order and gives worker r the rows ``step[r::world_size]``, which is exactly what
`torch.utils.data.DistributedSampler` hands out for full steps. Unlike that sampler, nothing is
padded: the last, shorter step is shared out as it is, and a tail too short to give every worker a
row is merged into the step before it, so every worker still takes the same number of steps (a
worker that ran out early would leave the others waiting in a collective) and every row is read
once per epoch, whatever the number of workers.

Because the order is fixed by the epoch, a group of another size can take over mid-epoch: it
starts at the first row no step has read (`start`), and re-splits what is left among its workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler, Sampler

from raysgd_base import check_int

__all__ = ["EpochSampler", "PlannedBatchSampler", "step_sizes"]

logger = logging.getLogger(__name__)


def step_sizes(remaining: int, world_size: int, batch_size: int, *, drop_last: bool) -> list[int]:
    """How many rows each step of the group reads when `remaining` rows are left in the epoch.

    Full steps read ``world_size * batch_size`` rows. A shorter last step is kept when it gives
    every worker a row, merged into the step before it when it does not, dropped with `drop_last`.
    Only when fewer rows than workers are left altogether is a step shorter than the group (see
    `EpochSampler` for what the workers without a row then do).
    """
    full_step = world_size * batch_size
    full, tail = divmod(max(0, remaining), full_step)
    sizes = [full_step] * full
    if tail and not drop_last:
        if tail >= world_size or not sizes:
            sizes.append(tail)
        else:
            sizes[-1] += tail
    return sizes


class EpochSampler(DistributedSampler):
    """This worker's rows of every epoch, split as the module docstring says.

    A `DistributedSampler` (same `num_replicas`, `rank`, `shuffle`, `seed`, `epoch`, `set_epoch`)
    for code that looks for one; iterating it gives this worker's rows in order, and `batches()`
    the same rows grouped into its steps (what the DataLoader reads, through `PlannedBatchSampler`).

    Args:
        dataset: The data set (only its length is used).
        num_replicas: Workers in the group; rank: this worker's rank in it.
        batch_size: Rows per worker per full step.
        shuffle: Read a permutation seeded by ``seed + epoch``, else the rows in order.
        seed: Base seed of the permutation (the same on every worker).
        drop_last: Drop the last step when it is shorter than a full one (the loader's
            ``drop_last``).
        pad: When fewer rows than workers are left, give the workers without a row of their own a
            copy of one (training: every worker must take the step); else they get no batch
            (validation, whose forward passes wait for nobody).

    `start` is the first row of the epoch's order still to be read (0 for a fresh epoch); the
    group that reads from there may differ from the one that read before it.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int,
        rank: int,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        check_int("batch_size", batch_size)
        self.num_rows = len(dataset)
        self.batch_size, self.drop_last_step, self.pad = int(batch_size), bool(drop_last), pad
        self.start = 0

    def set_start(self, start: int) -> None:
        """Begin at row `start` of the epoch's order (rows before it were read by earlier steps)."""
        if not 0 <= start <= self.num_rows:
            raise ValueError(f"start must be in [0, {self.num_rows}], got {start}")
        self.start = int(start)

    def step_sizes(self) -> list[int]:
        """Rows the whole group reads in each of its steps from `start` on."""
        return step_sizes(
            self.num_rows - self.start,
            self.num_replicas,
            self.batch_size,
            drop_last=self.drop_last_step,
        )

    def step_rows(self, step: int) -> int:
        """Rows the whole group reads in its step `step` (counted from `start`); 0 past the end."""
        sizes = self.step_sizes()
        return sizes[step] if 0 <= step < len(sizes) else 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def batches(self) -> Iterator[list[int]]:
        """This worker's rows, one list per step, from `start` to the end of the epoch."""
        order = self._order()
        offset = self.start
        for size in self.step_sizes():
            rows = order[offset : offset + size]
            offset += size
            mine = rows[self.rank :: self.num_replicas]
            if len(mine) == 0:
                if not self.pad:
                    continue
                # Fewer rows left than workers: this worker repeats one so that it still takes
                # the step with the others (the only case in which a row is read twice).
                again = self.rank % size
                logger.warning(
                    "only %d row(s) left in the epoch for %d workers: worker %d reads row %d again",
                    size,
                    self.num_replicas,
                    self.rank,
                    int(rows[again]),
                )
                mine = rows[again : again + 1]
            yield mine.tolist()

    def num_batches(self) -> int:
        """This worker's steps from `start` on."""
        sizes = self.step_sizes()
        return len(sizes) if self.pad else sum(1 for size in sizes if size > self.rank)

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch

    def __len__(self) -> int:
        return sum(len(batch) for batch in self.batches())


class PlannedBatchSampler(Sampler[list[int]]):
    """An `EpochSampler`'s steps as a DataLoader ``batch_sampler`` (batches may differ in size by a
    row, which a fixed-size batcher could not express)."""

    def __init__(self, sampler: EpochSampler) -> None:
        self.sampler = sampler

    @property
    def batch_size(self) -> int:
        """Rows per worker per full step."""
        return self.sampler.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether a last step shorter than a full one is dropped."""
        return self.sampler.drop_last_step

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        return self.sampler.num_batches()
