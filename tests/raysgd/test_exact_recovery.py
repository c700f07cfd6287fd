"""A fault must not change the result: a job that lost workers, was saved and loaded inside an
accumulation window, or whose driver was killed, ends with the weights of the same job never
interrupted.

The job draws random numbers at every batch from every generator a training loop uses (dropout from
torch's, Python's and NumPy's global generators, each rank seeded apart, as per-rank seeding does)
and carries a per-rank state from batch to batch; it counts its batches' "tokens" (not their rows)
as `num_samples`, and each call's count is that of the job never interrupted. Each case runs the
uninterrupted job once and the faulted one against it, at 4 workers: the faulted job starts from a
`save()` the uninterrupted one made inside a window, and loses a worker at every position of a
window (the spare takes the lost worker's place, or a new worker does: the group keeps its size).
Equal means bit for bit: the job sums its gradients one parameter at a time (`per_parameter_mean`),
as DDP's first step in a re-formed group lays its buckets out in another order, and gloo would sum
a few elements of 3 or 4 workers' gradients in another order then (a unit in the last place of
float32).

A worker's start costs seconds (torch's imports), training these jobs less than one, so the runs
of a job share one trainer (`_shared`): built once, with the spare and the policy of the faulted
runs, it runs the uninterrupted job first (its weights taken before any fault); each faulted run
then `load()`s the save and trains, with the faults its test wrote for it (`_arm`). A load
restores all the job depends on (that is what the module checks) and drops what the trainer kept
to recover the state it replaced: fsdp's in-memory snapshots and the driver's copy, of later
steps here. A loss after the load goes back no further than the loaded state.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import ray
import torch
from tests._support.markers import mark, wait_for
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd._internal.storage.catalog import newest_complete
from raysgd.utils import BATCH_SIZE
from raysgd_fault import DefaultPolicy
from raysgd_operator.parallel_strategies import per_parameter_mean

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
ROWS, GLOBAL_BATCH = 192, 12  # 16 steps an epoch, on 4 workers or 3; two epochs
VALIDATION_ROWS = 48
WORKERS = 4
#: Bit for bit: ddp's gradients are summed one parameter at a time (see the module docstring).
TOLERANCE = 0.0
#: What the job's `train_batch` counts as `num_samples` per row (its "tokens").
TOKENS_PER_ROW = 3


class ExactOperator(TrainingOperator):
    """An MLP with dropout whose inputs are shifted by Python's and NumPy's generators and by a
    state each rank carries. It reads its faults when it meets them, from the JSON file
    `config["plan"]` (none without one; see `_arm`): `kills` lists ``(rank, global_step)`` at
    which that rank's worker exits at the start of its batch, `exits_after_step` those at which
    it exits just after its optimizer stepped, once each (a marker file in the plan's `markers`);
    `kill_driver` is ``(rank, global_step, pid)``: that rank kills the driver's process there.
    `split_window` is ``(lost, ahead, global_step)``: at that step's optimizer step, rank `ahead`
    steps, rank `lost` exits once it did, and the others wait in a collective first (as on ranks
    that a gradient all-reduce failed while it ended on `ahead`). A worker set up once the marker
    ``arm-setup-death`` exists exits in its set-up, once."""

    def setup(self, config: dict[str, Any]) -> None:
        markers = self._faults().get("markers")
        if markers and os.path.exists(os.path.join(markers, "arm-setup-death")):
            if self._first("setup-died"):
                os._exit(1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 4, generator=gen)
        xv = torch.randn(VALIDATION_ROWS, 8, generator=gen)
        yv = torch.randn(VALIDATION_ROWS, 4, generator=gen)
        if config.get("plain"):
            model[2].p = 0.0  # no random draws (see the test of a smaller group)
        self.register(
            models=model,
            optimizers=optimizer,
            criterion=nn.MSELoss(),
            # Stepped at each epoch's end (the trainers' scheduler_step_freq="epoch").
            schedulers=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        )
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            # Sums that do not depend on DDP's bucket layout: equal means bit for bit.
            self.model.register_comm_hook(None, per_parameter_mean)
        # Both loaders shuffle without a generator of their own, as most scripts' do: each pass
        # draws its order from the rank's global generator, validation's too.
        self.register_data(
            train_loader=DataLoader(
                TensorDataset(x, y), batch_size=config[BATCH_SIZE], shuffle=True
            ),
            validation_loader=DataLoader(
                TensorDataset(xv, yv), batch_size=config[BATCH_SIZE], shuffle=True
            ),
        )
        # Each rank's own random streams, as a script that seeds by rank has.
        torch.manual_seed(1000 + self.world_rank)
        random.seed(2000 + self.world_rank)
        np.random.seed(3000 + self.world_rank)
        self.carried = torch.zeros(8)
        # Hooked whatever the plan says now: a shared trainer's next plan may use them.
        optimizer.register_step_pre_hook(self._split_window)
        optimizer.register_step_post_hook(self._after_step)

    def _faults(self) -> dict[str, Any]:
        """The plan as it is now (read at every use: a test arms a shared trainer's next run)."""
        plan = self.config.get("plan")
        if plan is None or not os.path.exists(plan):
            return {}
        with open(plan) as handle:
            faults: dict[str, Any] = json.load(handle)
        return faults

    def _first(self, name: str) -> bool:
        """Whether this is the first time marker `name` is asked for (it exists from now on)."""
        path = os.path.join(self._faults()["markers"], name)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _exit_once(self, kills: Any, name: str) -> None:
        for rank, step in kills:
            if (rank, step) == (self.world_rank, self.global_step):
                if self._first(f"{name}{rank}-{step}"):
                    _await_a_checkpoint(self._faults().get("await_checkpoint"))
                    os._exit(1)

    def _after_step(self, *args: Any) -> None:
        faults = self._faults()
        self._exit_once(faults.get("exits_after_step", ()), "after-step-")
        if faults.get("split_window"):
            _, ahead, step = faults["split_window"]
            if (self.world_rank, self.global_step) == (ahead, step):
                mark(faults["markers"], "ahead-stepped")

    def _split_window(self, *args: Any) -> None:
        faults = self._faults()
        if not faults.get("split_window"):
            return
        lost, ahead, step = faults["split_window"]
        rank = self.world_rank
        if self.global_step != step or rank == ahead or not self._first(f"split-{rank}"):
            return
        if rank == lost:
            wait_for(faults["markers"], ["ahead-stepped"])
            os._exit(1)
        # Never ends: `ahead` went on to the next window, `lost` dies; the group's abort
        # releases this rank with an error, before its optimizer stepped.
        torch.distributed.all_reduce(torch.zeros(1))

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        faults = self._faults()
        self._exit_once(faults.get("kills", ()), "")
        if faults.get("kill_driver"):
            rank, step, pid = faults["kill_driver"]
            if (rank, step) == (self.world_rank, self.global_step) and self._first("driver-killed"):
                _await_a_checkpoint(faults.get("await_checkpoint"))
                os.kill(pid, signal.SIGKILL)
        if self.config.get("plain"):
            return super().train_batch(batch, batch_info)
        x, y = batch
        noise = random.random() + float(np.random.rand())
        # Large enough that a wrong stream moves the weights by far more than the tolerance.
        x = x + 1e-2 * self.carried + 1e-1 * noise
        self.carried = 0.9 * self.carried + x.mean(dim=0)
        metrics = super().train_batch((x, y), batch_info)
        # Counted as a language model counts tokens: the call's count is then the sum of what
        # the ranks counted, also of those lost in it.
        metrics["num_samples"] = TOKENS_PER_ROW * len(x)
        return metrics

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y = batch
        with torch.no_grad():
            loss = self.criterion(self.model(x), y)
        return {"val_loss": float(loss), "num_samples": len(x)}

    def rank_state_dict(self) -> Any:
        return {"carried": self.carried}

    def load_rank_state_dict(self, state: Any) -> None:
        self.carried = torch.zeros(8) if state is None else state["carried"]


def _await_a_checkpoint(root: Optional[str], timeout_s: float = 60.0) -> None:
    """Wait (bounded) until `root` holds a complete checkpoint (its writer runs in the
    background: a fault that must find one waits for it rather than racing it)."""
    if root is None:
        return
    deadline = time.monotonic() + timeout_s
    while newest_complete(root) is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _arm(plan: Path, markers: Optional[Path] = None, **faults: Any) -> None:
    """Write the faults that a trainer reading `plan` meets from now on (none without
    arguments), each once per marker in `markers` (the test's own folder)."""
    content = {**faults, "markers": str(markers)} if markers is not None else {}
    mark(plan.parent, plan.name, json.dumps(content))


@dataclass
class _Shared:
    """A trainer that outlives its test, the plan it reads, and whether the last test that used
    it ended (else it is built anew: that test may have left it anywhere)."""

    trainer: TorchTrainer
    plan: Path
    healthy: bool = False


#: The shared trainer, by (strategy, k): one at a time, as the local cluster (4 CPUs) has room
#: for one trainer of 4 workers and a spare at 0.5 CPU each, not for a second beside it.
_HELD: dict[tuple[str, int], _Shared] = {}


def _release() -> None:
    """Shut the shared trainer down, if one is held."""
    while _HELD:
        _, shared = _HELD.popitem()
        shared.trainer.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _release_at_the_end() -> Iterator[None]:
    yield
    _release()


def _trainer(strategy: str, k: int, **kwargs: Any) -> TorchTrainer:
    _release()  # room for this one
    config = {BATCH_SIZE: GLOBAL_BATCH, **kwargs.pop("config", {})}
    extra = {"snapshot_every": 2} if strategy == "fsdp" else {}
    return TorchTrainer(
        training_operator_cls=ExactOperator,
        config=config,
        num_workers=WORKERS,
        num_cpus_per_worker=0.5,
        strategy=strategy,
        accumulate_grad_batches=k,
        scheduler_step_freq="epoch",
        **extra,
        **kwargs,
    )


def _spared(strategy: str, k: int, plan: Path) -> TorchTrainer:
    """A trainer that keeps its size and its result through losses: a spare, and replacements
    started before the group goes on; its faults are those `plan` says (none yet)."""
    _arm(plan)
    return _trainer(
        strategy,
        k,
        config={"plan": str(plan)},
        spare_workers=1,
        failure_policy=DefaultPolicy(replace_in_background=False),
    )


def _rank_state(operator: ExactOperator) -> dict[str, Any]:
    """What a rank carries from step to step besides the model (run on each worker)."""
    return {
        "carried": operator.carried.clone(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "lr": operator.scheduler.get_last_lr(),
    }


@dataclass
class _Result:
    """What a run of the job ends with: the model's weights and every rank's own state."""

    weights: dict[str, torch.Tensor]
    ranks: list[dict[str, Any]]


def _result(trainer: TorchTrainer) -> _Result:
    weights = {k: v.clone() for k, v in trainer.get_model().state_dict().items()}
    return _Result(weights, trainer.apply_all_operators(_rank_state))


def _assert_equal(got: _Result, expected: _Result) -> None:
    for name, value in expected.weights.items():
        difference = float((got.weights[name] - value).abs().max())
        assert difference <= TOLERANCE, f"{name} differs by {difference}"
    # Each rank goes on with its own generators and state, whichever process runs it now.
    assert len(got.ranks) == len(expected.ranks)
    for rank, (mine, theirs) in enumerate(zip(got.ranks, expected.ranks)):
        for key, value in theirs.items():
            same = (
                bool(np.array_equal(np.asarray(mine[key]), np.asarray(value)))
                if key != "python"
                else mine[key] == value
            )
            assert same, f"rank {rank}'s {key} differs from the uninterrupted run's"


def _rest_of_job(trainer: TorchTrainer, from_step: int = 6) -> None:
    """The job from a state of its first epoch saved after `from_step` steps to its end: each
    epoch trained, then validated, as RaySGD's examples do; every call counts each of its rows'
    tokens once (the first epoch's: those after the save)."""
    for epoch in range(2):
        result = trainer.train(max_retries=4)  # up to 4 losses in a call
        assert result["num_samples"] == TOKENS_PER_ROW * (
            ROWS - (from_step * GLOBAL_BATCH if epoch == 0 else 0)
        ), result
        trainer.validate()


#: (strategy, k) -> the uninterrupted job's result and its save: the tests that fault the same
#: job share one run of it.
_CLEAN: dict[tuple[str, int], tuple[_Result, Path]] = {}


def _uninterrupted(trainer: TorchTrainer, strategy: str, folder: Path) -> tuple[_Result, Path]:
    """The uninterrupted job on `trainer`, just built: a call that ends inside a window, a save
    there (into `folder`), the rest. Its result and the save."""
    saved = folder / ("state" if strategy == "fsdp" else "state.pt")
    trainer.train(num_steps=6)
    trainer.save(saved)
    _rest_of_job(trainer)
    assert trainer.failures == 0
    return _result(trainer), saved


@contextmanager
def _shared(strategy: str, k: int, folder: Path) -> Iterator[_Shared]:
    """The trainer of (strategy, k)'s runs, for the time of one test: the one held, or a new one
    (its plan in `folder`) on which the uninterrupted job runs first, unless an earlier test ran
    it. The test loads the state it starts from and arms its faults (`_arm`)."""
    key = (strategy, k)
    shared = _HELD.get(key)
    if shared is None or not shared.healthy:
        _release()
        plan = folder / "plan.json"
        shared = _HELD[key] = _Shared(_spared(strategy, k, plan), plan)
    shared.healthy = False
    if key not in _CLEAN:
        _CLEAN[key] = _uninterrupted(shared.trainer, strategy, folder)
    yield shared
    shared.healthy = True


def _clean_run(strategy: str, k: int, folder: Path) -> tuple[_Result, Path]:
    """The uninterrupted job's result and its save (into `folder`, unless an earlier test
    ran the same job)."""
    key = (strategy, k)
    if key not in _CLEAN:
        with _shared(strategy, k, folder):
            pass  # the shared trainer ran the job first
    return _CLEAN[key]


@contextmanager
def _faulted(strategy: str, k: int, folder: Path) -> Iterator[tuple[TorchTrainer, Path]]:
    """The trainer a faulted run of (strategy, k) runs on (the shared one) and the plan it reads
    its faults from."""
    with _shared(strategy, k, folder) as shared:
        yield shared.trainer, shared.plan


# (strategy, k, the kills: rank and global step, the exits just after a step). Epoch 0 ends at
# step 15 and epoch 1 at 31, each followed by a validation and the scheduler's step. With k=4 the
# kills fall on every position of a window for each strategy (16: its first, also the first
# batch of an epoch; 9 and 13: its second; 22 and 30: its third; 15 and 23: its last, 15 also
# an epoch's), each in a window of its own (ranks do not wait for each other inside a window: two
# kills in one window are one burst), and fsdp's exit falls just after a window's step; the job
# goes on from the save at step 6, whose state is its window's start (step 4). ddp-k4 last: the
# test after it runs on the same trainer.
CASES = [
    ("ddp", 1, [(2, 15), (1, 31)], []),
    ("fsdp", 4, [(0, 16), (1, 13), (3, 30), (2, 23)], [(3, 27)]),
    ("fsdp", 1, [(1, 16)], []),
    ("ddp", 4, [(1, 9), (2, 15), (0, 16), (3, 22)], []),
]


@pytest.mark.parametrize(
    ("strategy", "k", "kills", "after_step"), CASES, ids=[f"{c[0]}-k{c[1]}" for c in CASES]
)
def test_a_job_loaded_inside_a_window_and_losing_workers_ends_with_the_clean_result(
    strategy: str, k: int, kills: list, after_step: list, tmp_path: Path
) -> None:
    expected, saved = _clean_run(strategy, k, tmp_path)

    markers = tmp_path / "markers"
    markers.mkdir()
    with _faulted(strategy, k, tmp_path) as (trainer, plan):
        trainer.load(saved)  # saved after 6 steps: the state of step 4 for k=4
        _arm(plan, markers, kills=kills, exits_after_step=after_step)
        failures, seen = trainer.failures, len(trainer.recovery_events)
        _rest_of_job(trainer)
        assert trainer.failures - failures == len(kills) + len(after_step), sorted(
            p.name for p in markers.iterdir()
        )
        resizes = [e for e in trainer.recovery_events[seen:] if e.kind == "resize"]
        assert resizes and all(e.num_workers_after == WORKERS for e in resizes)
        assert all(e.inexact == () for e in resizes), [e.inexact for e in resizes]
        if strategy == "ddp":
            # A window is done again at most: its batches, the one in flight included.
            assert all(0 < e.steps_redone <= k for e in resizes), [e.steps_redone for e in resizes]
        _assert_equal(_result(trainer), expected)


def test_a_loss_inside_a_resize_and_survivors_a_window_apart_keep_the_clean_weights(
    tmp_path: Path,
) -> None:
    # Window 8-11: rank 1 dies at step 9 and the worker that takes its place dies while it sets
    # up, inside that resize; the next one takes the place. Window 16-19: its last all-reduce
    # ends on rank 3, which steps to 20, and fails on ranks 0 and 2 when rank 1 dies. Rank 3
    # holds step 20's model, but the slots of ranks 0, 1 and 2 of step 20 exist nowhere; step
    # 16's model and every rank's slot of step 16 do: the group goes back to 16 (rank 3 too)
    # and redoes the window. Three losses, every one exact.
    expected, saved = _clean_run("ddp", 4, tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    with _faulted("ddp", 4, tmp_path) as (trainer, plan):
        trainer.load(saved)
        _arm(plan, markers, kills=[(1, 9)], split_window=(1, 3, 19))
        mark(markers, "arm-setup-death")
        failures, seen = trainer.failures, len(trainer.recovery_events)
        _rest_of_job(trainer)
        assert (markers / "setup-died").exists() and trainer.failures - failures == 3
        resizes = [e for e in trainer.recovery_events[seen:] if e.kind == "resize"]
        assert resizes and all(e.num_workers_after == WORKERS for e in resizes)
        assert all(e.inexact == () for e in resizes), [e.inexact for e in resizes]
        assert resizes[-1].steps_redone == 4, resizes[-1]
        _assert_equal(_result(trainer), expected)


def test_a_burst_that_takes_every_holder_of_a_slot_goes_back_to_a_checkpoint(
    tmp_path: Path,
) -> None:
    # A new trainer loads the job's save (its state of step 4). Ranks 1, 2 and 3 of 4 are lost
    # at once, inside the window that starts at step 12. Rank 1's slot of step 12 was held by
    # itself and its two successors, all lost: no survivor can go on exactly. The newest
    # periodic checkpoint holds every rank's: the group goes back to it and redoes the steps
    # since, and the call counts each of its rows once.
    expected, saved = _clean_run("ddp", 4, tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    plan = tmp_path / "plan.json"
    periodic = tmp_path / "periodic"
    _arm(plan)
    trainer = _trainer(
        "ddp",
        4,
        config={"plan": str(plan)},
        checkpoint_dir=str(periodic),
        checkpoint_every=8,
        keep_checkpoints=1,  # only the newest
        spare_workers=1,
        failure_policy=DefaultPolicy(replace_in_background=False),
    )
    try:
        trainer.load(saved)
        burst = [(1, 14), (2, 14), (3, 14)]
        _arm(plan, markers, kills=burst, await_checkpoint=str(periodic))
        _rest_of_job(trainer)
        resizes = [e for e in trainer.recovery_events if e.kind == "resize"]
        assert resizes and all(e.num_workers_after == WORKERS for e in resizes)
        assert all(e.inexact == () for e in resizes), [e.inexact for e in resizes]
        assert any("checkpoint" in (e.source or "") for e in resizes), [e.source for e in resizes]
        _assert_equal(_result(trainer), expected)
    finally:
        trainer.shutdown()


DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import ray
    sys.path.insert(0, {repo!r})
    from tests.raysgd.test_exact_recovery import _trainer

    folder, plan, markers = sys.argv[1:]
    ray.init(address=os.environ["RAYSGD_TEST_ADDRESS"], log_to_driver=False)
    trainer = _trainer("ddp", 4, config={{"plan": plan}}, checkpoint_dir=folder, checkpoint_every=6)
    # Rank 0 kills this process inside the call, at step 10, once the checkpoint of step 8 (the
    # first window end at or after 6 steps) is complete.
    with open(plan, "w") as handle:
        json.dump(
            {{"markers": markers, "kill_driver": [0, 10, os.getpid()], "await_checkpoint": folder}},
            handle,
        )
    trainer.train()
    print("NOT KILLED", flush=True)
    """
)


def test_a_killed_driver_resumed_and_a_smaller_group_keep_the_result(tmp_path: Path) -> None:
    # The driver dies (SIGKILL) inside a train() call with checkpoint_every=6 and k=4: its
    # checkpoints are taken at the first window end at or after every 6 steps, with every rank's
    # generators and per-rank state; resume=True goes on from the newest, as the uninterrupted
    # job would have.
    expected, _ = _clean_run("ddp", 4, tmp_path)
    _release()  # room for the driver's trainer
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO)))
    folder = tmp_path / "checkpoints"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, "RAYSGD_TEST_ADDRESS": ray.get_runtime_context().gcs_address}
    killed = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "plan.json"), str(markers)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=str(REPO),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    assert (markers / "driver-killed").exists()
    resumed = _trainer("ddp", 4, checkpoint_dir=str(folder), resume=True)
    try:
        assert resumed.epoch == 0
        # It went on from the checkpoint at step 8 (a run that loaded nothing would train the
        # whole epoch: the same weights, from a deterministic job): 8 steps are left of it.
        first = resumed.train()
        assert first["batch_count"] == 8, first
        assert first["num_samples"] == TOKENS_PER_ROW * (ROWS - 8 * GLOBAL_BATCH), first
        resumed.validate()
        resumed.train()
        resumed.validate()
        _assert_equal(_result(resumed), expected)
    finally:
        resumed.shutdown()

    # One of 4 workers lost and the default policy: the 3 survivors go on at once (the global
    # batch kept, each taking a larger share) while the replacement starts, to join at a
    # window's end. The rows are split anew over 3 ranks: a rank's random draws and carried
    # state would then go with other rows (a different draw of the same job, which no tolerance
    # can bound), so this job draws nothing and carries nothing. Each step then averages the
    # gradients of the same rows, summed over 3 ranks instead of 4 in float32: the weights agree
    # within 1e-5, and every row is trained once per epoch. One trainer runs the job
    # uninterrupted first, then again from its start (a save made before it trained), faulted.
    markers = tmp_path / "smaller-markers"
    markers.mkdir()
    plan = tmp_path / "smaller-plan.json"
    smaller = _trainer("ddp", 4, config={"plan": str(plan), "plain": True})
    try:
        start = smaller.save(tmp_path / "start.pt")
        assert [smaller.train()["num_samples"] for _ in range(2)] == [ROWS, ROWS]
        assert smaller.failures == 0
        plain = _result(smaller).weights
        smaller.load(start)
        _arm(plan, markers, kills=[(1, 6)])
        counts = [smaller.train()["num_samples"] for _ in range(2)]
        assert counts == [ROWS, ROWS] and smaller.failures == 1
        sizes = [e.num_workers_after for e in smaller.recovery_events if e.kind == "resize"]
        assert sizes[0] == WORKERS - 1, sizes
        got = _result(smaller).weights
    finally:
        smaller.shutdown()
    for name, value in plain.items():
        difference = float((got[name] - value).abs().max())
        assert difference <= 1e-5, f"{name} differs by {difference}"


def test_a_worker_lost_just_after_a_windows_step_is_one_exact_loss(tmp_path: Path) -> None:
    # A new trainer loads the job's save (its state of step 4). Rank 1 dies just after the
    # optimizer step that ends a window at a checkpoint's step (8), its train_batch not yet
    # returned. Every rank hands its ring successor its slot of the window start a step leads
    # to before stepping, so the successor holds rank 1's of step 8: the group goes on from
    # there exactly, with one loss. The survivors must also agree where the next checkpoint
    # falls (taking one takes every worker), or the one that takes it alone waits for the
    # others until they declare it silent: a second, spurious loss.
    expected, saved = _clean_run("ddp", 4, tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    plan = tmp_path / "plan.json"
    _arm(plan)
    trainer = _trainer(
        "ddp",
        4,
        config={"plan": str(plan)},
        checkpoint_dir=str(tmp_path / "periodic"),
        checkpoint_every=8,
        spare_workers=1,
        failure_policy=DefaultPolicy(replace_in_background=False),
    )
    try:
        trainer.load(saved)
        _arm(plan, markers, exits_after_step=[(1, 7)])
        _rest_of_job(trainer)
        assert trainer.failures == 1 and trainer.num_workers == WORKERS
        (resize,) = [e for e in trainer.recovery_events if e.kind == "resize"]
        assert resize.inexact == () and resize.steps_redone <= 4, resize
        _assert_equal(_result(trainer), expected)
        # The checkpoints went on after the loss: the newest complete one is at the job's end
        # (a save waits for the periodic one in flight).
        trainer.save(tmp_path / "end.pt")
        newest = newest_complete(tmp_path / "periodic")
        assert newest is not None and newest.manifest.step == 32
    finally:
        trainer.shutdown()
