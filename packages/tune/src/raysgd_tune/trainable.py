"""Tune's class API around a raysgd `TorchTrainer`: one trainer (and its workers) per trial.

`make_trainable` (what `TorchTrainer.as_trainable` calls) returns a subclass of `BaseTorchTrainable`
that knows how to build the trainer. Tune then drives it: `setup` builds the trainer inside the trial's
placement group, every `step` is one epoch of training plus validation, and checkpoints are the
trainer's own state file, so Tune's schedulers (PBT, ASHA) and `FailureConfig` work unchanged.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Optional

from ray import tune
from ray.tune import PlacementGroupFactory

from raysgd_core import GroupOptions, resolve_use_gpu, ship_by_value
from raysgd_tune._internal.ray_session import TrialInfo
from raysgd_tune._internal.resources import worker_bundles_request

__all__ = [
    "CHECKPOINT_FILE",
    "RESOURCE_KEYS",
    "BaseTorchTrainable",
    "current_trial",
    "make_trainable",
    "trainer_resource_request",
    "trial_resources",
]

#: File name of the trainer state inside a Tune checkpoint directory (RaySGD 1.x's name).
CHECKPOINT_FILE = "trainer.checkpoint"


def _keyword_defaults(trainer_cls: type) -> dict[str, Any]:
    """The defaults of `trainer_cls`'s keyword arguments, a subclass's winning over its bases'
    (a subclass that takes `**kwargs` and passes them on keeps its base's defaults)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(trainer_cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, param in inspect.signature(init).parameters.items():
            if param.default is not param.empty:
                defaults[name] = param.default
    return defaults


def trial_resources(trainer_cls: type, settings: Mapping[str, Any]) -> PlacementGroupFactory:
    """The resource request of a trial that runs `trainer_cls(**settings)`: each of
    `RESOURCE_KEYS` is taken from `settings`, else from the trainer's own default, so that the
    reservation always matches what the trainer starts. `num_replicas` (PyTorchTrainer's name for
    `num_workers`) is understood."""
    values = {**_keyword_defaults(trainer_cls), **settings}
    if "num_workers" not in settings and values.get("num_replicas") is not None:
        values["num_workers"] = values["num_replicas"]
    missing = [key for key in RESOURCE_KEYS if key not in values]
    if missing:
        raise TypeError(
            f"{trainer_cls.__name__} takes no default for {', '.join(missing)}; "
            "give them in the trainer's arguments or the Tune config"
        )
    return trainer_resource_request(**{key: values[key] for key in RESOURCE_KEYS})


TuneStep = Callable[[Any, dict[str, Any]], Mapping[str, Any]]


def _merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Nested merge: `update` wins on plain keys, nested dicts (`profile`) are merged."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# The trial a `BaseTorchTrainable` runs in this process (a trial's actor runs one trial at a time).
_current_trial: Optional[TrialInfo] = None


def _experiment_name_of(trial_dir: Optional[str]) -> Optional[str]:
    """The Tune experiment a trial directory belongs to: the experiment directory's name (Tune's
    ``RunConfig(name=...)``, else its generated one), None when `trial_dir` is not given.

    Ray 2.x has no public call that tells a class trainable its experiment's name, but its public
    `Trainable.logdir` sits in the experiment's directory: ``<experiment>/<trial>`` in a storage
    path, ``<experiment>/working_dirs/<trial>`` in the trial's local working directory.
    """
    if not trial_dir:
        return None
    parent = os.path.dirname(os.path.normpath(trial_dir))
    if os.path.basename(parent) == "working_dirs":
        parent = os.path.dirname(parent)
    return os.path.basename(parent) or None


def _context_trial() -> TrialInfo:
    """What `ray.tune.get_context()` says: filled in function trainables, empty elsewhere."""
    context = tune.get_context()
    with warnings.catch_warnings():
        # Outside a function trainable Ray warns that it has nothing to say, and returns None.
        warnings.simplefilter("ignore")
        return TrialInfo(
            experiment_name=context.get_experiment_name(),
            trial_name=context.get_trial_name(),
            trial_id=context.get_trial_id(),
            trial_dir=context.get_trial_dir(),
        )


def current_trial() -> Optional[TrialInfo]:
    """The Tune trial this process runs, or None outside Tune.

    In a `BaseTorchTrainable` (`TorchTrainer.as_trainable`) it is the trainable's own trial, set
    from `setup` to `cleanup`; in a function trainable, what `ray.tune.get_context()` tells. Ray
    2.x tells a class trainable its experiment's name only through its `logdir` (see
    `_experiment_name_of`).
    """
    if _current_trial is not None:
        return _current_trial
    info = _context_trial()
    return info if info.trial_name else None


class BaseTorchTrainable(tune.Trainable):
    """A Tune trainable that runs one raysgd `TorchTrainer` per trial.

    Subclasses implement `_create_trainer(tune_config)` (`make_trainable` writes one for you). Each
    `step()` trains one epoch (`train(max_retries=0, profile=True)`; Tune's own `FailureConfig`
    handles failures by restarting the trial from its last checkpoint) and validates once, and
    returns both result dicts merged (`train_loss`, `val_loss`, `val_accuracy`, `epoch`, `profile`,
    ...; on the shared keys `batch_count` and `num_samples` the validation values win, as in RaySGD).
    """

    _trainer: Any = None

    def setup(self, config: dict[str, Any]) -> None:
        """Build the trainer; its workers go into this trial's placement group."""
        global _current_trial
        # So that the trainer's experiment loggers know which trial's run they record.
        _current_trial = TrialInfo(
            experiment_name=_context_trial().experiment_name or _experiment_name_of(self.logdir),
            trial_name=self.trial_name,
            trial_id=self.trial_id,
            trial_dir=self.logdir,
        )
        self._trainer = self._create_trainer(config)

    def _create_trainer(self, tune_config: dict[str, Any]) -> Any:
        """Return a started `TorchTrainer` for this trial. Subclasses must override it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement _create_trainer(tune_config), "
            "or be made with TorchTrainer.as_trainable(...)"
        )

    @property
    def trainer(self) -> Any:
        """The `TorchTrainer` of this trial."""
        if self._trainer is None:
            raise RuntimeError("the trainer exists only between setup() and cleanup()")
        return self._trainer

    def step(self) -> dict[str, Any]:
        """One epoch of training and one pass of validation."""
        train_stats = self.trainer.train(max_retries=0, profile=True)
        val_stats = self.trainer.validate(profile=True)
        return _merge(train_stats, val_stats)

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        """Write the trainer's state (models, optimizers, schedulers, epoch, precision) to
        `checkpoint_dir/trainer.checkpoint`."""
        self.trainer.save(os.path.join(checkpoint_dir, CHECKPOINT_FILE))
        return checkpoint_dir

    def load_checkpoint(self, checkpoint: str | dict[str, Any]) -> None:
        """Restore the trainer from a directory written by `save_checkpoint`."""
        if not isinstance(checkpoint, str):
            raise TypeError(
                f"expected a checkpoint directory written by save_checkpoint, got {type(checkpoint)}"
            )
        self.trainer.load(os.path.join(checkpoint, CHECKPOINT_FILE))

    def cleanup(self) -> None:
        """Stop the trainer's workers; Tune then releases the trial's placement group."""
        global _current_trial
        if self._trainer is not None:
            trainer, self._trainer = self._trainer, None
            trainer.shutdown()
        _current_trial = None


def trainer_resource_request(
    *,
    num_workers: int,
    num_cpus_per_worker: float,
    use_gpu: Any,
    use_local: bool,
    spare_workers: int = GroupOptions.spare_workers,
) -> PlacementGroupFactory:
    """The placement group a trial running one `TorchTrainer` needs: PACK, one bundle of one CPU
    for the trial process plus one per worker and per spare worker (`{"CPU": num_cpus_per_worker,
    "GPU": 0 or 1}`). With `use_local`, rank 0 runs in the trial process, so the trial's own bundle
    is a worker's. The group's options are checked by `raysgd_core.GroupOptions`, as the trainer's
    own group checks them."""
    group = GroupOptions(
        num_cpus_per_worker=num_cpus_per_worker,
        num_gpus_per_worker=int(resolve_use_gpu(use_gpu)),
        use_local=use_local,
        spare_workers=spare_workers,
    )
    return worker_bundles_request(
        num_workers=num_workers, group=group, head_bundle=None if use_local else {"CPU": 1}
    )


#: Trainer keywords that also size the trial's resource request (the keywords of
#: `trainer_resource_request`, read from the trainer's own defaults by `trial_resources`); a Tune
#: config may set them.
RESOURCE_KEYS = tuple(inspect.signature(trainer_resource_request).parameters)


def _check_tune_step(override_tune_step: TuneStep | None) -> None:
    if override_tune_step is None:
        return
    if not callable(override_tune_step):
        raise TypeError(f"override_tune_step must be callable, got {override_tune_step!r}")
    params = inspect.signature(override_tune_step).parameters
    if len(params) != 2:
        raise ValueError(
            "override_tune_step must take exactly two parameters, (trainer, info); "
            f"{getattr(override_tune_step, '__name__', override_tune_step)!r} takes {len(params)}"
        )


def make_trainable(
    trainer_cls: type,
    *args: Any,
    override_tune_step: TuneStep | None = None,
    **kwargs: Any,
) -> type[BaseTorchTrainable]:
    """Return a Tune trainable class that builds `trainer_cls(*args, **kwargs)` in each trial.

    The trial's `config` is merged over `kwargs["config"]` (Tune's values win). `num_workers`,
    `num_cpus_per_worker`, `use_gpu`, `use_local` and `spare_workers` (`RESOURCE_KEYS`) are read
    from the Tune config first, then from `kwargs`, then from the trainer's defaults, both for the
    resource request and for the trainer, so the reservation always matches what the trainer
    starts. The request is a PACK placement group of one bundle for
    the trial (with `use_local`, the trial process is rank 0 and its bundle is a worker's) plus one
    per remote worker and per spare.

    `override_tune_step(trainer, {"iteration": n})`, if given, replaces the default step and returns
    the metrics to report. It must take exactly two parameters (`ValueError` otherwise).
    """
    if not isinstance(trainer_cls, type):
        raise TypeError(f"trainer_cls must be a class, got {trainer_cls!r}")
    _check_tune_step(override_tune_step)
    # Freeze the arguments: Tune pickles the class once and trials must not see each other's edits.
    frozen_args = tuple(args)
    frozen_kwargs = dict(kwargs)
    ship_by_value(trainer_cls, frozen_args, frozen_kwargs, override_tune_step)

    class _Trainable(BaseTorchTrainable):
        _trainer_cls: ClassVar[type] = trainer_cls
        _tune_step: ClassVar[TuneStep | None] = override_tune_step

        @classmethod
        def default_resource_request(cls, config: dict[str, Any]) -> PlacementGroupFactory:
            settings = {**frozen_kwargs, **{k: config[k] for k in RESOURCE_KEYS if k in config}}
            if "num_workers" in config:
                settings.pop("num_replicas", None)
            return trial_resources(trainer_cls, settings)

        def _create_trainer(self, tune_config: dict[str, Any]) -> Any:
            trainer_kwargs = dict(frozen_kwargs)
            trainer_kwargs["config"] = {**(frozen_kwargs.get("config") or {}), **tune_config}
            for key in RESOURCE_KEYS:
                if key in tune_config:
                    trainer_kwargs[key] = tune_config[key]
                    if key == "num_workers":
                        trainer_kwargs.pop("num_replicas", None)
            return trainer_cls(*frozen_args, **trainer_kwargs)

        def step(self) -> dict[str, Any]:
            tune_step = type(self)._tune_step
            if tune_step is None:
                return super().step()
            return dict(tune_step(self.trainer, {"iteration": self.training_iteration}))

    _Trainable.__name__ = _Trainable.__qualname__ = f"{trainer_cls.__name__}Trainable"
    return _Trainable
