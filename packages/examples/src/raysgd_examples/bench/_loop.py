"""The training loop the torchrun and Ray Train sides run inside their workers.

raysgd runs the same model, data and step through its own `TrainingOperator` (see `_raysgd.py`);
this file is the hand-written loop that the other two frameworks need. The process group is already
formed when `worker_loop` is called. Only torch is imported here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from raysgd_examples.bench.workload import (
    Timeline,
    Workload,
    make_loader,
    make_model,
    make_optimizer,
    train_step,
)

__all__ = [
    "LoopConfig",
    "first_step_time",
    "maybe_kill",
    "recovery_from_timeline",
    "steps_done_twice",
    "steps_redone_from_timeline",
    "throughput_from_times",
    "worker_loop",
]

#: Keys of the plain dict every side's loop is configured with (it travels through argv/configs).
LoopConfig = dict[str, Any]


def maybe_kill(cfg: LoopConfig, rank: int, step: int, timeline: Timeline) -> None:
    """Die hard (``os._exit(1)``) once, at step ``cfg["kill_at"]`` on rank ``cfg["kill_rank"]``.

    ``kill_rank="all"`` kills every rank. A marker file per rank makes it happen only once: the
    restarted worker passes the same step again.
    """
    victim = cfg.get("kill_rank", 1)
    if cfg.get("kill_at") is None or step != cfg["kill_at"] or victim not in ("all", rank):
        return
    try:
        fd = os.open(f"{cfg['marker']}.{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    # Let the survivors write their previous step's stamp first, so that "the first step after
    # the kill" cannot be a step that finished before it.
    time.sleep(0.5)
    timeline.mark("kill", rank=rank, step=step)
    os._exit(1)


def throughput_from_times(times: list[float], warmup: int, samples_per_step: int) -> float:
    """Samples/s over the steps after the first `warmup` (times are per-step end stamps)."""
    if warmup < 1 or len(times) <= warmup:
        raise ValueError(f"need more than warmup={warmup} step times, got {len(times)}")
    elapsed = times[-1] - times[warmup - 1]
    return (len(times) - warmup) * samples_per_step / elapsed


def first_step_time(timeline: Timeline) -> float:
    """Wall-clock time (``time.time()``) of the first step stamp."""
    steps = [e["t"] for e in timeline.read() if e["event"] == "step"]
    if not steps:
        raise RuntimeError("no step was stamped in the timeline")
    return min(steps)


def recovery_from_timeline(timeline: Timeline) -> float:
    """Seconds from the kill to the first step stamp after it (from any process)."""
    events = timeline.read()
    kills = [e["t"] for e in events if e["event"] == "kill"]
    if not kills:
        raise RuntimeError("no worker was killed: is kill_at beyond the last step?")
    after = [e["t"] for e in events if e["event"] == "step" and e["t"] > min(kills)]
    if not after:
        raise RuntimeError("no step finished after the kill: training did not recover")
    return min(after) - min(kills)


def steps_done_twice(timeline: Timeline) -> int:
    """Steps stamped more than once (done again after a failure), counted each extra time."""
    steps = [e["step"] for e in timeline.read() if e["event"] == "step"]
    return len(steps) - len(set(steps))


def steps_redone_from_timeline(timeline: Timeline) -> int:
    """Steps done again after the kill: from the first step stamped after it back to the step the
    worker died in (which was in flight), e.g. 1 when training went on from the step it had
    reached, ``kill step + 1`` when it started over."""
    events = timeline.read()
    kill = min((e for e in events if e["event"] == "kill"), key=lambda e: e["t"])
    after = [e for e in events if e["event"] == "step" and e["t"] > kill["t"]]
    if not after:
        raise RuntimeError("no step finished after the kill: training did not recover")
    first = min(after, key=lambda e: e["t"])
    return int(kill["step"]) - int(first["step"]) + 1


def worker_loop(
    cfg: LoopConfig,
    wrap: Callable[[nn.Module], nn.Module],
    report: Optional[Callable[..., None]] = None,
    batches: Optional[Iterable[Any]] = None,
    resume: Optional[Callable[[], Optional[dict[str, Any]]]] = None,
) -> None:
    """Train ``cfg["warmup"] + cfg["steps"]`` steps; rank 0 writes step times to ``cfg["result"]``.

    Args:
        cfg: ``workload`` (dict of `Workload`), ``warmup``, ``steps``, and optionally ``result``
            (JSON path), ``timeline`` (events path), ``kill_at``/``kill_rank``/``marker``.
        wrap: The framework's DDP wrapping (`DistributedDataParallel` or Ray's `prepare_model`).
        report: Called after each step (Ray Train reports there), or None; with
            ``cfg["checkpoint"]``, called as ``report(step, state)`` with the state to save every
            ``cfg["checkpoint"]["every"]`` steps.
        batches: ``(features, target)`` batches to train on instead of the workload's loader
            (a Ray Data shard's), or None.
        resume: Returns the state saved last (``{"model", "optimizer", "step"}``) or None; the
            default reads ``cfg["checkpoint"]["path"]``, which rank 0 writes every
            ``cfg["checkpoint"]["every"]`` steps (torchrun's practice after a restart).

    Every process stamps its pid in the timeline (``pid``, with its rank), so that a failure
    injector can pick a worker.
    """
    workload = Workload(**cfg["workload"])
    torch.set_num_threads(workload.threads)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = cfg["warmup"] + cfg["steps"]
    model = wrap(make_model(workload))
    optimizer = make_optimizer(model, workload)
    criterion = nn.CrossEntropyLoss()
    loader = batches if batches is not None else make_loader(workload, total, rank, world_size)
    timeline = Timeline(cfg.get("timeline"))
    timeline.mark("pid", rank=rank)
    checkpoint = cfg.get("checkpoint") or {}
    every = int(checkpoint.get("every") or 0)
    first = 0
    saved = (resume or (lambda: _read_checkpoint(checkpoint.get("path"))))() if every else None
    if saved is not None:
        getattr(model, "module", model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first = int(saved["step"]) + 1
    times: list[float] = []
    model.train()
    for step, batch in enumerate(loader):
        if step < first:
            continue  # done before the restart, and kept in the checkpoint
        maybe_kill(cfg, rank, step, timeline)
        train_step(model, optimizer, criterion, batch)
        times.append(time.perf_counter())
        due = every and (step + 1) % every == 0
        if report is not None:
            if due:
                report(step, _state(model, optimizer, step))
            else:
                report(step)
        elif due and rank == 0:
            _write_checkpoint(checkpoint["path"], _state(model, optimizer, step))
        if rank == 0:
            timeline.mark("step", step=step)
    if rank == 0 and cfg.get("result"):
        with open(cfg["result"], "w", encoding="utf-8") as f:
            json.dump({"times": times, "world_size": world_size}, f)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    inner = getattr(model, "module", model)
    return {"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def _write_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Rank 0 saves the state atomically (a temp file renamed over the last one)."""
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _read_checkpoint(path: Optional[str]) -> Optional[dict[str, Any]]:
    if not path or not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
