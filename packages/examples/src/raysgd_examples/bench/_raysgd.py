"""The raysgd side: the same model, data and step as a `TrainingOperator` under `TorchTrainer`.

The operator keeps raysgd's default `train_batch` (the loop a RaySGD user gets) and only adds a
time stamp after each step, plus the one-off kill that the recovery benchmark needs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.bench._loop import LoopConfig, maybe_kill
from raysgd_examples.bench.workload import (
    Timeline,
    Workload,
    make_dataset,
    make_model,
    make_optimizer,
)

__all__ = ["BenchOperator", "make_trainer", "step_times"]


class BenchOperator(TrainingOperator):
    """The benchmark workload; `config["loop"]` is the same dict the other sides get."""

    def setup(self, config: dict[str, Any]) -> None:
        cfg: LoopConfig = config["loop"]
        workload = Workload(**cfg["workload"])
        # One thread per worker, as the torchrun and Ray Train sides set it.
        torch.set_num_threads(workload.threads)
        model = make_model(workload)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=make_optimizer(model, workload),
            criterion=nn.CrossEntropyLoss(),
        )
        total = cfg["warmup"] + cfg["steps"]
        if self.get_dataset_shard("train") is None:  # else the trainer's Ray Data feeds train()
            # A plain loader over the whole data set: raysgd adds the DistributedSampler itself.
            dataset = make_dataset(workload, total, self.world_size)
            self.register_data(
                train_loader=DataLoader(dataset, batch_size=config[BATCH_SIZE], drop_last=True)
            )
        self.bench_cfg = cfg
        self.timeline = Timeline(cfg.get("timeline"))
        self.timeline.mark("pid", rank=self.world_rank)
        self.step_times: list[float] = []

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        maybe_kill(self.bench_cfg, self.world_rank, batch_info["batch_idx"], self.timeline)
        metrics = super().train_batch(batch, batch_info)
        self.step_times.append(time.perf_counter())
        if self.world_rank == 0:
            self.timeline.mark("step", step=batch_info["batch_idx"])
        return metrics


def make_trainer(cfg: LoopConfig, *, num_workers: int = 2, **kwargs: Any) -> TorchTrainer:
    """A raysgd `TorchTrainer` on the workload (global batch = per-worker batch x workers)."""
    workload = Workload(**cfg["workload"])
    return TorchTrainer(
        training_operator_cls=BenchOperator,
        config={"loop": cfg, BATCH_SIZE: workload.batch_size * num_workers},
        num_workers=num_workers,
        num_cpus_per_worker=1,
        use_gpu=False,
        backend="gloo",
        **kwargs,
    )


def step_times(trainer: TorchTrainer) -> list[float]:
    """Rank 0's per-step time stamps (perf_counter of its own process)."""
    return trainer.apply_all_operators(lambda op: op.step_times)[0]
