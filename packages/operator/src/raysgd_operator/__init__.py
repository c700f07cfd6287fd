"""TrainingOperator, OperatorRunner, metrics and BATCH_SIZE for raysgd (torch only, no Ray)."""

from raysgd_operator.batch import BATCH_SIZE, check_batch_size, split_batch_size
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
from raysgd_operator.runner import OperatorRunner

__version__ = "0.1.0"
__all__ = [
    "BATCH_COUNT",
    "BATCH_SIZE",
    "NUM_SAMPLES",
    "SCHEDULER_STEP_FREQS",
    "AverageMeter",
    "AverageMeterCollection",
    "OperatorRunner",
    "TimerCollection",
    "TrainingOperator",
    "TrainingOptions",
    "check_batch_size",
    "reduce_worker_results",
    "split_batch_size",
]
