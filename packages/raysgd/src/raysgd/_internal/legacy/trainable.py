"""`PyTorchTrainable`: the earliest RaySGD's Tune trainable, kept working.

There the Tune config held the `PyTorchTrainer`'s arguments next to the hyperparameters:
`tune.run(PyTorchTrainable, config={"model_creator": ..., "num_replicas": 2, "lr": ...})`.
Trainer arguments are picked out of the config by name; everything else becomes the trainer's
`config`. It binds `PyTorchTrainer`, so it lives in the meta package; `raysgd.compat` imports this
module (and with it Ray Tune) only when the name is first used.
"""

from __future__ import annotations

import inspect
from typing import Any

from ray.tune import PlacementGroupFactory

from raysgd._internal.legacy.trainer import PyTorchTrainer
from raysgd.trainer import TorchTrainer
from raysgd_tune.trainable import BaseTorchTrainable, trial_resources

__all__ = ["PyTorchTrainable"]

# PyTorchTrainer's own names on top of TorchTrainer's keyword arguments.
_LEGACY_ARGS = ("num_replicas", "batch_size")


def _trainer_args() -> set[str]:
    params = inspect.signature(TorchTrainer.__init__).parameters
    return {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY} | set(_LEGACY_ARGS)


class PyTorchTrainable(BaseTorchTrainable):
    """A Tune trainable whose config holds `PyTorchTrainer`'s arguments and the hyperparameters.

    Resources are reserved as for `TorchTrainer.as_trainable`: one CPU for the trial plus one bundle
    per worker and spare (`num_replicas` or `num_workers`, `num_cpus_per_worker`, `use_gpu`,
    `use_local`, `spare_workers`).
    """

    @classmethod
    def default_resource_request(cls, config: dict[str, Any]) -> PlacementGroupFactory:
        return trial_resources(PyTorchTrainer, config)

    def _create_trainer(self, tune_config: dict[str, Any]) -> Any:
        names = _trainer_args()
        kwargs = {k: v for k, v in tune_config.items() if k in names and k != "config"}
        hyperparameters = {k: v for k, v in tune_config.items() if k not in names}
        kwargs["config"] = {**(tune_config.get("config") or {}), **hyperparameters}
        return PyTorchTrainer(**kwargs)
