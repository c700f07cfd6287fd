"""The start of the accumulation window in progress: the point a worker can always go back to.

With ``accumulate_grad_batches=k`` an optimizer steps once every k batches (a *window*); the
batches in between only add to the gradients. Inside a window the models, the optimizers and the
precision backend's scaler do not change, but much else does at every batch: the place in the
epoch, the step counters, the random generators (a dropout mask per batch), the operator's
per-rank state (a hidden state carried from batch to batch), the running statistics of
normalisation layers and the call's metrics.

A `WindowStart` keeps those as they were when the window began, so that a worker can be put back
there exactly (`RunPosition.progress`): every batch of the window is then done again, and each
counts once, whatever had been accumulated. Checkpoints and snapshots describe a window start too:
the models and optimizers of any batch of a window are those of its start. Without accumulation
every batch is a window of its own, and the start is the last finished step.

Schedulers are not taken back: they act only when an optimizer steps, at a window's end, and
what steps them inside a window (an "epoch" scheduler at the end of a call) is not done again
with the window's batches.

A window ends with the batch in which an optimizer stepped, or in which the loop asked the
precision backend to step (`TrainingOperator.optimizer_step`: a step skipped for an overflow ends
its window too, as the scaler changed). A loop of the user's own that steps every k batches is
thus followed without being told k.

What differs from rank to rank (`RankSlot`: the generators, the per-rank state, the loader's seed
of the epoch) is what each rank's checkpoints and replicas keep of it; the rest is the same on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from raysgd_operator._internal.rng import set_rng_state
from raysgd_operator._internal.stream import PassSeed
from raysgd_operator._internal.tensors import cpu_copy
from raysgd_operator.metrics import AverageMeterCollection, MetersMark
from raysgd_operator.progress import CallRecord

__all__ = ["RankSlot", "WindowStart"]


@dataclass(frozen=True)
class RankSlot:
    """What one rank held of a window start that its peers do not hold the same.

    Attributes:
        state: The operator's per-rank state (`TrainingOperator.rank_state_dict`), a copy on its
            device (None: the operator keeps none).
        rng: The process's random generators (`rng_state`).
        pass_seed: How the epoch's loader iterator was made (`stream.PassSeed`), None outside an
            epoch or for another kind of loader.
        counted: What this rank had counted in the `train()` call in progress: (the call's id,
            its batches, the sum of their `num_samples`, batches in flight not counted yet);
            None outside a call. A worker that takes the rank's place goes on counting from
            there, so that the call's count is the group's whoever ran each rank (a
            `num_samples` of tokens included). A batch in flight (a slot taken before the
            optimizer step that ends a window, whose `train_batch` has not returned its count)
            is counted at the rank's mean when the slot is loaded.
    """

    state: Any
    rng: dict[str, Any]
    pass_seed: Optional[PassSeed]
    counted: Optional[tuple[Any, int, float, int]] = None

    def to_plain(self) -> dict[str, Any]:
        """The slot as plain CPU tensors and containers (what checkpoints and peers keep, and
        `torch.load(weights_only=True)` reads)."""
        return {
            "state": cpu_copy(self.state),
            "rng": self.rng,
            "pass_seed": None if self.pass_seed is None else self.pass_seed.to_plain(),
            "counted": self.counted,
        }

    def restore_generators(self) -> None:
        """Put this process's generators back to the slot's."""
        set_rng_state(self.rng)


@dataclass(frozen=True)
class WindowStart:
    """A worker as it was when the window in progress began (see the module docstring).

    Attributes:
        position: `OperatorRunner`'s counters and place in the epoch then.
        call: The `train()` call in progress then (its steps and rows so far), or None.
        meters: That call's metrics then: the collection and its mark (None outside a call).
        rank: This rank's own part.
        optimizer_steps: How many optimizer steps the loop had asked for then.
    """

    position: dict[str, Any]
    call: Optional[CallRecord]
    meters: Optional[tuple[AverageMeterCollection, MetersMark]]
    rank: RankSlot
    optimizer_steps: int

    @property
    def step(self) -> int:
        """The step the window started at (steps finished before it)."""
        return int(self.position["step"])
