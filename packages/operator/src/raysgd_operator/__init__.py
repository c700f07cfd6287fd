"""TrainingOperator, OperatorRunner, metrics and BATCH_SIZE for raysgd (torch only, no Ray)."""

from typing import Any

from raysgd_operator.batch import BATCH_SIZE, BatchSplit
from raysgd_operator.components import Components, RankInfo
from raysgd_operator.dataset_options import DatasetOptions
from raysgd_operator.flops import measure_flops_per_sample, peak_flops_per_s
from raysgd_operator.metrics import (
    BATCH_COUNT,
    NUM_SAMPLES,
    AverageMeter,
    AverageMeterCollection,
    TimerCollection,
    reduce_worker_results,
)
from raysgd_operator.operator import TrainingOperator
from raysgd_operator.options import SCHEDULER_STEP_FREQS, TrainingOptions
from raysgd_operator.parallel_strategies import (
    available_strategies,
    get_strategy,
    register_strategy,
)
from raysgd_operator.parallel_strategy import ParallelStrategy, WrapContext
from raysgd_operator.position import RunPosition
from raysgd_operator.progress import CallRecord, Progress
from raysgd_operator.runner import OperatorRunner
from raysgd_operator.safe_load import load_failure_reason
from raysgd_operator.state_io import StateIO

__version__ = "0.1.0"

#: The modules a worker imports to write or read a sharded (DCP) state, on first use only: a
#: process started ahead of time (a spare worker) can import them while it waits.
SHARDED_STATE_IMPORTS: tuple[str, ...] = (
    "raysgd_operator._internal.sharded",
    "raysgd_operator.sharded_memory",
)


def read_dcp_metadata(data: bytes) -> Any:
    """Parse a `torch.distributed.checkpoint` ``.metadata`` file without running code from it.

    Raises `ValueError` unless ``data`` holds plain DCP metadata.
    """
    # Imported here: torch.distributed.checkpoint takes most of a second to import, which every new
    # worker would otherwise pay at start and on every recovery, although only sharded runs use it.
    from raysgd_operator._internal.sharded import read_metadata

    return read_metadata(data)


__all__ = [
    "BATCH_COUNT",
    "BATCH_SIZE",
    "NUM_SAMPLES",
    "SCHEDULER_STEP_FREQS",
    "SHARDED_STATE_IMPORTS",
    "AverageMeter",
    "AverageMeterCollection",
    "BatchSplit",
    "CallRecord",
    "Components",
    "DatasetOptions",
    "OperatorRunner",
    "ParallelStrategy",
    "Progress",
    "RankInfo",
    "RunPosition",
    "StateIO",
    "TimerCollection",
    "TrainingOperator",
    "TrainingOptions",
    "WrapContext",
    "available_strategies",
    "get_strategy",
    "load_failure_reason",
    "measure_flops_per_sample",
    "peak_flops_per_s",
    "read_dcp_metadata",
    "reduce_worker_results",
    "register_strategy",
]
