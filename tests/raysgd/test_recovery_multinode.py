"""Losing a whole node mid-epoch, then getting it back (on a `ray.cluster_utils.Cluster`).

Training must go on with the workers left, from the last step the group finished, with the same
global batch: the rest of the epoch is re-split over fewer workers, so the epoch trains every row
once (the lost worker's finished steps included), and a later `train()` grows back to `num_workers`
once the cluster has room again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util import placement_group_table
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

NUM_SAMPLES = 64
GLOBAL_BATCH = 16
BLOCK_AT_STEP = 2


class BlockOnceOperator(TrainingOperator):
    """Linear regression; rank 1 signals at BLOCK_AT_STEP and then blocks until its node is gone."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(NUM_SAMPLES, 4, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        ids = torch.arange(NUM_SAMPLES)
        model = nn.Linear(4, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        loader = DataLoader(TensorDataset(x, y, ids), batch_size=config[BATCH_SIZE], shuffle=True)
        self.register_data(train_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        self._maybe_block(batch_info)
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config["marker_dir"], batch_info["epoch_idx"] + 1, ids)
        return metrics

    def _maybe_block(self, batch_info: dict[str, Any]) -> None:
        if self.world_rank == 1 and batch_info["global_step"] == BLOCK_AT_STEP:
            try:
                fd = os.open(
                    os.path.join(self.config["marker_dir"], "blocked"), os.O_CREAT | os.O_EXCL
                )
            except FileExistsError:
                fd = None
            if fd is not None:
                os.close(fd)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # the test removes this node meanwhile
                    time.sleep(0.05)


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _per_worker_batch(operator: Any) -> int:
    return int(operator.config[BATCH_SIZE])


@pytest.mark.timeout(180)
def test_node_loss_keeps_the_global_batch_and_grows_back(
    ray_multinode: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = ray_multinode
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    trainer = TorchTrainer(
        training_operator_cls=BlockOnceOperator,
        num_workers=2,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(tmp_path)},
        timeout_s=60,  # safety net only
    )
    try:
        worker_nodes = trainer.apply_all_workers(_node_id)
        assert len(set(worker_nodes)) == 2  # one worker per node (SPREAD)
        victim = next(node for node in nodes if node.node_id == worker_nodes[1])

        def remove_when_blocked() -> None:
            deadline = time.monotonic() + 60
            while not (tmp_path / "blocked").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            cluster.remove_node(victim)

        remover = threading.Thread(target=remove_when_blocked, daemon=True)
        remover.start()
        stats = trainer.train(max_retries=3)
        remover.join(timeout=30)

        # Training went on with the one worker left, over the whole data set, same global batch.
        assert (tmp_path / "blocked").exists()
        assert trainer.failures == 1
        assert trainer.num_workers == 1
        assert stats["num_samples"] == NUM_SAMPLES
        assert trainer.config[BATCH_SIZE] == GLOBAL_BATCH
        assert trainer.apply_all_operators(_per_worker_batch) == [GLOBAL_BATCH]
        lost = next(e for e in trainer.recovery_events if e.kind == "failure")
        assert lost.ranks == (1,) and lost.nodes == (victim.node_id,)
        # The survivor went on from step 2; the other half of the shuffled epoch was re-split
        # over it alone: every row once, none twice.
        shrink = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert (shrink.source, shrink.steps_redone) == ("rank 0 at step 2", 1)
        assert sorted(rows_by_epoch(tmp_path)[1]) == list(range(NUM_SAMPLES))
        # The lost worker's placement group went with it: nothing is left for Ray to place again
        # on a cluster without room (a group in that state keeps Ray's GCS busy).
        states = [pg["state"] for pg in placement_group_table().values()]
        assert set(states) <= {"CREATED", "REMOVED"}, states

        # The node comes back: the next train() grows to num_workers and re-splits the batch.
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        stats = trainer.train(max_retries=3)
        assert trainer.num_workers == 2
        assert stats["num_samples"] == NUM_SAMPLES
        assert trainer.apply_all_operators(_per_worker_batch) == [GLOBAL_BATCH // 2] * 2
        grow = [e for e in trainer.recovery_events if e.kind == "resize"][-1]
        assert (grow.num_workers_before, grow.num_workers_after) == (1, 2)
        assert sorted(rows_by_epoch(tmp_path)[2]) == list(range(NUM_SAMPLES))

        # No worker shares this process's node, but they share its disk (one machine): a
        # checkpoint is written by a worker, the state does not pass through the driver.
        weights = [p.detach().clone() for p in trainer.get_model().parameters()]
        with caplog.at_level(logging.DEBUG, logger="raysgd"):
            path = trainer.save(tmp_path / "ckpt.pt")
        assert any("written by rank 0" in r.getMessage() for r in caplog.records)
        trainer.train(num_steps=1)
        trainer.load(path)
        assert all(map(torch.equal, weights, trainer.get_model().parameters()))
    finally:
        trainer.shutdown(force=True)
