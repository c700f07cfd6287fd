"""Constructor argument checks for `TorchTrainer`.

Everything here runs on the driver before a single worker starts, so that bad input costs nothing and
fails with an error that names the argument (RaySGD 1.x let most of these surface as worker tracebacks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Optional

from raysgd_base import check_int, check_number
from raysgd_core import GroupOptions
from raysgd_core.options import check_gpus_per_worker
from raysgd_fault import check_max_retries
from raysgd_operator import TrainingOperator

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "check_optional_args",
    "check_train_args",
    "resolve_gpus_per_worker",
    "resolve_operator_cls",
    "start_timeout",
]

#: How long the workers may take to be placed and started when `SGD_PLACEMENT_GROUP_TIMEOUT_S` is
#: unset (RaySGD's default). It covers starting each worker process and importing torch in it, which
#: takes well over half a minute when a busy machine starts several trials' workers at once (Tune).
DEFAULT_START_TIMEOUT_S = 100.0


def start_timeout() -> dict[str, float]:
    """`start_timeout_s` for the worker group: RaySGD's `SGD_PLACEMENT_GROUP_TIMEOUT_S` when set,
    else `DEFAULT_START_TIMEOUT_S`."""
    raw = os.environ.get("SGD_PLACEMENT_GROUP_TIMEOUT_S")
    if not raw:
        return {"start_timeout_s": DEFAULT_START_TIMEOUT_S}
    try:
        return {"start_timeout_s": float(raw)}
    except ValueError:
        raise ValueError(f"SGD_PLACEMENT_GROUP_TIMEOUT_S must be seconds, got {raw!r}") from None


def check_optional_args(*, config: Any, num_cpus_per_worker: Any, initialization_hook: Any) -> None:
    """Checks of the driver-side constructor arguments that no option object makes: the workers'
    options are checked by `raysgd_operator.TrainingOptions`, the group's by
    `raysgd_core.GroupOptions`. `num_cpus_per_worker` is one of the group's, checked here by
    `GroupOptions` itself because the workers' thread count is derived from it first."""
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    GroupOptions(num_cpus_per_worker=num_cpus_per_worker)
    # Checked again as `GroupOptions.init_hook`; here so that the error names RaySGD's keyword.
    if initialization_hook is not None and not callable(initialization_hook):
        raise TypeError("initialization_hook must be a zero-argument callable")


def resolve_gpus_per_worker(num_gpus_per_worker: Any, use_gpu: bool) -> float:
    """The GPUs each worker reserves: `num_gpus_per_worker` when given, else one with `use_gpu`
    (already resolved) and none without.

    What a number of GPUs may be is core's rule (`raysgd_core.options.check_gpus_per_worker`);
    given, it must be above 0 (0 GPUs is `use_gpu=False`).

    Raises:
        ValueError, TypeError: not a number > 0, a fraction above one, or GPUs asked for while
            `use_gpu` is False.
    """
    if num_gpus_per_worker is None:
        return 1 if use_gpu else 0
    check_gpus_per_worker(num_gpus_per_worker)
    check_number("num_gpus_per_worker", num_gpus_per_worker, above=0)
    if not use_gpu:
        raise ValueError(
            f"num_gpus_per_worker={num_gpus_per_worker!r} needs use_gpu=True (use_gpu is False, "
            "or 'auto' on a machine without CUDA)"
        )
    return num_gpus_per_worker


def resolve_operator_cls(
    training_operator_cls: Optional[type],
    *,
    model_creator: Optional[Callable[..., Any]],
    data_creator: Optional[Callable[..., Any]],
    optimizer_creator: Optional[Callable[..., Any]],
    loss_creator: Optional[Any],
    scheduler_creator: Optional[Callable[..., Any]],
    serialize_data_creation: bool,
    has_datasets: bool = False,
) -> type:
    """The operator class to ship: the user's, or one built from creator functions.

    A custom operator given together with creators (e.g. a GAN operator overriding `train_batch`)
    gets the creators through its own `from_creators`, so its overridden loops run on the models the
    creators build. With `has_datasets` (the trainer's `datasets=` feed the loops) no `data_creator`
    is needed.
    """
    creators = {
        "model_creator": model_creator,
        "data_creator": data_creator,
        "optimizer_creator": optimizer_creator,
        "loss_creator": loss_creator,
        "scheduler_creator": scheduler_creator,
    }
    if training_operator_cls is not None and not (
        isinstance(training_operator_cls, type)
        and issubclass(training_operator_cls, TrainingOperator)
    ):
        raise TypeError(
            "training_operator_cls must be a subclass of raysgd.TrainingOperator, "
            f"got {training_operator_cls!r}"
        )
    given = {name: fn for name, fn in creators.items() if fn is not None}
    if not given:
        if training_operator_cls is None:
            raise ValueError(
                "TorchTrainer needs either training_operator_cls=... or the creator functions "
                "model_creator=, data_creator= and optimizer_creator="
            )
        return training_operator_cls
    needed = ("model_creator", "optimizer_creator") + (() if has_datasets else ("data_creator",))
    missing = [n for n in needed if n not in given]
    if missing:
        raise ValueError(
            f"creator-style construction needs model_creator, data_creator (or datasets=) and "
            f"optimizer_creator; missing: {', '.join(missing)}"
        )
    for name, fn in given.items():
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    base = training_operator_cls or TrainingOperator
    return base.from_creators(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        data_creator=data_creator,
        loss_creator=loss_creator,
        scheduler_creator=scheduler_creator,
        serialize_data_creation=serialize_data_creation,
    )


def check_train_args(max_retries: Any, checkpoint: Any, num_steps: Any) -> None:
    """Arguments of `TorchTrainer.train` that are checked on the driver."""
    check_max_retries(max_retries)
    if checkpoint not in (None, False, "auto") and not isinstance(checkpoint, (str, os.PathLike)):
        raise ValueError(f"checkpoint must be None, 'auto' or a file path, got {checkpoint!r}")
    if num_steps is not None:
        check_int("num_steps", num_steps)
