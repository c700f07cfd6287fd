"""ParallelStrategy choice and arguments, the precision rule FSDP follows, and the safe DCP metadata reader
(all in one process; training under each strategy is tested in tests/raysgd/test_fsdp.py)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from raysgd_amp import get_precision
from raysgd_operator import ParallelStrategy, TrainingOptions, get_strategy, register_strategy
from raysgd_operator._internal.sharded import merge, read_metadata, split
from raysgd_operator.parallel_strategies import (
    DDPStrategy,
    FSDPStrategy,
    NoStrategy,
    resolve_strategy,
)
from raysgd_operator.parallel_strategies import registry as strategy_registry


def test_names_instances_and_classes() -> None:
    assert isinstance(get_strategy("ddp"), DDPStrategy)
    assert isinstance(get_strategy(None), DDPStrategy)
    assert isinstance(get_strategy("FSDP"), FSDPStrategy)
    assert isinstance(get_strategy("none"), NoStrategy)
    mine = NoStrategy()
    assert get_strategy(mine) is mine
    built = get_strategy(FSDPStrategy, {"reshard_after_forward": False})
    assert built.reshard_after_forward is False
    assert get_strategy("ddp", {"find_unused_parameters": True}).ddp_kwargs == {
        "find_unused_parameters": True
    }


def test_bad_names_and_arguments_say_what_is_accepted() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'zero'.*\['ddp', 'fsdp', 'none'"):
        get_strategy("zero")
    with pytest.raises(ValueError, match=r"strategy 'fsdp'.*shard_modules, reshard_after_forward"):
        get_strategy("fsdp", {"wrap_policy": nn.Linear})
    with pytest.raises(ValueError, match="shard_modules"):
        get_strategy("fsdp", {"shard_modules": [nn.Linear, "x"]})
    with pytest.raises(ValueError, match="cpu_offload"):
        get_strategy("fsdp", {"cpu_offload": "yes"})
    with pytest.raises(ValueError, match="cannot set 'device_ids'"):
        get_strategy("ddp", {"device_ids": [0]})
    with pytest.raises(ValueError, match="cannot be combined with a ParallelStrategy instance"):
        get_strategy(NoStrategy(), {"x": 1})
    with pytest.raises(TypeError, match="strategy_args must be a dict"):
        get_strategy("ddp", [("x", 1)])  # type: ignore[arg-type]


def test_wrap_ddp_false_means_none_and_contradicts_fsdp() -> None:
    assert isinstance(resolve_strategy("ddp", wrap_ddp=False), NoStrategy)
    with pytest.raises(ValueError, match="wrap_ddp=False"):
        resolve_strategy("fsdp", wrap_ddp=False)
    # The trainer's options check the same rule on the driver.
    with pytest.raises(ValueError, match="wrap_ddp=False"):
        TrainingOptions(strategy="fsdp", wrap_ddp=False)
    assert TrainingOptions(strategy="fsdp").sharded
    assert not TrainingOptions().sharded


def test_a_registered_third_party_strategy_is_found_by_name() -> None:
    class Tagged(ParallelStrategy):
        name = "tagged"

        def __init__(self, *, tag: str = "") -> None:
            self.tag = tag

    register_strategy("tagged-test", Tagged)
    assert get_strategy("tagged-test", {"tag": "x"}).tag == "x"
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("tagged-test", Tagged)


def test_overwrite_is_the_one_keyword_that_replaces_a_strategy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy of the registry, so that the test's names do not outlive it.
    monkeypatch.setattr(strategy_registry, "_registry", strategy_registry._registry.copy())

    class First(NoStrategy):
        name = "first"

    class Second(NoStrategy):
        name = "second"

    register_strategy("replaced-test", First)
    with pytest.raises(TypeError, match="replace"):
        register_strategy("replaced-test", Second, replace=True)  # type: ignore[call-arg]
    assert isinstance(get_strategy("replaced-test"), First)
    register_strategy("replaced-test", Second, overwrite=True)
    assert isinstance(get_strategy("replaced-test"), Second)


def test_fsdp_mixed_precision_follows_the_precision_backend() -> None:
    assert get_precision(False).param_dtypes() == (None, None)
    assert get_precision("bf16", device="cpu").param_dtypes() == (torch.bfloat16, torch.float32)


def test_a_whole_state_is_the_strategys_to_give_and_a_sharded_one_has_none() -> None:
    torch.manual_seed(0)
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for strategy in (NoStrategy(), DDPStrategy()):
        models, optimizers = strategy.whole_state([model], [optimizer])
        # The live tensors, not copies: the caller decides whether to copy.
        assert models[0]["weight"].data_ptr() == model.weight.data_ptr()
        into = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
        strategy.load_whole_state([other], [into], models, optimizers)
        assert torch.equal(other.weight, model.weight)
        assert into.param_groups[0]["lr"] == 0.1 and len(into.state) == 2  # weight, bias
    assert not DDPStrategy.wraps_meta_models and FSDPStrategy.wraps_meta_models
    with pytest.raises(RuntimeError, match=r"'fsdp' shards the model.*use save_sharded"):
        FSDPStrategy().whole_state([model], [optimizer])


class _RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo should-not-run",))


def test_dcp_metadata_reader_refuses_anything_but_metadata() -> None:
    with pytest.raises(ValueError, match=r"posix\.system: not allowed"):
        read_metadata(pickle.dumps(_RunsCode()))
    with pytest.raises(ValueError, match="not DCP checkpoint metadata"):
        read_metadata(pickle.dumps({"a": 1}))


def test_split_and_merge_keep_tensors_apart_from_other_values() -> None:
    tree = {"models": {"w": torch.ones(2)}, "optimizers": {"param_groups": [{"lr": 0.1}]}}
    tensors, others = split(tree)
    assert tensors == {"models": {"w": tree["models"]["w"]}}
    assert others == {"optimizers": {"param_groups": [{"lr": 0.1}]}}
    assert merge(tensors, others) == tree


def test_split_and_merge_keep_empty_dicts() -> None:
    # plain SGD's state dict: no per-parameter state, only the groups
    tree = {"models": {"w": torch.ones(1)}, "optimizers": {"state": {}, "param_groups": [{}]}}
    tensors, others = split(tree)
    assert others == {"optimizers": {"state": {}, "param_groups": [{}]}}
    assert merge(tensors, others) == tree
