"""Where each `TorchTrainer` keyword goes.

The trainer keeps RaySGD's keyword arguments (scripts call it that way), but an option's type,
default, check and documentation live in one of two option objects: `raysgd_operator.TrainingOptions`
(how every worker trains) and `raysgd_core.GroupOptions` (how the workers are placed, started and
connected). A keyword named like a field of one of them fills that field; the tables below say where
every other keyword goes. `tests/raysgd/test_trainer_keywords.py` checks that every keyword of
`TorchTrainer.__init__` is accounted for here and that a same-named keyword's default is its field's.

A new worker-side option is a field of `TrainingOptions` (or `GroupOptions`), the keyword of the
same name and default in `TorchTrainer.__init__`, and the code that reads it: nothing here changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raysgd_core import GroupOptions
from raysgd_operator import TrainingOptions

__all__ = ["DERIVED", "RENAMED", "TRAINER_OWN", "route_keywords"]

#: Keywords whose RaySGD name differs from the field they fill: keyword -> GroupOptions field.
RENAMED: dict[str, str] = {"initialization_hook": "init_hook"}

#: Keywords the trainer turns into option values before they are filled (keyword -> what it fills).
DERIVED: dict[str, str] = {
    "use_gpu": 'TrainingOptions.use_gpu ("auto" resolved on the driver) and '
    "GroupOptions.num_gpus_per_worker (1 or 0 unless num_gpus_per_worker is given)",
    "num_gpus_per_worker": "GroupOptions.num_gpus_per_worker (None: from use_gpu; checked "
    "against it by arguments.resolve_gpus_per_worker)",
    "num_cpus_per_worker": "GroupOptions.num_cpus_per_worker and TrainingOptions.num_threads",
    "dataset_options": "TrainingOptions.dataset_options (a dict becomes a DatasetOptions)",
    "num_workers": "the group's size, and TrainingOptions.distributed (more than one worker)",
    "timeout_s": "GroupOptions.timeout_s and peer_grace_s: the ceiling of the workers' bound on "
    "a collective (collective_bound.slow_bound)",
}

#: Keywords that are the trainer's own, not options of the workers or their group.
TRAINER_OWN: dict[str, str] = {
    "training_operator_cls": "the operator class shipped to every worker",
    "model_creator": "creator style: builds the operator class (with the other creators)",
    "data_creator": "creator style",
    "optimizer_creator": "creator style",
    "loss_creator": "creator style",
    "scheduler_creator": "creator style",
    "serialize_data_creation": "creator style: data_creator runs on one worker at a time",
    "config": "the user's config, passed to every hook",
    "failure_policy": "the driver's failure policy (raysgd_fault)",
    "checkpoint_dir": 'where train(checkpoint="auto") writes',
    "logdir": "a TensorBoardLogger on the driver",
    "loggers": "the driver's experiment loggers",
    "datasets": "Ray Data datasets, split over the workers by the driver",
    "state_copy_limit_mb": "the driver's copy of the training state",
    "storage_options": "fsspec options of checkpoint_dir and of save()/load() URLs",
    "checkpoint_every": "the driver's checkpoint plan, handed to each train() call",
    "keep_checkpoints": "the driver's checkpoint plan (retention)",
    "resume": "the driver loads checkpoint_dir's newest checkpoint before the first call",
}


def _fields(options_cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(options_cls) if f.init}


def route_keywords(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keywords that fill a field of the same name (or a `RENAMED` one), as
    (`TrainingOptions` fields, `GroupOptions` fields). `DERIVED` and `TRAINER_OWN` keywords are
    left to the trainer."""
    training_fields, group_fields = _fields(TrainingOptions), _fields(GroupOptions)
    training: dict[str, Any] = {}
    group: dict[str, Any] = {}
    for keyword, value in keywords.items():
        if keyword in DERIVED or keyword in TRAINER_OWN:
            continue
        name = RENAMED.get(keyword, keyword)
        if name in training_fields:
            training[name] = value
        elif name in group_fields:
            group[name] = value
        else:
            raise TypeError(f"TorchTrainer keyword {keyword!r} fills no option")
    return training, group
