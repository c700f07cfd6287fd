"""The Ray Train side: the same loop under `ray.train.torch.TorchTrainer`.

Ray Train forms the gloo group and wraps the model with its own `prepare_model`; the loop is
`_loop.worker_loop`, as under torchrun. Times that cross processes go through the timeline file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from raysgd_examples.bench._loop import LoopConfig, worker_loop
from raysgd_examples.bench.workload import Timeline

__all__ = ["fit", "fit_preemptible"]


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
    resume = None
    if (cfg.get("checkpoint") or {}).get("every"):
        # Ray Train's practice: report a checkpoint every so many steps, resume from the newest.
        def report(step: int, state: Any = None) -> None:
            if state is None:
                return
            directory = tempfile.mkdtemp(prefix="raysgd_bench_ckpt_")
            checkpoint = None
            if dist.get_rank() == 0:
                torch.save(state, os.path.join(directory, "state.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({"step": step}, checkpoint=checkpoint)
            shutil.rmtree(directory, ignore_errors=True)

        def resume() -> Any:
            checkpoint = ray.train.get_checkpoint()
            if checkpoint is None:
                return None
            with checkpoint.as_directory() as directory:
                path = os.path.join(directory, "state.pt")
                return torch.load(path, map_location="cpu", weights_only=True)

    elif cfg.get("report"):
        # ray.train.report is a barrier over the workers: only where a benchmark needs it.
        def report(step: int, state: Any = None) -> None:
            ray.train.report({"step": step})

    worker_loop(
        cfg, wrap=ray.train.torch.prepare_model, report=report, batches=batches, resume=resume
    )


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


def _preemptible_train_fn(config: dict[str, Any]) -> None:
    """The loop with Ray Train's preemption handling: after each step every worker asks
    `ray.train.get_preemption_info()` (a barrier) and, the first time it answers, saves a
    just-in-time checkpoint; a run restarted after the preemption resumes from it."""
    import os

    import ray.train
    import ray.train.torch
    from torch import nn

    from raysgd_examples.bench.workload import (
        Workload,
        make_loader,
        make_model,
        make_optimizer,
        train_step,
    )

    cfg: LoopConfig = config["loop"]
    workload = Workload(**cfg["workload"])
    torch.set_num_threads(workload.threads)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    timeline = Timeline(cfg.get("timeline"))
    timeline.mark("node", rank=rank, node=ray.get_runtime_context().get_node_id())
    model = ray.train.torch.prepare_model(make_model(workload))
    optimizer = make_optimizer(model, workload)
    criterion = nn.CrossEntropyLoss()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"]) + 1
    loader = make_loader(workload, cfg["steps"], rank, world_size)
    saved_once = False
    model.train()
    for step, batch in enumerate(loader):
        if step < start:
            continue
        train_step(model, optimizer, criterion, batch)
        if rank == 0:
            timeline.mark("step", step=step)
        if not saved_once and _preemption_notice():
            saved_once = True
            folder = tempfile.mkdtemp(prefix="raysgd_bench_jit_")
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, os.path.join(folder, "state.pt"))
                timeline.mark("checkpoint", step=step)
            ray.train.report(
                {"step": step},
                checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None,
            )


def _preemption_notice() -> bool:
    """Whether Ray Train says this worker's node is being preempted; always False on a Ray whose
    Train has no `get_preemption_info` (the run then restarts from scratch when the node goes)."""
    import ray.train

    get_info = getattr(ray.train, "get_preemption_info", None)
    return get_info is not None and get_info() is not None


def _preemption_failure_config() -> Any:
    """Ray Train's answer to a preemption where it has one (restarts that a preemption caused are
    not counted), else a plain restart after the node's loss."""
    import inspect

    from ray.train import FailureConfig

    if "max_preemption_failures" in inspect.signature(FailureConfig).parameters:
        return FailureConfig(max_failures=0, max_preemption_failures=-1)
    return FailureConfig(max_failures=1)


def fit_preemptible(cfg: LoopConfig, *, num_workers: int = 2) -> None:
    """Run `cfg` under Ray Train with its just-in-time checkpoint on a preemption notice, and
    restarts from that checkpoint once the node is gone (on a Ray without preemption notices in
    Train: a plain restart from the start)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage = tempfile.mkdtemp(prefix="raysgd_bench_raytrain_")
    try:
        TorchTrainer(
            _preemptible_train_fn,
            train_loop_config={"loop": cfg},
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name=f"bench-{uuid.uuid4().hex[:8]}",
                storage_path=storage,
                failure_config=_preemption_failure_config(),
            ),
        ).fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
