"""The runner every worker keeps, and what it is built from.

Each worker keeps one long-lived `OperatorRunner` in its `WorkerObjects` (the operator, its data
iterators, epoch and step counters) and, beside it, its `WorkerState` (what it holds of the
training state: see `state`). Both are built from `RunnerArgs`, which the driver makes for the
group's size (`driver.worker_calls.RunnerRecipe`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from raysgd._internal.protocol import RunnerArgs
from raysgd._internal.worker.objects import this_worker
from raysgd_core import get_context
from raysgd_operator import OperatorRunner

__all__ = ["build_runner", "current_runner", "my_dataset_splits"]


def current_runner() -> OperatorRunner:
    """This worker's runner."""
    runner = this_worker().runner
    if runner is None:
        raise RuntimeError("this worker has no raysgd runner (it was shut down or never set up)")
    return runner


def my_dataset_splits(dataset_splits: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """This worker's dataset splits out of every rank's (None without datasets)."""
    if not dataset_splits:
        return None
    return dict(dataset_splits[get_context().world_rank])


def build_runner(args: RunnerArgs, *, restoring: bool = False) -> OperatorRunner:
    """Build this worker's runner (which runs the user's `setup`) and keep it in the store.
    `restoring`: a state is loaded right after (wrapping does not sync from rank 0)."""
    ctx = get_context()
    if torch.device(ctx.device).type == "cuda":
        # Let cuDNN time its algorithms once per input shape and keep the fastest, as GPU training
        # scripts usually do; an operator that needs bitwise reproducibility turns it off in setup().
        torch.backends.cudnn.benchmark = True
    runner = OperatorRunner(
        args.operator_cls,
        dict(args.config),
        world_rank=ctx.world_rank,
        local_rank=ctx.local_rank,
        world_size=ctx.world_size,
        device=ctx.device,
        datasets=my_dataset_splits(args.dataset_splits),
        options=args.options,
        restoring=restoring,
        group=ctx.generation,
    )
    this_worker().runner = runner
    return runner
