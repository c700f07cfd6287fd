"""RaySGD's ``ray.util.sgd.utils`` names: the metric keys, the global batch key and the meters."""

from raysgd_operator import (
    BATCH_COUNT,
    BATCH_SIZE,
    NUM_SAMPLES,
    AverageMeter,
    AverageMeterCollection,
)

__all__ = ["BATCH_COUNT", "BATCH_SIZE", "NUM_SAMPLES", "AverageMeter", "AverageMeterCollection"]
