"""Ray Data input: `TorchTrainer(datasets=...)` on real Ray Data pipelines and real worker deaths.

Every row carries its id, and the operator records the ids each worker trained on in the last
train/validate call, so that a test can check that an epoch covered every row once over all workers
(count and checksum); it also appends every finished step's ids to a file of its process, which
outlives a killed worker. The pipelines read a Parquet file the test writes, or numpy arrays,
through a ``map_batches`` step. The shared cluster has 4 CPUs: 2 go to the workers, the rest run
Ray Data's tasks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn

from raysgd import DatasetOptions, TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_fault import Action, Decision, DefaultPolicy, FailurePolicy, FailureStatus

pytestmark = pytest.mark.usefixtures("ray_local")

NUM_ROWS = 103  # uneven: not a multiple of the workers nor of the batch
NUM_VAL_ROWS = 64
GLOBAL_BATCH = 16
OPTIONS = DatasetOptions(columns=("id", "x", "y"), dtypes=torch.float32)


def _features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = batch["id"]
    x = (ids.astype(np.float32) / NUM_ROWS).reshape(-1, 1)
    return {"id": ids, "x": x, "y": 3 * x + 1}


def _from_numpy(num_rows: int) -> Any:
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data.from_numpy(np.arange(num_rows)).map_batches(
        lambda b: _features({"id": b["data"]})
    )


@pytest.fixture(scope="module")
def parquet_dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`NUM_ROWS` rows in a Parquet file of 4 row groups, read back through `map_batches`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ray.data.DataContext.get_current().enable_progress_bars = False
    path = tmp_path_factory.mktemp("data") / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(NUM_ROWS)}), path, row_group_size=26)
    return ray.data.read_parquet(str(path)).map_batches(_features)


class RecordingOperator(TrainingOperator):
    """Linear regression on `x`; records the ids and batch sizes of the current call."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
        )
        self.ids: list[int] = []
        self.sizes: list[int] = []

    def train_epoch(self, iterator: Any, info: dict[str, Any]) -> dict[str, Any]:
        self.ids, self.sizes = [], []
        return super().train_epoch(iterator, info)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, x, y = batch
        self._maybe_die(batch_info)
        self.ids.extend(int(i) for i in ids.flatten())
        self.sizes.append(len(ids))
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config.get("marker_dir"), batch_info["epoch_idx"] + 1, ids.flatten())
        return metrics

    def validate(self, val_iterator: Any, info: dict[str, Any]) -> dict[str, Any]:
        self.ids = []
        return super().validate(val_iterator, info)

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        ids, x, y = batch
        self.ids.extend(int(i) for i in ids.flatten())
        return super().validate_batch((x, y), batch_info)

    def _maybe_die(self, batch_info: dict[str, Any]) -> None:
        """Exit at the second batch of a call when the test left a `die-rank<r>` file (once)."""
        folder = self.config.get("marker_dir")
        if not folder or batch_info["batch_idx"] != 1:
            return
        marker = os.path.join(folder, f"die-rank{self.world_rank}")
        try:
            os.rename(marker, marker + ".done")  # atomic: exactly one process claims it
        except FileNotFoundError:
            return
        os._exit(1)


def _ids(trainer: TorchTrainer) -> list[list[int]]:
    return trainer.apply_all_operators(lambda op: list(op.ids))


def _assert_once(per_worker: list[list[int]], num_rows: int) -> None:
    """Every row once over all workers; the equal split drops fewer rows than there are workers."""
    seen = [i for ids in per_worker for i in ids]
    assert len(set(seen)) == len(seen), "a row was trained twice in one epoch"
    assert set(seen) <= set(range(num_rows))
    assert num_rows - len(per_worker) < len(seen) <= num_rows
    assert len({len(ids) for ids in per_worker}) == 1, "the shards are not equal"


def _live_split_coordinators() -> frozenset[str]:
    """The ids of the alive Ray Data split coordinators (one per dataset split that is still
    referenced).

    No public Ray API lists actors without the dashboard (`ray.util.state` needs it), so this reads
    the actor table through Ray's private state module; the tests assert it finds the live ones,
    so a change there fails loudly.
    """
    from ray._private import state

    return frozenset(
        actor_id
        for actor_id, actor in state.actors().items()
        if actor.get("ActorClassName") == "SplitCoordinator" and actor.get("State") == "ALIVE"
    )


def _new_coordinators(before: frozenset[str], expected: int, timeout_s: float = 15.0) -> int:
    """How many live split coordinators are not among `before`, once that is `expected` (or the
    time is up). A coordinator of an earlier test may still be shutting down: it is in `before`,
    and whenever it goes, no count here changes."""
    deadline = time.monotonic() + timeout_s
    new = len(_live_split_coordinators() - before)
    while new != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        new = len(_live_split_coordinators() - before)
    return new


def _make(
    datasets: dict[str, Any], tmp_path: Path, num_workers: int = 2, **kwargs: Any
) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=RecordingOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(tmp_path)},
        num_workers=num_workers,
        datasets=datasets,
        dataset_options=OPTIONS,
        timeout_s=60,  # safety net only: no test depends on it
        **kwargs,
    )


@pytest.mark.timeout(180)
def test_each_epoch_sees_every_row_once_over_the_workers(
    parquet_dataset: Any, tmp_path: Path
) -> None:
    validation = _from_numpy(NUM_VAL_ROWS)
    trainer = _make({"train": parquet_dataset, "validation": validation}, tmp_path, use_local=True)
    try:
        # The first epoch in pieces: num_steps continues, and train() finishes the epoch.
        first = trainer.train(num_steps=3)
        per_worker = _ids(trainer)
        sizes = trainer.apply_all_operators(lambda op: list(op.sizes))
        rest = trainer.train()
        per_worker = [a + b for a, b in zip(per_worker, _ids(trainer))]
        assert (first["epoch"], rest["epoch"]) == (1, 1)
        _assert_once(per_worker, NUM_ROWS)
        assert first["num_samples"] + rest["num_samples"] == sum(map(len, per_worker))
        # Each worker's batches are its share of the global batch.
        assert sizes == [[GLOBAL_BATCH // 2] * 3] * 2

        val = trainer.validate()
        val_ids = _ids(trainer)
        assert val["num_samples"] == NUM_VAL_ROWS  # divides over 2 workers: nothing dropped
        assert sorted(i for ids in val_ids for i in ids) == list(range(NUM_VAL_ROWS))
        assert sum(i for ids in val_ids for i in ids) == NUM_VAL_ROWS * (NUM_VAL_ROWS - 1) // 2
    finally:
        trainer.shutdown()


def _initial_params() -> list[float]:
    torch.manual_seed(0)  # as RecordingOperator.setup
    return [p.item() for p in nn.Linear(1, 1).parameters()]


def _params(operator: Any) -> list[float]:
    """The model's weight and bias on this worker (gathered from the shards under fsdp)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).item()
        for p in operator.model.parameters()
    ]


class ShrinkThenGrowPolicy(FailurePolicy):
    """On a loss keep only the survivors (start the wanted number anew when none survived); grow
    back later (the default scaling policy)."""

    name = "shrink-then-grow"

    def decide(self, status: FailureStatus) -> Decision:
        if status.failures > status.max_retries:
            return Decision(Action.GIVE_UP, reason="retries exhausted")
        size = status.workers_alive or status.workers_wanted
        return Decision(Action.RETRY, num_workers=size, reason="survivors only")


@pytest.mark.timeout(240)
def test_shrink_and_grow_resplit_mid_epoch_and_every_worker_lost_restarts_all_and_resplits(
    parquet_dataset: Any, tmp_path: Path
) -> None:
    baseline = _live_split_coordinators()
    trainer = _make({"train": parquet_dataset}, tmp_path, failure_policy=ShrinkThenGrowPolicy())
    try:
        trainer.train(num_steps=2)  # 2 global batches into epoch 1
        assert len(_live_split_coordinators() - baseline) == 1

        # Rank 1 dies mid-epoch (after one more step); the policy keeps the survivor only, and the
        # call goes on on it, over a split of one that skips the rows the group had read.
        (tmp_path / "die-rank1").touch()
        result = trainer.train(max_retries=2)
        assert (tmp_path / "die-rank1.done").exists() and trainer.failures == 1
        assert trainer.num_workers == 1
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert (resize.path, resize.num_workers_after) == ("keep-healthy", 1)
        assert resize.steps_redone == 1  # the step rank 1 died in
        epoch = rows_by_epoch(tmp_path)[1]
        assert result["epoch"] == 1
        # The epoch has its full count: every step once. A split cannot know which rows the old
        # one handed out, so it skips by count: at most the rows read before the resize (3
        # global batches) can come twice (and as many not at all).
        assert len(epoch) == NUM_ROWS  # 48 rows over 2 workers, then the other 55 on 1
        assert len(epoch) - len(set(epoch)) <= 3 * GLOBAL_BATCH
        # The old split went with the group that read it; only the new one is left.
        assert _new_coordinators(baseline, 1) == 1

        result = trainer.train(max_retries=2)  # grows back to 2 and splits over them
        assert trainer.num_workers == 2 and result["epoch"] == 2
        _assert_once(_ids(trainer), NUM_ROWS)

        # Both ranks die mid-epoch 3: no survivor keeps the state or a shard, so every worker is
        # started anew, loads the state the driver kept, and the epoch is redone over a new split.
        seen, pids = len(trainer.recovery_events), trainer.apply_all_workers(os.getpid)
        before = trainer.apply_all_operators(_params)[0]
        for rank in (0, 1):
            (tmp_path / f"die-rank{rank}").touch()
        result = trainer.train(max_retries=2)
        assert all((tmp_path / f"die-rank{rank}.done").exists() for rank in (0, 1))
        failure = next(e for e in trainer.recovery_events[seen:] if e.kind == "failure")
        assert sorted(failure.ranks) == [0, 1] and trainer.num_workers == 2
        assert not set(trainer.apply_all_workers(os.getpid)) & set(pids)

        # The redone epoch covers every row once over the new workers ...
        _assert_once(_ids(trainer), NUM_ROWS)
        assert result["epoch"] == 3 and result["num_samples"] == NUM_ROWS - NUM_ROWS % 2
        # ... and trains: the replicas agree, moved from the weights the epoch started with (and
        # from the initial ones), with a finite loss.
        params = trainer.apply_all_operators(_params)
        assert params[0] == params[1] != before
        assert params[0] != _initial_params()
        assert np.isfinite(result["train_loss"])
        # Only the new split is left: the old one went with the workers that read it.
        assert _new_coordinators(baseline, 1) == 1
    finally:
        trainer.shutdown()
    assert _new_coordinators(baseline, 0) == 0


@pytest.mark.timeout(180)
def test_fsdp_on_four_workers_splits_the_datasets_and_resplits_after_a_lost_worker(
    tmp_path: Path,
) -> None:
    trainer = _make(
        {"train": _from_numpy(NUM_ROWS)},
        tmp_path,
        4,
        strategy="fsdp",
        num_cpus_per_worker=0.5,
        # The replacement is waited for (the default trains on at 3 while it starts).
        failure_policy=DefaultPolicy(replace_in_background=False),
    )
    try:
        pids = trainer.apply_all_workers(os.getpid)
        # Rank 2 (neither of rank 0's neighbours) dies mid-epoch; its shards come back from rank
        # 3's replica in a new worker, and the epoch is redone from its start over a new split.
        (tmp_path / "die-rank2").touch()
        result = trainer.train(max_retries=1)
        assert (tmp_path / "die-rank2.done").exists() and trainer.failures == 1
        now = trainer.apply_all_workers(os.getpid)
        assert trainer.num_workers == 4 and now[:3] == [pids[0], pids[1], pids[3]]
        assert now[3] not in pids
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert (resize.path, resize.num_workers_after) == ("keep-healthy", 4)

        _assert_once(_ids(trainer), NUM_ROWS)
        assert result["epoch"] == 1 and result["num_samples"] == NUM_ROWS - NUM_ROWS % 4
        params = trainer.apply_all_operators(_params)
        assert params.count(params[0]) == 4 and params[0] != _initial_params()
        assert np.isfinite(result["train_loss"])
    finally:
        trainer.shutdown()


def test_datasets_are_checked_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = ray.data.range(8)

    def make(**kwargs: Any) -> TorchTrainer:
        kwargs.setdefault("config", {BATCH_SIZE: 4})
        return TorchTrainer(training_operator_cls=RecordingOperator, **kwargs)

    with pytest.raises(ValueError, match=r"config\[BATCH_SIZE\]"):
        make(datasets={"train": ds}, config={})
    with pytest.raises(TypeError, match=r"must be a ray\.data\.Dataset"):
        make(datasets={"train": [1, 2, 3]})
    with pytest.raises(ValueError, match="without datasets"):
        make(dataset_options=OPTIONS)
    with pytest.raises(ValueError, match="excludes"):
        make(datasets={"train": ds}, dataset_options={"collate_fn": len, "columns": ["id"]})
    # Ray Data's dependencies missing (as without the extra): the error says what to install.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"raysgd\[data\]"):
        make(datasets={"train": ds})
