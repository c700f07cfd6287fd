"""The three sides of `bench:gpu`, each run in a child process for every precision asked for.

- ``plain``: `timed_loop` in this process on ``cuda:0`` (one GPU: the single-process reference).
- ``raysgd``: `TorchTrainer(num_workers=<GPUs>, use_gpu=True, use_fp16=...)` with raysgd's own
  default `train_batch`; one warm-up `train(num_steps=warmup)`, then one timed
  `train(num_steps=steps)`, timed inside rank 0 (device drained at both ends, as the other sides)
  and, separately, on the driver around the whole call.
- ``ray_train``: `ray.train.torch.TorchTrainer` running `timed_loop` on every GPU, timed in rank 0.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from raysgd import TorchTrainer, TrainingOperator
from raysgd_examples.bench._gpu_workload import (
    GpuJob,
    StepClock,
    make_loader,
    make_model,
    make_optimizer,
    timed_loop,
)

__all__ = ["GpuOperator", "measure_plain", "measure_ray_train", "measure_raysgd"]

#: raysgd's ``use_fp16`` for each precision.
_USE_FP16 = {"fp32": False, "fp16": "fp16", "bf16": "bf16"}


def measure_plain(jobs: Sequence[GpuJob], use_gpu: bool = True) -> dict[str, Any]:
    """The plain loop on one GPU (``use_gpu=False``: the CPU) for every job (one per precision)."""
    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    out: dict[str, Any] = {}
    for job in jobs:
        model, described = make_model(job["num_classes"], job["seed"])
        result = timed_loop(job, model.to(device), device)
        out[job["precision"]] = {**result, "gpus": 1, "model": described}
        del model
        if use_gpu:
            torch.cuda.empty_cache()
    return out


# -- raysgd -----------------------------------------------------------------------------------
class GpuOperator(TrainingOperator):
    """raysgd's default training loop on the benchmark job; only a clock is added around it."""

    def setup(self, config: dict[str, Any]) -> None:
        job: GpuJob = config["job"]
        model, self.described = make_model(job["num_classes"], job["seed"])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=make_optimizer(model), criterion=nn.CrossEntropyLoss()
        )
        self.register_data(train_loader=make_loader(job))
        self.clock = StepClock(self.device)
        self.timed_steps = 0

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.timed_steps and batch_info["batch_idx"] == 0:
            self.clock.begin()
        metrics = super().train_batch(batch, batch_info)
        if self.timed_steps and batch_info["batch_idx"] == self.timed_steps - 1:
            self.clock.end()
        return metrics


# Module-level (not closures): Ray ships them by reference to workers that import this module.
def _set_timed(steps: int, op: GpuOperator) -> None:
    op.timed_steps = steps


def _report(op: GpuOperator) -> tuple[Any, ...]:
    return op.clock.elapsed, torch.get_num_threads(), op.described, torch.backends.cudnn.benchmark


def measure_raysgd(jobs: Sequence[GpuJob], num_gpus: int, use_gpu: bool = True) -> dict[str, Any]:
    """raysgd's `TorchTrainer` on every GPU for every job (a new trainer per precision)."""
    out: dict[str, Any] = {}
    for job in jobs:
        trainer = TorchTrainer(
            training_operator_cls=GpuOperator,
            config={"job": job},
            num_workers=num_gpus,
            use_gpu=use_gpu,
            use_fp16=_USE_FP16[job["precision"]],
        )
        try:
            trainer.train(num_steps=job["warmup"])
            trainer.apply_all_operators(functools.partial(_set_timed, job["steps"]))
            start = time.perf_counter()
            trainer.train(num_steps=job["steps"])
            driver_s = time.perf_counter() - start
            elapsed, threads, described, benchmark = trainer.apply_all_operators(_report)[0]
        finally:
            trainer.shutdown()
        out[job["precision"]] = {
            "elapsed_s": elapsed,
            "driver_elapsed_s": driver_s,
            "threads": threads,
            "cudnn_benchmark": benchmark,
            "gpus": num_gpus,
            "model": described,
        }
    return out


# -- Ray Train --------------------------------------------------------------------------------
def _ray_train_fn(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    job: GpuJob = config["job"]
    device = ray.train.torch.get_device()
    model, described = make_model(job["num_classes"], job["seed"])
    model = ray.train.torch.prepare_model(model)
    result = timed_loop(job, model, device)
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["result"], "w", encoding="utf-8") as f:
            json.dump({**result, "model": described}, f)


def measure_ray_train(
    jobs: Sequence[GpuJob], num_gpus: int, use_gpu: bool = True
) -> dict[str, Any]:
    """Ray Train's `TorchTrainer` running the plain loop on every GPU, for every job."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out: dict[str, Any] = {}
    storage = tempfile.mkdtemp(prefix="raysgd_bench_gpu_")
    try:
        for job in jobs:
            result_path = os.path.join(storage, f"{job['precision']}.json")
            TorchTrainer(
                _ray_train_fn,
                train_loop_config={"job": job, "result": result_path},
                scaling_config=ScalingConfig(num_workers=num_gpus, use_gpu=use_gpu),
                run_config=RunConfig(
                    name=f"bench-gpu-{uuid.uuid4().hex[:8]}", storage_path=storage
                ),
            ).fit()
            with open(result_path, encoding="utf-8") as f:
                out[job["precision"]] = {**json.load(f), "gpus": num_gpus}
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return out
