"""The plain loop of the checkpoint benchmark's torchrun and Ray Train sides.

It trains one of `scale.SIZES`'s MLPs with Adam on synthetic rows (the same model, optimizer, data
and per-worker batch as the raysgd operator of `checkpoint.py`) and, after every `every`-th step,
checkpoints as its `kind` says, rank 0 timing how long the loop waits for it:

- ``none``: never (a run's throughput without checkpoints);
- ``copy``: rank 0 copies the model's and optimizer's tensors to host memory (`host_copy`), the
  least any checkpoint that goes on in the background must block the loop;
- ``dcp_async``: every rank waits for its previous save, then calls
  `torch.distributed.checkpoint.async_save` into a new local folder (over a gloo group of its own,
  so that its background collectives never meet DDP's); the two newest folders are kept;
- ``ray_train``: rank 0 `torch.save`s the state into a new temporary folder and every rank calls
  ``ray.train.report(metrics, checkpoint=...)``, with Ray Train's asynchronous upload where it has
  one;
- ``ray_train_none``: the same report at the same steps, without a checkpoint.

The Ray Train kinds report only at those steps: Ray Train hands reports over in order, so a
report made while an earlier checkpoint is still uploading waits for that upload, and a report at
every step would make the asynchronous upload block the next step.

Rank 0 writes its step time stamps and the checkpoint timings to ``cfg["result"]`` (JSON). Only
torch is imported here; Ray is imported by the Ray Train kinds when they run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from raysgd_examples.bench.scale import make_mlp

__all__ = ["KINDS", "Rows", "checkpoint_loop", "fit_ray_train", "host_copy", "upload_mode"]

#: What the loop does at a checkpoint step (see the module docstring).
KINDS = ("none", "copy", "dcp_async", "ray_train", "ray_train_none")
#: Distinct synthetic rows; the data set cycles over them, so memory stays flat at any length.
POOL = 64
#: Adam's learning rate on every side.
LR = 1e-4


class Rows(Dataset):
    """`length` items of (a `width` float row, a class of 10), cycling over `POOL` seeded rows."""

    def __init__(self, length: int, width: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.length = length
        self.x = torch.randn((POOL, width), generator=gen)
        self.y = torch.randint(0, 10, (POOL,), generator=gen)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = index % POOL
        return self.x[i], self.y[i]


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def host_copy(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The plain copy to host memory: every tensor of the model's and the optimizer's state
    dicts, ``detach().clone()``d (the models here are on the CPU already)."""
    return {"model": _clone(model.state_dict()), "optimizer": _clone(optimizer.state_dict())}


def upload_mode() -> Optional[Any]:
    """Ray Train's asynchronous upload (``ray.train.CheckpointUploadMode.ASYNC``), or None on a
    Ray whose `report` has no upload mode (it then uploads before it returns)."""
    import ray.train

    modes = getattr(ray.train, "CheckpointUploadMode", None)
    return None if modes is None else modes.ASYNC


class _Checkpointer:
    """What the loop does after each step; `record()` is what rank 0 writes to the result."""

    def __init__(self, cfg: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.every = int(cfg["every"])
        self.rank = dist.get_rank()
        self.blocked: list[float] = []  # rank 0's wait per checkpoint, seconds

    def after_step(self, step: int) -> None:
        """`step` counts the finished steps (1 after the first)."""
        if self.every and step % self.every == 0:
            started = time.perf_counter()
            self.checkpoint(step)
            self.blocked.append(time.perf_counter() - started)

    def checkpoint(self, step: int) -> None:
        return None

    def close(self) -> None:
        return None

    def record(self) -> dict[str, Any]:
        return {"blocked": self.blocked}


class _Copy(_Checkpointer):
    def checkpoint(self, step: int) -> None:
        if self.rank == 0:  # the state is replicated: one copy is all a checkpoint needs
            self.last = host_copy(self.model, self.optimizer)


class _DcpAsync(_Checkpointer):
    def __init__(self, cfg: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, model, optimizer)
        self.group = dist.new_group(backend="gloo")
        self.pending: Any = None
        self.folders: list[str] = []

    def checkpoint(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.pending is not None:
            self.pending.result()  # at most one save in flight, as the DCP docs advise
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        folder = os.path.join(self.cfg["folder"], f"step_{step:06d}")
        self.pending = dcp.async_save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=folder,
            process_group=self.group,
        )
        self.folders.append(folder)

    def after_step(self, step: int) -> None:
        super().after_step(step)
        # Keep the two newest finished folders and the one being written (outside the timed
        # wait: a real loop may remove them anywhere).
        if self.rank == 0 and len(self.folders) > 3:
            shutil.rmtree(self.folders.pop(0), ignore_errors=True)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


class _RayReport(_Checkpointer):
    def __init__(self, cfg: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, model, optimizer)
        self.with_checkpoint = cfg["kind"] == "ray_train"
        self.mode = upload_mode()
        self.saves: list[float] = []  # rank 0's torch.save into the temporary folder
        self.reports: list[float] = []  # rank 0's report

    def checkpoint(self, step: int) -> None:
        import ray.train

        started = time.perf_counter()
        checkpoint, folder = None, None
        if self.with_checkpoint and self.rank == 0:
            # A new folder per checkpoint: an asynchronous upload reads it after report returns
            # (and deletes it once uploaded).
            folder = tempfile.mkdtemp(prefix="raysgd_bench_ray_ckpt_")
            module = getattr(self.model, "module", self.model)
            state = {"model": module.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, os.path.join(folder, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        saved = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.with_checkpoint:
            extra["checkpoint_dir_name"] = f"checkpoint_{step:06d}"
            if self.mode is not None:
                extra["checkpoint_upload_mode"] = self.mode
        ray.train.report({"step": step}, checkpoint=checkpoint, **extra)
        self.saves.append(saved - started)
        self.reports.append(time.perf_counter() - saved)
        if folder is not None and self.mode is None:
            shutil.rmtree(folder, ignore_errors=True)  # uploaded before report returned

    def record(self) -> dict[str, Any]:
        mode = "SYNC (report has no upload mode)" if self.mode is None else str(self.mode.value)
        return {
            "blocked": self.blocked,
            "save": self.saves,
            "report": self.reports,
            "upload_mode": mode if self.with_checkpoint else None,
        }


_CHECKPOINTERS: dict[str, Callable[..., _Checkpointer]] = {
    "none": _Checkpointer,
    "copy": _Copy,
    "dcp_async": _DcpAsync,
    "ray_train": _RayReport,
    "ray_train_none": _RayReport,
}


def checkpoint_loop(cfg: dict[str, Any], wrap: Callable[[nn.Module], nn.Module]) -> None:
    """Train ``cfg["warmup"] + cfg["steps"]`` steps, checkpointing as ``cfg["kind"]`` says.

    Args:
        cfg: ``kind`` (one of `KINDS`), ``width``, ``depth``, ``batch_size`` (per worker),
            ``warmup``, ``steps``, ``every``, ``result`` (rank 0's JSON), ``folder`` (dcp_async's
            checkpoints), ``threads`` (torch threads per worker).
        wrap: The framework's DDP wrapping (`DistributedDataParallel` or Ray's `prepare_model`).
    """
    if cfg["kind"] not in _CHECKPOINTERS:
        raise ValueError(f"unknown checkpoint kind {cfg['kind']!r}; choose one of {KINDS}")
    torch.set_num_threads(int(cfg.get("threads", 1)))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = cfg["warmup"] + cfg["steps"]
    model = wrap(make_mlp(cfg["width"], cfg["depth"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    rows = Rows(total * cfg["batch_size"] * world_size, cfg["width"])
    sampler = DistributedSampler(rows, world_size, rank, shuffle=False)
    loader = DataLoader(rows, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True)
    checkpointer = _CHECKPOINTERS[cfg["kind"]](cfg, model, optimizer)
    times: list[float] = []
    model.train()
    for step, (features, target) in enumerate(loader, start=1):
        loss = criterion(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # the sync every side pays (raysgd reads its loss metric)
        times.append(time.perf_counter())
        checkpointer.after_step(step)
    checkpointer.close()
    if rank == 0 and cfg.get("result"):
        with open(cfg["result"], "w", encoding="utf-8") as f:
            json.dump({"times": times, "world_size": world_size, **checkpointer.record()}, f)


def _ray_train_fn(config: dict[str, Any]) -> None:
    import ray.train.torch

    checkpoint_loop(config["loop"], wrap=ray.train.torch.prepare_model)


def fit_ray_train(
    cfg: dict[str, Any],
    *,
    num_workers: int = 2,
    storage_path: Optional[str] = None,
    storage_filesystem: Any = None,
    keep: int = 2,
) -> Any:
    """Run the loop under Ray Train on the running Ray cluster; returns Ray Train's `Result`.

    Checkpoints go to `storage_path` (a path on `storage_filesystem` when one is given, e.g.
    ``bucket/prefix`` on a `pyarrow.fs.S3FileSystem`), else to a temporary folder removed at the
    end; the `keep` newest are kept."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    local = storage_path is None
    path = tempfile.mkdtemp(prefix="raysgd_bench_raytrain_") if local else storage_path
    try:
        return TorchTrainer(
            _ray_train_fn,
            train_loop_config={"loop": cfg},
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name=f"bench-{uuid.uuid4().hex[:8]}",
                storage_path=path,
                storage_filesystem=storage_filesystem,
                checkpoint_config=CheckpointConfig(num_to_keep=keep),
            ),
        ).fit()
    finally:
        if local:
            shutil.rmtree(path, ignore_errors=True)
