"""Preemption notices on a `ray.cluster_utils.Cluster`: a node holding a worker is drained with
`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` (the real
command) and removed at the deadline, as a cloud reclaims a spot machine.

The workers must leave before the deadline at a step boundary, without a failure, every row of the
epoch trained once and the weights those of a run without the notice; where there is no room, the
group shrinks instead; a notice between two `train()` calls is acted on before the next one; a node
that dies before the move finished is an ordinary recovery, reported as a preemption.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import pytest
import ray
import torch
from ray.util import placement_group_table
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_core import preempted_nodes

ROWS = 192
GLOBAL_BATCH = 8  # 4 per worker: 24 steps per epoch on 2 workers
STEP_S = 0.1  # each step sleeps this long, so that a notice arrives mid-epoch
#: The notice's deadline: room for a move (a new worker starts in about 5 s here, twice that on a
#: loaded machine). The tests remove the node once the run has left it, never waiting this out.
DEADLINE_S = 24


class SlowLinearOperator(TrainingOperator):
    """A seeded linear regression whose steps take `STEP_S`; records its finished rows and marks
    in `marker_dir` the steps the test waits for.

    With `hold_step` in the config (a step, or a tuple of steps) every rank holds that step (each
    of them) until the test has given its notice (``drained`` in `marker_dir`): `ray drain-node`
    is a process of its own and can take longer than the rest of this short epoch on a busy
    machine. With `dropout` its inputs are dropped at that rate, each rank drawing from a
    generator seeded by its rank: a move must hand a leaving rank's generator to the worker that
    takes its place. A worker set up while ``arm-setup-death`` is in `marker_dir` exits in its
    set-up (once: the marker is taken).
    """

    def setup(self, config: dict[str, Any]) -> None:
        arm = Path(config["marker_dir"], "arm-setup-death")
        if arm.exists():
            # Armed by the test: the next worker set up exits in its set-up, once.
            arm.rename(arm.with_name("setup-died"))
            os._exit(1)
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(ROWS, 3, generator=gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
        data = TensorDataset(x, y, torch.arange(ROWS))
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        self.register_data(
            train_loader=DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True)
        )
        torch.manual_seed(100 + self.world_rank)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        hold = self.config.get("hold_step")
        if batch_info["global_step"] in (hold if isinstance(hold, (tuple, list)) else (hold,)):
            drained, until = Path(self.config["marker_dir"], "drained"), time.monotonic() + 60
            while not drained.exists() and time.monotonic() < until:
                time.sleep(0.02)
        time.sleep(STEP_S)
        block = Path(self.config["marker_dir"], f"block-{batch_info['global_step']}")
        if self.world_rank == 1 and block.exists():
            # Stuck in this step (no boundary to stop at) until the test takes the node away.
            block.rename(block.with_name("blocking"))
            time.sleep(60)
        if self.config.get("dropout"):
            x = nn.functional.dropout(x, self.config["dropout"])
        metrics = super().train_batch((x, y), batch_info)
        folder = self.config["marker_dir"]
        record_rows(folder, batch_info["epoch_idx"] + 1, ids)
        if self.world_rank == 0:
            Path(folder, f"step-{batch_info['global_step']}").touch()
        return metrics


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _drain(cluster: Any, node_id: str, deadline_s: Optional[int]) -> None:
    """The real `ray drain-node`, as KubeRay or the autoscaler issue it (None: no deadline)."""
    deadline = [] if deadline_s is None else ["--deadline-remaining-seconds", str(deadline_s)]
    subprocess.run(
        [
            sys.executable, "-m", "ray.scripts.scripts", "drain-node",
            "--address", cluster.address, "--node-id", node_id,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
            *deadline,
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip


def _reclaim_at_step(
    cluster: Any,
    folder: Path,
    step: int,
    node: Any,
    deadline_s: int,
    *,
    remove_after_s: float,
    remove_now: Optional[threading.Event] = None,
) -> tuple[threading.Thread, dict[str, float]]:
    """Drain `node` once rank 0 finished `step`, and remove it `remove_after_s` later (or once
    `remove_now` is set: a cloud may take the machine any time before the deadline); the dict
    gets the wall-clock times of both."""
    times: dict[str, float] = {}
    remove_now = remove_now or threading.Event()

    def run() -> None:
        until = time.monotonic() + 120
        while not (folder / f"step-{step}").exists() and time.monotonic() < until:
            time.sleep(0.02)
        # Taken before the command: the notice is acted on (and the call may end) before the
        # command's process exits, and the deadline counts from a moment later than this one,
        # set before the command returns ("deadline_by": a bound on it for the asserts, however
        # long the command takes on a loaded machine).
        times["drained"] = time.time()
        _drain(cluster, node.node_id, deadline_s)
        times["deadline_by"] = time.time() + deadline_s
        (folder / "drained").touch()
        remove_now.wait(remove_after_s)
        cluster.remove_node(node)
        times["removed"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, times


def _deadline_by(times: dict[str, float]) -> float:
    """The bound on a drain's deadline that `_reclaim_at_step` records once its command returned
    (which may be after the call that acted on the notice ended)."""
    until = time.monotonic() + 60
    while "deadline_by" not in times and time.monotonic() < until:
        time.sleep(0.02)
    return times["deadline_by"]


def _reclaim_at_marker(
    cluster: Any, marker: Path, node: Any, deadline_s: int, remove_after_s: float
) -> tuple[threading.Thread, dict[str, float]]:
    """Drain `node` once `marker` exists, and remove it `remove_after_s` later."""
    folder = marker.parent
    name = marker.name

    def run() -> None:
        until = time.monotonic() + 120
        while not (folder / name).exists() and time.monotonic() < until:
            time.sleep(0.02)
        _drain(cluster, node.node_id, deadline_s)
        time.sleep(remove_after_s)
        cluster.remove_node(node)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, {}


def _trainer(
    folder: Path,
    hold_step: Union[int, tuple[int, ...], None] = None,
    num_workers: int = 2,
    dropout: float = 0.0,
    **kwargs: Any,
) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=SlowLinearOperator,
        config={
            BATCH_SIZE: GLOBAL_BATCH,
            "marker_dir": str(folder),
            "hold_step": hold_step,
            "dropout": dropout,
        },
        num_workers=num_workers,
        timeout_s=60,  # safety net only
        **kwargs,
    )


def _weights(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.get_model(to_cpu=True).parameters()]


def _cluster(cluster: Any, nodes: int, cpus: int = 1) -> list[Any]:
    added = [cluster.add_node(num_cpus=cpus) for _ in range(nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return added


def _on(nodes: list[Any], node_id: str) -> Any:
    return next(n for n in nodes if n.node_id == node_id)


_REFERENCE: dict[tuple, list[list[torch.Tensor]]] = {}


def _reference_weights(folder: Path, epochs: int, **job: Any) -> list[list[torch.Tensor]]:
    """The weights after each of `epochs` epochs of the job `job` (`_trainer`'s keywords) without
    a notice (computed once per module, on whatever cluster is up: the run is the same on any):
    what a preempted run must equal."""
    key = (epochs, *sorted(job.items()))
    if key not in _REFERENCE:
        folder.mkdir()
        reference = _trainer(folder, **job)
        try:
            _REFERENCE[key] = []
            for _ in range(epochs):
                reference.train()
                _REFERENCE[key].append(_weights(reference))
        finally:
            reference.shutdown()
    return _REFERENCE[key]


@dataclass
class _Notice:
    """A notice to the node of rank 1, which is removed at the deadline or once the run left it."""

    victim: Any  # the drained node
    times: dict[str, float]  # see `_reclaim_at_step`
    gone: threading.Event  # set: the node is removed now, not at the deadline
    reclaim: threading.Thread

    def remove_node(self) -> None:
        self.gone.set()
        self.reclaim.join(timeout=60)


def _notice_to_rank_1(cluster: Any, trainer: TorchTrainer, folder: Path, step: int) -> _Notice:
    """Drain rank 1's node once rank 0 finished `step` (deadline `DEADLINE_S`), and remove it at
    the deadline or at `_Notice.remove_node`, whichever comes first."""
    where = trainer.apply_all_workers(_node_id)[1]
    victim = next(n for n in cluster.worker_nodes if n.node_id == where)
    gone = threading.Event()
    reclaim, times = _reclaim_at_step(
        cluster, folder, step, victim, DEADLINE_S, remove_after_s=DEADLINE_S, remove_now=gone
    )
    return _Notice(victim, times, gone, reclaim)


def _assert_as_without_notice(
    trainer: TorchTrainer,
    folder: Path,
    notice: _Notice,
    results: dict[int, dict[str, Any]],
    expected: list[torch.Tensor],
    phase: str,
) -> None:
    """The run left the drained node, trained every row once in each epoch of `results` (epoch:
    the result of the call that trained it) and ended with the weights `expected` of the run that
    had no notice."""
    assert notice.victim.node_id not in trainer.apply_all_workers(_node_id), phase
    rows = rows_by_epoch(folder)
    for epoch, result in results.items():
        assert sorted(rows[epoch]) == list(range(ROWS)), f"{phase}: epoch {epoch}"
        assert result["num_samples"] == ROWS, f"{phase}: epoch {epoch}"
    for got, want in zip(_weights(trainer), expected):
        torch.testing.assert_close(got, want, msg=lambda text: f"{phase}: {text}")


EPOCH_STEPS = ROWS // GLOBAL_BATCH  # on 2 workers


@pytest.mark.timeout(360)
def test_a_drained_node_is_left_before_its_deadline_and_a_worker_lost_taking_its_place_is_one_loss(
    ray_multinode: Any, tmp_path: Path
) -> None:
    # Two notices to rank 1's node, each at step 5 of a pair of epochs, and after each pair the
    # weights of the same four epochs without a notice. Dropout with a generator per rank, and
    # windows of two batches: the move falls on a window's end, and the worker that takes the
    # leaving one's place takes its generator.
    _cluster(ray_multinode, 3)  # ranks 0 and 1, and a free node to move to
    folder = tmp_path / "moved"
    folder.mkdir()
    job = {"dropout": 0.2, "accumulate_grad_batches": 2}
    expected = _reference_weights(tmp_path / "reference", 4, **job)
    # Every rank holds step 7 of each pair of epochs until that pair's notice is given.
    trainer = _trainer(folder, hold_step=(7, 2 * EPOCH_STEPS + 7), **job)
    try:
        # The first notice (epochs 1 and 2): rank 1 moves to the free node before the deadline,
        # and the node is removed once the run left it.
        phase = "first notice"
        notice = _notice_to_rank_1(ray_multinode, trainer, folder, 5)
        first, second = trainer.train(), trainer.train()
        assert trainer.failures == 0 and trainer.num_workers == 2, phase
        moves = [e for e in trainer.recovery_events if e.kind == "preemption"]
        assert len(moves) == 1 and moves[0].steps_redone == 0, phase
        assert moves[0].nodes == (notice.victim.node_id,) and moves[0].ranks == (1,), phase
        assert moves[0].timestamp < _deadline_by(notice.times), phase  # before the deadline
        _assert_as_without_notice(
            trainer, folder, notice, {1: first, 2: second}, expected[1], phase
        )
        notice.remove_node()
        # The node went after its notice; Ray reports it preempted, and the run had left it.
        assert preempted_nodes([notice.victim.node_id]) == {notice.victim.node_id}, phase

        # The second notice (epochs 3 and 4), to rank 1's new node, with a new free node: the
        # worker that starts there to take rank 1's place dies while it sets up, a loss inside
        # the move.
        phase = "second notice"
        seen = len(trainer.recovery_events)
        ray_multinode.add_node(num_cpus=1)
        ray_multinode.wait_for_nodes()
        (folder / "drained").unlink()  # the first notice's: the hold waits for the second one
        (folder / "arm-setup-death").touch()
        notice = _notice_to_rank_1(ray_multinode, trainer, folder, 2 * EPOCH_STEPS + 5)
        third, fourth = trainer.train(), trainer.train()
        assert (folder / "setup-died").exists(), phase
        # That death is the run's one failure: the node removed after the first notice cost none.
        assert trainer.failures == 1 and trainer.num_workers == 2, phase
        # The move hands rank 1's state over at a window's end and fails with its new worker;
        # the recovery that follows starts another from that state: nothing done again.
        events = trainer.recovery_events[seen:]
        moves = [e for e in events if e.kind == "preemption"]
        assert moves and moves[0].nodes == (notice.victim.node_id,), (phase, events)
        resizes = [e for e in events if e.kind == "resize"]
        assert len(resizes) == 1, (phase, events)
        resize = resizes[0]
        assert (resize.steps_redone, resize.inexact, resize.num_workers_after) == (0, (), 2), phase
        _assert_as_without_notice(
            trainer, folder, notice, {3: third, 4: fourth}, expected[3], phase
        )
        notice.remove_node()
    finally:
        trainer.shutdown()


def _full_loss(operator: Any) -> float:
    """The loss over the whole data set with this worker's model (gathered under fsdp)."""
    x, y, _ = operator.train_loader.dataset.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(operator.model(x), y))


@pytest.mark.timeout(240)
def test_a_notice_between_two_calls_moves_fsdp_workers_of_four_with_their_shards(
    ray_multinode: Any, tmp_path: Path
) -> None:
    # Four workers of half a CPU over three nodes: the drained node holds one or two of them,
    # and the others (rank 0's neighbours or not) hand over and re-form around the move.
    nodes = _cluster(ray_multinode, 3, cpus=2)
    trainer = _trainer(
        tmp_path,
        num_workers=4,
        strategy="fsdp",
        num_cpus_per_worker=0.5,
        dropout=0.2,
        accumulate_grad_batches=2,
    )
    try:
        trainer.train()
        saved = trainer.save(tmp_path / "before-the-notice")
        where = trainer.apply_all_workers(_node_id)
        victim = _on(nodes, where[2])
        _drain(ray_multinode, victim.node_id, None)  # a notice without a deadline
        trainer.train(num_steps=4)  # the notice came between the calls: acted on before this one
        (move,) = [e for e in trainer.recovery_events if e.kind == "preemption"]
        assert move.nodes == (victim.node_id,) and move.steps_redone == 0
        assert move.ranks == tuple(r for r, n in enumerate(where) if n == victim.node_id)
        assert "no deadline" in move.message
        assert trainer.failures == 0 and trainer.num_workers == 4
        assert victim.node_id not in trainer.apply_all_workers(_node_id)
        assert sorted(rows_by_epoch(tmp_path)[1]) == list(range(ROWS))
        moved = trainer.apply_all_operators(_full_loss)
        # The same four steps from the state saved before the notice: the moved workers' shards
        # and generators went to the workers that took their places, so the model is the one it
        # would have been without it.
        trainer.load(saved)
        trainer.train(num_steps=4)
        assert moved == pytest.approx(trainer.apply_all_operators(_full_loss), rel=1e-5)
    finally:
        trainer.shutdown()


@pytest.mark.timeout(300)
def test_without_room_the_group_shrinks_before_the_deadline_and_a_node_lost_first_is_a_loss(
    ray_multinode: Any, tmp_path: Path
) -> None:
    nodes = _cluster(ray_multinode, 2)  # both nodes hold a worker: nowhere to move to
    expected = _reference_weights(tmp_path / "reference", 1)[0]
    trainer = _trainer(tmp_path, hold_step=7)
    try:
        victim = _on(nodes, trainer.apply_all_workers(_node_id)[1])
        gone = threading.Event()
        reclaim, times = _reclaim_at_step(
            ray_multinode, tmp_path, 5, victim, DEADLINE_S, remove_after_s=DEADLINE_S,
            remove_now=gone,
        )  # fmt: skip
        result = trainer.train()
        (move,) = [e for e in trainer.recovery_events if e.kind == "preemption"]
        assert (move.num_workers_before, move.num_workers_after) == (2, 1)
        assert move.timestamp < _deadline_by(times) and move.steps_redone == 0
        assert trainer.failures == 0 and result["num_samples"] == ROWS
        assert sorted(rows_by_epoch(tmp_path)[1]) == list(range(ROWS))
        # One worker now takes the whole global batch of 8: the same steps, the same model.
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [GLOBAL_BATCH]
        for got, want in zip(_weights(trainer), expected):
            torch.testing.assert_close(got, want)
        gone.set()  # the group left the node: the cloud may take it now
        reclaim.join(timeout=60)

        # Room comes back: the next call grows to 2 again, on the new node.
        ray_multinode.add_node(num_cpus=1)
        ray_multinode.wait_for_nodes()
        deadline = time.monotonic() + 60
        while trainer.num_workers < 2 and time.monotonic() < deadline:
            trainer.train(num_steps=1)
        assert trainer.num_workers == 2
        # This time the node is reclaimed at the deadline of a short notice (3 s) while the
        # workers are in the middle of a long step and never reach a boundary to move at: an
        # ordinary loss, which says it was a preemption (Ray reports the node reclaimed).
        where = trainer.apply_all_workers(_node_id)
        second = next(n for n in ray_multinode.worker_nodes if n.node_id == where[1])
        step = trainer.apply_all_operators(lambda op: op.global_step)[0]
        (tmp_path / f"block-{step + 2}").touch()
        reclaim, _ = _reclaim_at_marker(ray_multinode, tmp_path / "blocking", second, 3, 4.0)
        trainer.train()
        reclaim.join(timeout=60)
        lost = [e for e in trainer.recovery_events if e.kind == "failure"]
        assert trainer.failures == 1 and len(lost) == 1 and lost[0].preempted
        epochs = rows_by_epoch(tmp_path)
        last = max(epochs)
        assert sorted(epochs[last]) == list(range(ROWS))  # the epoch it happened in: once each
    finally:
        trainer.shutdown(force=True)


def _line_rows(batch: dict[str, Any]) -> dict[str, Any]:
    """Ray Data rows of the same regression as `SlowLinearOperator`'s, each with its id."""
    import numpy as np

    ids = batch["data"]
    x = np.random.default_rng(1).standard_normal((ROWS, 3)).astype(np.float32)[ids]
    return {"x": x, "y": x @ np.array([[1.0], [-2.0], [0.5]], np.float32), "id": ids}


class SlowDataOperator(SlowLinearOperator):
    """`SlowLinearOperator` fed by `datasets=`: no loader of its own."""

    def setup(self, config: dict[str, Any]) -> None:
        arm = Path(config["marker_dir"], "arm-setup-death")
        if arm.exists():
            # Armed by the test: the next worker set up exits in its set-up, once.
            arm.rename(arm.with_name("setup-died"))
            os._exit(1)
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )


@pytest.mark.timeout(240)
def test_a_worker_fed_by_ray_data_moves_mid_epoch_and_the_epoch_keeps_its_rows(
    ray_multinode: Any, tmp_path: Path
) -> None:
    from raysgd import DatasetOptions

    # 2 workers, room for the one that moves, and a CPU for Ray Data's tasks.
    nodes = _cluster(ray_multinode, 4)
    ray.data.DataContext.get_current().enable_progress_bars = False
    dataset = ray.data.from_numpy(__import__("numpy").arange(ROWS)).map_batches(_line_rows)
    trainer = TorchTrainer(
        training_operator_cls=SlowDataOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(tmp_path), "hold_step": 5},
        num_workers=2,
        timeout_s=60,
        datasets={"train": dataset},
        dataset_options=DatasetOptions(columns=("x", "y", "id"), dtypes=torch.float32),
    )
    try:
        victim = _on(nodes, trainer.apply_all_workers(_node_id)[1])
        gone = threading.Event()
        reclaim, times = _reclaim_at_step(
            ray_multinode, tmp_path, 3, victim, 2 * DEADLINE_S, remove_after_s=2 * DEADLINE_S,
            remove_now=gone,
        )  # fmt: skip
        result = trainer.train()
        assert trainer.failures == 0 and trainer.num_workers == 2
        (move,) = [e for e in trainer.recovery_events if e.kind == "preemption"]
        assert move.steps_redone == 0 and move.timestamp < _deadline_by(times)
        assert victim.node_id not in trainer.apply_all_workers(_node_id)
        gone.set()  # off the node: the cloud may take it now
        # Split again at the move: the epoch has its full count, each step once, and at most the
        # rows trained before the move come twice (Ray Data's limit, as after any resize).
        epoch = rows_by_epoch(tmp_path)[1]
        assert result["num_samples"] == len(epoch) == ROWS
        moved_at = move.timestamp - move.duration_s
        before = [p for p in tmp_path.glob("step-*") if p.stat().st_mtime <= moved_at]
        assert 3 <= len(before) < ROWS // GLOBAL_BATCH
        assert len(epoch) - len(set(epoch)) <= len(before) * GLOBAL_BATCH
        reclaim.join(timeout=60)
        assert sorted(rows_by_epoch(tmp_path).get(1)) == sorted(epoch)
        # Nothing is left for Ray to place again on a cluster without room for it (a group in
        # that state keeps Ray's GCS busy): the moved worker's placement group went with it.
        states = [pg["state"] for pg in placement_group_table().values()]
        assert set(states) <= {"CREATED", "REMOVED"}, states
        assert trainer.train()["num_samples"] == ROWS and trainer.failures == 0
    finally:
        trainer.shutdown()


class NodeMarkingOperator(SlowLinearOperator):
    """`SlowLinearOperator` that also writes, for the test, the node each rank starts on."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        Path(config["marker_dir"], f"node-{self.world_rank}").write_text(_node_id())


def _one_epoch_of_a_trial(trainer: TorchTrainer, info: dict[str, Any]) -> dict[str, Any]:
    result = trainer.train()
    kinds = [event.kind for event in trainer.recovery_events]
    return {
        "num_samples": result["num_samples"],
        "failures": trainer.failures,
        "moves": kinds.count("preemption"),
        "num_workers": trainer.num_workers,
    }


@pytest.mark.timeout(240)
def test_a_tune_trial_hands_a_draining_workers_place_to_its_spare(
    ray_multinode: Any, tmp_path: Path
) -> None:
    from ray import tune

    # The trial, its two workers and its spare: one 1-CPU node each (the trial's group packs
    # what fits, so each bundle lands on its own node).
    _cluster(ray_multinode, 4)
    markers = tmp_path / "markers"
    markers.mkdir()

    def drain_rank_1() -> None:
        until = time.monotonic() + 120
        while not (markers / "step-3").exists() and time.monotonic() < until:
            time.sleep(0.02)
        _drain(ray_multinode, (markers / "node-1").read_text(), 30)
        (markers / "drained").touch()

    drainer = threading.Thread(target=drain_rank_1, daemon=True)
    drainer.start()
    trainable = TorchTrainer.as_trainable(
        training_operator_cls=NodeMarkingOperator,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(markers), "hold_step": 5},
        num_workers=2,
        num_cpus_per_worker=1,
        spare_workers=1,
        strategy="none",  # every worker its own copy: the spare takes the state of rank 0's
        timeout_s=60,
        override_tune_step=_one_epoch_of_a_trial,
    )
    results = tune.Tuner(
        trainable,
        run_config=tune.RunConfig(
            storage_path=str(tmp_path / "tune"), stop={"training_iteration": 1}, verbose=0
        ),
    ).fit()
    drainer.join(timeout=10)
    assert not results.errors
    metrics = results[0].metrics
    # The worker left the draining node for the trial's spare within the trial's reservation:
    # not a failure, the group kept its size, the epoch trained every row once.
    assert (metrics["moves"], metrics["failures"], metrics["num_workers"]) == (1, 0, 2)
    assert metrics["num_samples"] == ROWS
    assert sorted(rows_by_epoch(markers)[1]) == list(range(ROWS))


@ray.remote(num_cpus=0)
class UseLocalDriver:
    """A driver process on a worker node (as a Tune trial's is): `use_local=True` puts rank 0 here."""

    def train(self, folder: str, checkpoint_dir: str) -> dict[str, Any]:
        # Held at step 5 until the notice is given: the epoch must not end first.
        trainer = _trainer(Path(folder), 5, use_local=True, checkpoint_dir=checkpoint_dir)
        try:
            nodes = trainer.apply_all_workers(_node_id)
            Path(folder, "ready").touch()
            result = trainer.train()
            trained = _weights(trainer)
            written = sorted(Path(checkpoint_dir).iterdir())
            trainer.load(written[0])
            return {
                "nodes": nodes,
                "num_samples": result["num_samples"],
                "failures": trainer.failures,
                "num_workers": trainer.num_workers,
                "written": len(written),
                "rolled_back": not all(map(torch.equal, trained, _weights(trainer))),
            }
        finally:
            trainer.shutdown(force=True)


@pytest.mark.timeout(180)
def test_a_draining_driver_node_under_use_local_writes_a_checkpoint_and_training_goes_on(
    ray_multinode: Any, tmp_path: Path
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The driver, and with it rank 0 (whose CPU is the driver's own), on one node; rank 1 on the
    # other.
    driver_node, _ = _cluster(ray_multinode, 2)
    driver = UseLocalDriver.options(
        num_cpus=1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node.node_id, soft=False),
    ).remote()
    drainer = threading.Thread(
        target=lambda: _wait_then_drain(ray_multinode, tmp_path, driver_node.node_id)
    )
    drainer.start()
    out = ray.get(driver.train.remote(str(tmp_path), str(tmp_path / "checkpoints")), timeout=120)
    drainer.join(timeout=60)
    assert out["nodes"][0] == driver_node.node_id != out["nodes"][1]
    # Rank 0 cannot leave the driver's process: the notice wrote one checkpoint (a driver
    # started elsewhere can load it: it holds the weights of step 3 or so, not the last ones),
    # and the call went on to the end of the epoch without a failure.
    assert (out["written"], out["failures"], out["num_workers"]) == (1, 0, 2)
    assert out["num_samples"] == ROWS and out["rolled_back"]
    assert sorted(rows_by_epoch(tmp_path)[1]) == list(range(ROWS))


def _wait_then_drain(cluster: Any, folder: Path, node_id: str) -> None:
    """Drain `node_id` once rank 0 finished step 3, then let the ranks held at their `hold_step`
    go on."""
    until = time.monotonic() + 120
    while not (folder / "step-3").exists() and time.monotonic() < until:
        time.sleep(0.02)
    _drain(cluster, node_id, 60)
    (folder / "drained").touch()
