"""Every `TorchTrainer` keyword fills an option field (or is the trainer's own, said where), and a
keyword named like a field has that field's default: the keyword list cannot drift from the options."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from raysgd import TorchTrainer
from raysgd._internal.driver.keywords import DERIVED, RENAMED, TRAINER_OWN, route_keywords
from raysgd_core import GroupOptions
from raysgd_operator import TrainingOptions

pytestmark = pytest.mark.timeout(30)

TRAINING = {f.name: f for f in dataclasses.fields(TrainingOptions) if f.init}
GROUP = {f.name: f for f in dataclasses.fields(GroupOptions)}


def _keywords() -> dict[str, inspect.Parameter]:
    params = inspect.signature(TorchTrainer.__init__).parameters
    return {name: p for name, p in params.items() if p.kind is p.KEYWORD_ONLY}


def test_every_keyword_maps_to_one_place() -> None:
    for name in _keywords():
        homes = [
            name in TRAINER_OWN,
            name in DERIVED,
            name in RENAMED,
            name in TRAINING and name not in DERIVED,
            name in GROUP and name not in DERIVED,
        ]
        assert sum(homes) == 1, f"TorchTrainer keyword {name!r} maps to {sum(homes)} places"
    # The tables name only keywords that exist, and renamed ones fill real fields.
    assert set(TRAINER_OWN) | set(DERIVED) | set(RENAMED) <= set(_keywords())
    assert set(RENAMED.values()) <= set(GROUP)


def test_a_keyword_named_like_a_field_has_its_default() -> None:
    for name, param in _keywords().items():
        if name in DERIVED or name in TRAINER_OWN:
            continue
        field = TRAINING.get(RENAMED.get(name, name)) or GROUP[RENAMED.get(name, name)]
        assert param.default == field.default, (name, param.default, field.default)
    # Derived, since it also sets the workers' threads, but it reaches its field as given.
    assert _keywords()["num_cpus_per_worker"].default == GROUP["num_cpus_per_worker"].default


def test_every_training_option_is_reachable_from_the_trainer() -> None:
    """A `TrainingOptions` field no keyword fills could never be set by a user of the trainer."""
    filled = {name for name in _keywords() if name in TRAINING} | {"num_threads", "distributed"}
    assert set(TRAINING) == filled


def test_route_keywords_splits_by_field() -> None:
    def hook() -> None:
        pass

    training, group = route_keywords(
        {
            "use_fp16": "bf16",
            "spare_workers": 2,
            "initialization_hook": hook,
            "config": {"lr": 1},
            "use_gpu": "auto",
        }
    )
    assert training == {"use_fp16": "bf16"}
    assert group == {"spare_workers": 2, "init_hook": hook}
    with pytest.raises(TypeError, match="'bogus' fills no option"):
        route_keywords({"bogus": 1})


def test_group_options_are_checked_and_normalised() -> None:
    options = GroupOptions(env_vars={"A": 1}, timeout_s=5, spare_imports=["json"])
    assert options.env_vars == {"A": "1"} and options.timeout_s == 5.0
    assert options.spare_imports == ("json",)
    assert options.process_group_backend == "gloo"
    assert options.replace(num_gpus_per_worker=1).process_group_backend == "nccl"
    with pytest.raises(TypeError, match=r"unknown worker-group option.*bogus"):
        GroupOptions.build(bogus=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        GroupOptions(backend="mpi")


def test_num_gpus_per_worker_is_checked_against_use_gpu() -> None:
    from raysgd._internal.driver.arguments import resolve_gpus_per_worker

    # None: RaySGD's one GPU per worker with use_gpu, none without.
    assert resolve_gpus_per_worker(None, True) == 1
    assert resolve_gpus_per_worker(None, False) == 0
    # A share lets workers share a GPU; more than one must be whole, as Ray's rule is.
    assert resolve_gpus_per_worker(0.5, True) == 0.5
    assert resolve_gpus_per_worker(2, True) == 2
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="num_gpus_per_worker"):
            resolve_gpus_per_worker(bad, True)
    with pytest.raises(ValueError, match="needs use_gpu=True"):
        resolve_gpus_per_worker(0.5, False)


class _GroupBuilt(Exception):
    """Raised by the stand-in `WorkerGroup`: the options reached it; nothing else starts."""


def test_num_gpus_per_worker_fills_the_group_option(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from torch import nn

    trainer_module = importlib.import_module("raysgd.trainer")
    seen: list[GroupOptions] = []

    def capture(num_workers: int, options: GroupOptions) -> None:
        seen.append(options)
        raise _GroupBuilt

    # The group is built before Ray is touched: this runs on a machine without Ray or a GPU.
    monkeypatch.setattr(trainer_module, "WorkerGroup", capture)
    creators = {
        "model_creator": lambda config: nn.Linear(1, 1),
        "data_creator": lambda config: [],
        "optimizer_creator": lambda model, config: None,
    }
    for given, use_gpu, expected in ((0.5, True, 0.5), (None, True, 1), (None, False, 0)):
        with pytest.raises(_GroupBuilt):
            TorchTrainer(**creators, num_workers=2, use_gpu=use_gpu, num_gpus_per_worker=given)
        assert seen[-1].num_gpus_per_worker == expected
    with pytest.raises(ValueError, match="needs use_gpu=True"):
        TorchTrainer(**creators, num_workers=2, use_gpu=False, num_gpus_per_worker=0.5)
    assert len(seen) == 3
