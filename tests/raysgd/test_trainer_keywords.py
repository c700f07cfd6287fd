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
