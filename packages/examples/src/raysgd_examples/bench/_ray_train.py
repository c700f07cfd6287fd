"""The Ray Train side: the same loop under `ray.train.torch.TorchTrainer`.

Ray Train forms the gloo group and wraps the model with its own `prepare_model`; the loop is
`_loop.worker_loop`, as under torchrun. Times that cross processes go through the timeline file.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from raysgd_examples.bench._loop import LoopConfig, worker_loop
from raysgd_examples.bench.workload import Timeline

__all__ = ["fit"]


def _train_fn(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    cfg: LoopConfig = config["loop"]
    if cfg.get("mode") == "allreduce":
        value = torch.ones(1)
        dist.all_reduce(value)
        ray.train.report({"step": 0})
        if dist.get_rank() == 0:
            Timeline(cfg.get("timeline")).mark("step", step=0)
        return
    batches = None
    if cfg.get("dataset"):
        # The Ray Data way of Ray Train: each worker reads its shard of the trainer's dataset.
        shard = ray.train.get_dataset_shard("train")
        size = cfg["workload"]["batch_size"]
        batches = ((b["image"], b["label"]) for b in shard.iter_torch_batches(batch_size=size))
    report = None
    if cfg.get("report"):
        # ray.train.report is a barrier over the workers: only where a benchmark needs it.
        def report(step: int) -> None:
            ray.train.report({"step": step})

    worker_loop(cfg, wrap=ray.train.torch.prepare_model, report=report, batches=batches)


def fit(
    cfg: LoopConfig, *, num_workers: int = 2, max_failures: int = 0, dataset: Any = None
) -> None:
    """Run `cfg` with Ray Train on the running Ray cluster; storage goes to a temporary folder.

    With `dataset` (a Ray Data dataset of ``image``/``label`` rows) the workers train on their
    shards of it instead of the workload's DataLoader."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage = tempfile.mkdtemp(prefix="raysgd_bench_raytrain_")
    try:
        if dataset is not None:
            cfg = {**cfg, "dataset": True}
        trainer = TorchTrainer(
            _train_fn,
            train_loop_config={"loop": cfg},
            datasets={"train": dataset} if dataset is not None else None,
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name=f"bench-{uuid.uuid4().hex[:8]}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=max_failures),
            ),
        )
        trainer.fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
