"""RaySGD's ``ray.util.sgd.utils`` names: the global batch key and the metric meters."""

from raysgd_operator import BATCH_SIZE, AverageMeter, AverageMeterCollection

__all__ = ["BATCH_SIZE", "AverageMeter", "AverageMeterCollection"]
