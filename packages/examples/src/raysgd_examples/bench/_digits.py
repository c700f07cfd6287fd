"""The recovery benchmark's real-job side: the digits CNN of `raysgd_examples.digits`, as users run it.

Same operator (model, Adam, data set of 8x8 digits, shuffled loader), plus the one-off kill and the
step stamps the benchmark reads.
"""

from __future__ import annotations

from typing import Any

from raysgd import TorchTrainer
from raysgd.utils import BATCH_SIZE
from raysgd_examples.bench._loop import LoopConfig, maybe_kill
from raysgd_examples.bench.workload import Timeline
from raysgd_examples.digits import DigitsOperator

__all__ = ["DigitsBenchOperator", "make_trainer"]


class DigitsBenchOperator(DigitsOperator):
    """`DigitsOperator` that dies once at ``loop["kill_at"]`` and stamps every step of rank 0."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        self.bench_cfg: LoopConfig = config["loop"]
        self.timeline = Timeline(self.bench_cfg.get("timeline"))

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        maybe_kill(self.bench_cfg, self.world_rank, batch_info["batch_idx"], self.timeline)
        metrics = super().train_batch(batch, batch_info)
        if self.world_rank == 0:
            self.timeline.mark("step", step=batch_info["batch_idx"])
        return metrics


def make_trainer(cfg: LoopConfig, *, num_workers: int = 2, **kwargs: Any) -> TorchTrainer:
    """The digits trainer of `raysgd_examples.digits` (global batch 64), one CPU per worker;
    `kwargs` go to `TorchTrainer`."""
    return TorchTrainer(
        training_operator_cls=DigitsBenchOperator,
        config={"loop": cfg, BATCH_SIZE: 64},
        num_workers=num_workers,
        num_cpus_per_worker=1,
        use_gpu=False,
        **kwargs,
    )
