"""Dataset shards through `OperatorRunner` (no Ray): batch options, epochs, num_steps and resume.

The runner takes any object with ``iter_torch_batches(**kwargs)`` (what a Ray Data ``DataIterator``
offers); `ColumnShard` here is such an object over in-memory columns, with no ``len()``, like a
streamed shard. The Ray Data pipelines themselves are tested in tests/raysgd/test_datasets.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import BATCH_SIZE, DatasetOptions, OperatorRunner, TrainingOperator

NUM_ROWS = 20


class ColumnShard:
    """A shard over columns ``id`` (row number) and ``y`` (2 * id); records the iter kwargs."""

    def __init__(self, num_rows: int = NUM_ROWS) -> None:
        self.ids = torch.arange(num_rows, dtype=torch.float64)
        self.calls: list[dict[str, Any]] = []

    def iter_torch_batches(self, **kwargs: Any) -> Iterator[dict[str, torch.Tensor]]:
        self.calls.append(kwargs)
        size, dtype = kwargs["batch_size"], kwargs.get("dtypes")
        for start in range(0, len(self.ids), size):
            ids = self.ids[start : start + size]
            if kwargs.get("drop_last") and len(ids) < size:
                return
            batch = {"id": ids.unsqueeze(1), "y": 2 * ids.unsqueeze(1)}
            if dtype is not None:
                dtypes = dtype if isinstance(dtype, dict) else dict.fromkeys(batch, dtype)
                batch = {k: v.to(dtypes[k]) for k, v in batch.items()}
            yield {k: v.to(kwargs["device"]) for k, v in batch.items()}


class RecordingOperator(TrainingOperator):
    """Linear model; records the ids of every batch trained, in order."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
            criterion=nn.MSELoss(),
        )
        self.seen: list[int] = []
        if config.get("also_loader"):
            data = TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1))
            self.register_data(train_loader=DataLoader(data, batch_size=2))

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, _ = batch
        self.seen.extend(int(i) for i in ids.flatten())
        return super().train_batch(batch, batch_info)


def _runner(shard: Any, batch: int = 8, **options: Any) -> OperatorRunner:
    options.setdefault("columns", ("id", "y"))
    options.setdefault("dtypes", torch.float32)
    return OperatorRunner(
        RecordingOperator,
        {BATCH_SIZE: batch},
        datasets={"train": shard, "validation": ColumnShard(16)},
        dataset_options=DatasetOptions(**options),
    )


def test_shard_batches_have_the_worker_batch_size_device_and_dtype() -> None:
    shard = ColumnShard()
    runner = _runner(shard, batch=8, drop_last=True, prefetch_batches=2)
    result = runner.train_epoch()
    assert result["num_samples"] == 16 and result["batch_count"] == 2  # 20 rows, last 4 dropped
    assert shard.calls[0] == {
        "batch_size": 8,
        "device": torch.device("cpu"),
        "drop_last": True,
        "prefetch_batches": 2,
        "dtypes": torch.float32,
    }
    assert runner.operator.seen == list(range(16))
    assert runner.validate()["num_samples"] == 16


def test_num_steps_continue_and_wrap_and_train_after_an_exact_end_starts_a_new_epoch() -> None:
    runner = _runner(ColumnShard(), batch=5)  # 4 batches per epoch
    assert runner.train_epoch(num_steps=3)["epoch"] == 1
    assert runner.train_epoch(num_steps=3)["epoch"] == 2  # wrapped
    assert runner.operator.seen == list(range(20)) + list(range(10))
    assert runner.train_epoch(num_steps=2)["epoch"] == 2  # ends exactly at the end of epoch 2
    # A shard has no len(): the next call must see that the pass ended and train a whole epoch,
    # not return an empty one.
    runner.operator.seen.clear()
    result = runner.train_epoch()
    assert result["epoch"] == 3 and result["num_samples"] == 20
    assert runner.operator.seen == list(range(20))


def test_resume_skips_the_saved_position_and_a_position_at_the_end_starts_the_next_epoch() -> None:
    runner = _runner(ColumnShard(), batch=5)
    runner.train_epoch(num_steps=2)
    state = runner.state.state_dict()
    assert state["position"] == 2
    fresh = _runner(ColumnShard(), batch=5)
    fresh.state.load_state_dict(state)
    result = fresh.train_epoch()
    assert result["epoch"] == 1 and result["num_samples"] == 10
    assert fresh.operator.seen == list(range(10, 20))

    runner.train_epoch(num_steps=2)  # exactly at the end of epoch 1; not known yet
    end_state = runner.state.state_dict()
    fresh = _runner(ColumnShard(), batch=5)
    fresh.state.load_state_dict(end_state)
    result = fresh.train_epoch()
    assert result["epoch"] == 2 and result["num_samples"] == 20


def test_rebind_takes_the_new_shards_and_batch_size() -> None:
    runner = _runner(ColumnShard(), batch=5)
    runner.train_epoch(num_steps=1)
    new_shard = ColumnShard(8)
    assert runner.rebind(
        world_rank=0,
        local_rank=0,
        world_size=1,
        config={BATCH_SIZE: 4},
        datasets={"train": new_shard},
    )
    runner.state.load_state_dict(runner.state.state_dict() | {"position": 0})
    result = runner.train_epoch()
    assert result["num_samples"] == 8 and result["batch_count"] == 2
    assert new_shard.calls[0]["batch_size"] == 4
    assert runner.operator.get_dataset_shard("train") is new_shard
    assert runner.operator.get_dataset_shard("validation") is None
    with pytest.raises(ValueError, match="validation"):
        runner.validate()


def test_dict_batches_without_columns_reach_train_batch_as_dicts() -> None:
    class DictOperator(RecordingOperator):
        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            assert isinstance(batch, dict) and sorted(batch) == ["id", "y"]
            return super().train_batch((batch["id"], batch["y"]), batch_info)

    runner = OperatorRunner(
        DictOperator,
        {BATCH_SIZE: 10},
        datasets={"train": ColumnShard()},
        dataset_options=DatasetOptions(dtypes={"id": torch.float32, "y": torch.float32}),
    )
    assert runner.train_epoch()["num_samples"] == NUM_ROWS


def test_a_shard_replaces_the_registered_loader_of_its_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = OperatorRunner(
        RecordingOperator,
        {BATCH_SIZE: 10, "also_loader": True},
        datasets={"train": ColumnShard()},
        dataset_options=DatasetOptions(columns=["id", "y"], dtypes=torch.float32),
    )
    assert "not used" in caplog.text
    assert runner.train_epoch()["num_samples"] == NUM_ROWS


def test_unknown_column_names_the_columns_there_are() -> None:
    runner = _runner(ColumnShard(), columns=("x", "y"))
    with pytest.raises(KeyError, match=r"no column 'x'.*\['id', 'y'\]"):
        runner.train_epoch()


def test_datasets_need_a_batch_size_and_a_shard_api() -> None:
    with pytest.raises(ValueError, match="BATCH_SIZE"):
        OperatorRunner(RecordingOperator, {}, datasets={"train": ColumnShard()})
    with pytest.raises(TypeError, match="iter_torch_batches"):
        OperatorRunner(RecordingOperator, {BATCH_SIZE: 4}, datasets={"train": [1, 2, 3]})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"columns": "xy"}, TypeError, "sequence of column names"),
        ({"columns": ()}, ValueError, "at least one column"),
        ({"dtypes": "float32"}, TypeError, "torch.dtype"),
        ({"collate_fn": 3}, TypeError, "callable"),
        ({"collate_fn": lambda b: b, "dtypes": torch.float32}, ValueError, "excludes"),
        ({"collate_fn": lambda b: b, "columns": ("x",)}, ValueError, "excludes"),
        ({"drop_last": 1}, TypeError, "bool"),
        ({"local_shuffle_buffer_size": 0}, ValueError, ">= 1"),
        ({"prefetch_batches": -1}, ValueError, ">= 0"),
    ],
)
def test_dataset_options_are_checked(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DatasetOptions(**kwargs)


def test_collate_fn_and_shuffle_options_reach_the_shard() -> None:
    def collate(batch: Any) -> Any:
        return batch

    options = DatasetOptions(collate_fn=collate, local_shuffle_buffer_size=64, local_shuffle_seed=3)
    kwargs = options.iter_kwargs(16, torch.device("cpu"))
    assert kwargs["collate_fn"] is collate
    assert (kwargs["local_shuffle_buffer_size"], kwargs["local_shuffle_seed"]) == (64, 3)
    assert "dtypes" not in kwargs
