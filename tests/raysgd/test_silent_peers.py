"""A worker that stops answering without dying: its process hung on a live node, or its whole node
frozen (the worker and its raylet stopped with SIGSTOP: connections stay open, nothing flows, as
with a partitioned or powered-off machine).

The survivor, waiting for it in a collective, must raise once the bound tied to the step time runs
out (not after the process group's full timeout, nor when Ray's health checks give up on the node),
keep its process and state, and never be reported as the user's error; the silent rank is the one
lost. Training then goes on from the survivor's step with every row of the epoch trained once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from tests._support.markers import mark
from tests._support.markers import read as read_marker
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

NUM_SAMPLES = 256
GLOBAL_BATCH = 16  # 16 steps an epoch on 2 workers
FREEZE_AT_STEP = 6
#: The floor of the step bound: the survivor raises this long after the peer went silent.
PEER_TIMEOUT_S = 3.0


class FreezeOnceOperator(TrainingOperator):
    """A small regression; rank 1 writes a marker at FREEZE_AT_STEP (first time only) and waits
    there for the test to stop its process."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(NUM_SAMPLES, 4, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        model = nn.Linear(4, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        ids = torch.arange(NUM_SAMPLES)
        loader = DataLoader(TensorDataset(x, y, ids), batch_size=config[BATCH_SIZE], shuffle=True)
        self.register_data(train_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        if self.world_rank == 1 and batch_info["global_step"] == FREEZE_AT_STEP:
            if not os.path.exists(os.path.join(self.config["marker_dir"], "frozen")):
                # Written whole before it appears: the test reads this pid as soon as it does.
                mark(self.config["marker_dir"], "frozen", str(os.getpid()))
                time.sleep(60)  # stopped by the test meanwhile
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config["marker_dir"], batch_info["epoch_idx"] + 1, ids)
        return metrics


def _make_trainer(marker_dir: Path) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=FreezeOnceOperator,
        num_workers=2,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(marker_dir)},
        peer_timeout_s=PEER_TIMEOUT_S,
        timeout_s=60,  # the slow phases' bound: it must not be what finds the silent peer
    )


def _stop_when_frozen(marker_dir: Path, with_raylet: bool, stopped: list[int]) -> threading.Thread:
    """Stop rank 1's process (and its node's raylet, its parent) once it reaches the marker."""

    def stop() -> None:
        worker = int(read_marker(marker_dir, "frozen"))
        for pid in [worker] + ([_parent(worker)] if with_raylet else []):
            stopped.append(pid)
            os.kill(pid, signal.SIGSTOP)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    return thread


def _parent(pid: int) -> int:
    """The parent of process `pid` (a Ray worker's parent is its node's raylet)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie waiting for its parent counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _resume(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _check_recovered(trainer: TorchTrainer, stats: dict, marker_dir: Path, pids: list[int]) -> None:
    # The silent rank was lost, found from its peer's bounded wait: not a user error, counted
    # once, and the survivor kept its process and went on from its own step.
    assert trainer.failures == 1
    assert stats["num_samples"] == NUM_SAMPLES
    failure = next(e for e in trainer.recovery_events if e.kind == "failure")
    assert failure.ranks == (1,)
    assert "stopped answering" in failure.message
    resize = next(e for e in trainer.recovery_events if e.kind == "resize")
    assert resize.source == f"rank 0 at step {FREEZE_AT_STEP}"
    assert resize.steps_redone == 1
    assert trainer.worker_group.workers[0].pid == pids[0]
    # Every row of the epoch once: the survivor's finished steps, the silent rank's finished
    # steps before it froze, and the rest re-split over the group that went on.
    assert sorted(rows_by_epoch(marker_dir)[1]) == list(range(NUM_SAMPLES))
    # What it cost, by cause: the wait for the silent peer is detection, not the user's time.
    report = trainer.goodput()
    assert report["failures"] == 1 and report["steps_redone"] == 1
    assert report["lost_s"]["detection"] > 0 and report["lost_s"]["start"] > 0
    assert 0 < report["goodput"] < 1
    lost = sum(report["lost_s"].values())
    assert report["productive_s"] == pytest.approx(report["wall_s"] - lost, abs=1e-3)


@pytest.mark.timeout(150)
def test_a_worker_hung_on_a_live_node_is_replaced_and_its_peer_kept(
    ray_local: None, tmp_path: Path
) -> None:
    trainer = _make_trainer(tmp_path)
    stopped: list[int] = []
    try:
        pids = [w.pid for w in trainer.worker_group.workers]
        stopper = _stop_when_frozen(tmp_path, with_raylet=False, stopped=stopped)
        stats = trainer.train()
        stopper.join(timeout=10)
        _check_recovered(trainer, stats, tmp_path, pids)
        # The node is alive: the hung worker was replaced there, the group is whole again.
        assert trainer.num_workers == 2
        assert pids[1] not in [w.pid for w in trainer.worker_group.workers]
        assert _gone(pids[1])
        # The next epoch runs on the repaired group with the bound in force again.
        assert trainer.train()["num_samples"] == NUM_SAMPLES
        assert sorted(rows_by_epoch(tmp_path)[2]) == list(range(NUM_SAMPLES))
    finally:
        _resume(stopped)
        trainer.shutdown(force=True)


@pytest.mark.timeout(200)
def test_a_silent_node_is_found_from_the_survivors_bounded_wait(
    ray_multinode: Any, tmp_path: Path
) -> None:
    cluster = ray_multinode
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    trainer = _make_trainer(tmp_path)
    stopped: list[int] = []
    try:
        pids = [w.pid for w in trainer.worker_group.workers]
        nodes = [w.node_id for w in trainer.worker_group.workers]
        assert len(set(nodes)) == 2  # one worker per node
        stopper = _stop_when_frozen(tmp_path, with_raylet=True, stopped=stopped)
        stats = trainer.train()
        stopper.join(timeout=10)
        _check_recovered(trainer, stats, tmp_path, pids)
        # The frozen node still looks alive to Ray, but no worker was placed there: the group
        # went on with the survivor, on the node that answers, with the same global batch.
        assert trainer.num_workers == 1
        assert trainer.config[BATCH_SIZE] == GLOBAL_BATCH
        assert [w.node_id for w in trainer.worker_group.workers] == [nodes[0]]
    finally:
        _resume(stopped)
        trainer.shutdown(force=True)
