"""Recovery past two workers: ranks that were nobody's neighbour, at 6 workers; that run resumed
on fewer; fsdp's shards on 3.

With two workers the one survivor is the lost rank's neighbour and sees its connection close; with
more, most survivors wait on ranks that wait themselves, and only the abort of the group lets them
out (raysgd_core's `abort`). The tests run workers of half a CPU (the shared cluster has 4): 6 that
lose ranks in training and in validation, then a new driver that resumes their run on 2 and loses
one in an elastic run, and an fsdp run on 3. Each checks what a user relies on: every row trained
once, the survivors' processes kept, the state where it should be. Workers die by `os._exit` at a
step or batch the test names; a marker file makes each death happen once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_fault import DefaultPolicy

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(120)]

ROWS = 240
#: The global batch: 2 rows a worker on 6 workers, 4 on 3 (fsdp), 6 on 2 and 12 on 1 (the elastic
#: run).
GLOBAL_BATCH = 12


class RowsOperator(TrainingOperator):
    """A seeded linear regression whose rows carry their ids; finished training rows go to
    files (`record_rows`). ``config["deaths"]``: ``{(phase, rank, batch_idx): marker}``, each
    rank's process exiting at that batch of ``"train"`` or ``"validate"`` once."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(ROWS, 4, generator=gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        loader = DataLoader(TensorDataset(x, y, torch.arange(ROWS)), batch_size=config[BATCH_SIZE])
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.02),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=loader, validation_loader=loader)

    def _maybe_exit(self, phase: str, batch_idx: int) -> None:
        marker = self.config.get("deaths", {}).get((phase, self.world_rank, batch_idx))
        if marker is None:
            return
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os._exit(1)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        self._maybe_exit("train", batch_info["batch_idx"])
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config["rows"], batch_info["epoch_idx"] + 1, ids)
        return metrics

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        self._maybe_exit("validate", batch_info["batch_idx"])
        return super().validate_batch(batch[:2], batch_info)


def _trainer(folder: Path, num_workers: int, **kwargs: Any) -> TorchTrainer:
    (folder / "rows").mkdir(parents=True, exist_ok=True)
    return TorchTrainer(
        training_operator_cls=RowsOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "rows": str(folder / "rows")},
        num_workers=num_workers,
        num_cpus_per_worker=0.5,
        **kwargs,
    )


def _die(trainer: TorchTrainer, folder: Path, *deaths: tuple[str, int, int]) -> None:
    """Arm `deaths` ((phase, rank, batch_idx) each) on every worker."""
    armed = {death: str(folder / f"died-{'-'.join(map(str, death))}") for death in deaths}

    def arm(operator: Any) -> None:
        operator.config["deaths"] = armed

    trainer.apply_all_operators(arm)


def _pids(trainer: TorchTrainer) -> list[int]:
    return [w.pid for w in trainer.worker_group.workers]


def _resizes(trainer: TorchTrainer) -> list[Any]:
    return [e for e in trainer.recovery_events if e.kind == "resize"]


@pytest.fixture(scope="module")
def six(ray_local_module: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 6-worker trainer with a spare, writing a checkpoint every 4 steps (shared: the tests run
    in order on it; the last one shuts it down). A rank would wait 10 minutes in a collective
    before it gave up on a peer: only the abort lets the survivors out within the tests' bound."""
    folder = tmp_path_factory.mktemp("six")
    trainer = _trainer(
        folder,
        6,
        peer_timeout_s=600,
        spare_workers=1,
        checkpoint_dir=str(folder / "checkpoints"),
        checkpoint_every=4,
    )
    try:
        yield trainer, folder
    finally:
        trainer.shutdown()


def _wait_for_spare(trainer: TorchTrainer, timeout_s: float = 60.0) -> int:
    import time

    deadline = time.monotonic() + timeout_s
    while not trainer.worker_group.spares:
        assert time.monotonic() < deadline, "the spare did not come up"
        time.sleep(0.1)
    return trainer.worker_group.spares[0].pid


def test_a_rank_that_is_nobodys_neighbour_is_replaced_by_the_spare_losing_nothing(six) -> None:
    trainer, folder = six
    pids, spare = _pids(trainer), _wait_for_spare(trainer)
    # Rank 3 of 6: in a ring neither of rank 0's neighbours; the others wait on ranks that wait.
    _die(trainer, folder, ("train", 3, 5))
    result = trainer.train()
    assert trainer.failures == 1 and trainer.num_workers == 6
    assert result["num_samples"] == ROWS and sorted(rows_by_epoch(folder / "rows")[1]) == list(
        range(ROWS)
    )
    # The five survivors kept their processes (none was killed for waiting), the spare took the
    # lost rank's place, and only the step in flight was redone.
    assert _pids(trainer) == pids[:3] + pids[4:] + [spare]
    (resize,) = _resizes(trainer)
    assert resize.report.kept == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4} and resize.steps_redone <= 1
    # Periodic checkpoints went on around the loss (20 steps an epoch: 4, 8, ... 20).
    assert len(list((folder / "checkpoints").iterdir())) >= 4


def test_a_rank_lost_in_validation_is_replaced_and_the_pass_counts_every_row_once(six) -> None:
    trainer, folder = six
    pids = _pids(trainer)
    _die(trainer, folder, ("validate", 2, 3))
    result = trainer.validate()
    assert result["num_samples"] == ROWS and result["batch_count"] == ROWS // GLOBAL_BATCH
    assert trainer.failures == 2 and trainer.num_workers == 6
    assert _pids(trainer)[:5] == pids[:2] + pids[3:]


def test_resume_on_fewer_workers_and_an_elastic_run_trains_on_while_a_replacement_starts(
    six, tmp_path: Path
) -> None:
    first, folder = six
    step = first.train()["epoch"]  # a second epoch: the newest checkpoint is at its end
    first.shutdown()  # the last test of the six: its room goes to the next trainer
    # A new driver on 2 workers picks the 6-worker run up at its newest checkpoint.
    trainer = _trainer(
        tmp_path,
        2,
        checkpoint_dir=str(folder / "checkpoints"),
        resume=True,
        failure_policy="elastic",
    )
    try:
        pids = _pids(trainer)
        _die(trainer, tmp_path, ("train", 1, 10))
        result = trainer.train()
        assert result["epoch"] == step + 1 and result["num_samples"] == ROWS
        assert trainer.failures == 1
        # The survivor went on alone while the replacement started as a spare; it joins at a step
        # boundary once it is up or, when the epoch ends first, at the next call. (A process
        # kept from the six-worker trainer, see RAYSGD_KEEP_WORKERS_S, is up at once: it may
        # have joined already.)
        first_resize = _resizes(trainer)[0]
        assert (first_resize.num_workers_before, first_resize.num_workers_after) == (2, 1)
        if trainer.num_workers < 2:
            _wait_for_spare(trainer)
        assert trainer.train()["num_samples"] == ROWS and trainer.num_workers == 2
        rows = rows_by_epoch(tmp_path / "rows")
        assert sorted(rows[step + 1]) == sorted(rows[step + 2]) == list(range(ROWS))
        assert pids[0] in _pids(trainer)
    finally:
        trainer.shutdown()


class WideOperator(RowsOperator):
    """The same rows through a model wide enough that every worker's shard is a real part of it
    (a kept worker that took another rank must write and load its own rows of each tensor)."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
        self.net = model  # the user's own name for it, besides self.model
        self.register(
            models=model,
            optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
            criterion=nn.MSELoss(),
        )


def _note(operator: Any) -> tuple[int, Any, bool]:
    return os.getpid(), getattr(operator, "note", None), operator.net is operator.model


def test_fsdp_on_three_workers_keeps_the_survivors_operators_and_restores_lost_shards(
    tmp_path: Path,
) -> None:
    (tmp_path / "rows").mkdir()
    trainer = TorchTrainer(
        training_operator_cls=WideOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "rows": str(tmp_path / "rows")},
        num_workers=3,
        num_cpus_per_worker=0.5,
        strategy="fsdp",
        snapshot_every=1,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        # The replacement is waited for, so that the kept operators and the replacement's are
        # seen after one resize (the default trains on at 2 meanwhile: the elastic test's path).
        failure_policy=DefaultPolicy(replace_in_background=False),
    )
    try:
        pids = _pids(trainer)
        trainer.apply_all_operators(lambda op: setattr(op, "note", op.world_rank))
        trainer.train(checkpoint="auto")
        # Rank 1 alone: its shards come back from rank 2's copy, and rank 2 becomes rank 1 (a
        # kept worker whose rank changed shards its models over the new group as that rank).
        _die(trainer, tmp_path, ("train", 1, 12))
        assert trainer.train()["num_samples"] == ROWS and trainer.failures == 1
        (resize,) = _resizes(trainer)
        assert "in-memory snapshot" in resize.source and resize.steps_redone <= 2
        # The survivors kept their operators (what the user kept on them too), with models
        # sharded anew under the names they held; the replacement set itself up.
        assert trainer.apply_all_operators(_note) == [
            (pids[0], 0, True),
            (pids[2], 2, True),
            (_pids(trainer)[2], None, True),
        ]
        # Every row trained, those of the steps since the snapshot twice (it counts them once).
        rows = rows_by_epoch(tmp_path / "rows")[2]
        assert set(rows) == set(range(ROWS)) and len(rows) - ROWS <= 2 * GLOBAL_BATCH
        trainer.train(checkpoint="auto")
        # Rank 2 holds rank 1's snapshot copy: losing both loses rank 1's part everywhere.
        _die(trainer, tmp_path, ("train", 1, 14), ("train", 2, 14))
        result = trainer.train(checkpoint="auto")
        assert result["num_samples"] == ROWS and trainer.num_workers == 3
        restored = [e for e in _resizes(trainer)[1:] if e.source and "checkpoint" in e.source]
        assert restored, [e.source for e in _resizes(trainer)]
        # The checkpoint was written at the start of the call: that epoch is trained again from
        # its first row, every row at least once.
        assert set(rows_by_epoch(tmp_path / "rows")[4]) == set(range(ROWS))
    finally:
        trainer.shutdown()
