"""Recovery of `TorchTrainer.train(max_retries=...)` from real worker deaths.

Every failure here is real: a worker process `os._exit`s or is `ray.kill`ed mid-epoch, an
initialization hook dies in a replacement worker, user code raises. Marker files in `tmp_path` make a
failure happen on the first attempt only (the redone epoch must not fail again) and count calls across
processes. No test relies on a process-group timeout: a dead peer is detected from the dead actor.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from tests._support.rows import record_rows, rows_by_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import StateLostError, TorchTrainer, TrainingOperator
from raysgd._internal.storage.catalog import abandoned, complete_checkpoints, newest_complete
from raysgd._internal.storage.format import AUTO_NAMES, WHOLE
from raysgd._internal.storage.location import Storage
from raysgd.utils import BATCH_SIZE
from raysgd_core import WorkerDiedError, WorkerError, get_context

pytestmark = pytest.mark.usefixtures("ray_local")

NUM_SAMPLES = 256
GLOBAL_BATCH = 4  # 2 per worker with 2 workers: 64 steps per epoch
DIE_AT_STEP = 40  # well into the first epoch: at most the step in flight may be redone


class LinearOperator(TrainingOperator):
    """A seeded linear regression on a fixed synthetic data set; deterministic across runs. Each
    row carries its id, and every finished step's ids go to a file of the worker's process."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(NUM_SAMPLES, 4, generator=gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
            NUM_SAMPLES, 1, generator=gen
        )
        ids = torch.arange(NUM_SAMPLES)
        loader = DataLoader(TensorDataset(x, y, ids), batch_size=config[BATCH_SIZE])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        self.register_data(train_loader=loader, validation_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config["marker_dir"], batch_info["epoch_idx"] + 1, ids)
        return metrics

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        return super().validate_batch(batch[:2], batch_info)


def _first_time(config: dict[str, Any], name: str) -> bool:
    """True exactly once per marker name across all processes (O_EXCL create is atomic)."""
    try:
        fd = os.open(os.path.join(config["marker_dir"], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class ExitOnceOperator(LinearOperator):
    """Rank 1 `os._exit`s at global step DIE_AT_STEP, on the first attempt only."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if (
            self.world_rank == 1
            and batch_info["global_step"] == DIE_AT_STEP
            and _first_time(self.config, "exited")
        ):
            os._exit(1)
        return super().train_batch(batch, batch_info)


class BlockOnceOperator(LinearOperator):
    """Rank 1 signals at DIE_AT_STEP and then blocks (first attempt only) until it is killed."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if (
            self.world_rank == 1
            and batch_info["global_step"] == DIE_AT_STEP
            and _first_time(self.config, "blocked")
        ):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the test kills this process meanwhile
                time.sleep(0.05)
        return super().train_batch(batch, batch_info)


class SlowAloneExitOnceOperator(ExitOnceOperator):
    """As `ExitOnceOperator`, with steps of a second while one worker trains alone: the rest of
    the first epoch then lasts 24 s, more than twice its replacement's start on a loaded machine
    (5 s here, 10 s loaded; a spare coming up is nothing an operator can wait for). The alone
    steps end as soon as it joins, so the test is hardly slower for it."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.world_size == 1:
            time.sleep(1.0)
        return super().train_batch(batch, batch_info)


class AllExitOnceOperator(LinearOperator):
    """Every rank `os._exit`s at global step DIE_AT_STEP, on the first attempt only. With
    `config["exit_after_checkpoint"]` (a checkpoint_dir and a step) it exits once the periodic
    checkpoint of that step is complete there: its writer thread runs at the lowest priority, and
    on a busy machine the few fast steps up to DIE_AT_STEP can outrun it."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if batch_info["global_step"] == DIE_AT_STEP and _first_time(
            self.config, f"exited-{self.world_rank}"
        ):
            if "exit_after_checkpoint" in self.config:
                _await_checkpoint(*self.config["exit_after_checkpoint"])
            os._exit(1)
        return super().train_batch(batch, batch_info)


def _await_checkpoint(root: str, step: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newest = newest_complete(root)
        if newest is not None and newest.step >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no complete checkpoint of step {step} under {root} in {timeout_s} s")


class TornOnceOperator(LinearOperator):
    """After each step, a collective of the user's own; at DIE_AT_STEP rank 1 exits between its
    step and that collective (first attempt only), leaving rank 0 stepped inside an unfinished
    batch: no worker holds the state of a finished step."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        metrics = super().train_batch(batch, batch_info)
        if (
            self.world_rank == 1
            and batch_info["global_step"] == DIE_AT_STEP
            and _first_time(self.config, "exited")
        ):
            os._exit(1)
        dist.all_reduce(torch.ones(1))
        return metrics


class TornGANOperator(TrainingOperator):
    """A two-optimizer GAN on seeded data and noise (the same in every run). At DIE_AT_STEP of
    the first attempt rank 1 exits after the generator's step and before the discriminator's:
    rank 0, blocked in the discriminator's all-reduce, has stepped one optimizer of two."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        disc = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())
        gen = nn.Linear(2, 1)
        self.register(
            models=(disc, gen),
            optimizers=tuple(torch.optim.Adam(m.parameters(), lr=0.01) for m in (disc, gen)),
            criterion=nn.BCELoss(),
        )
        real = torch.randn(NUM_SAMPLES, 1, generator=torch.Generator().manual_seed(1)) + 3
        self.register_data(
            train_loader=DataLoader(TensorDataset(real), batch_size=config[BATCH_SIZE])
        )

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        disc, gen = self.models
        opt_d, opt_g = self.optimizers
        real = batch[0]
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        seed = 1000 * batch_info["global_step"] + self.world_rank
        noise = torch.randn(len(real), 2, generator=torch.Generator().manual_seed(seed))
        opt_g.zero_grad()
        self.criterion(disc(gen(noise)), ones).backward()
        opt_g.step()
        if (
            self.world_rank == 1
            and batch_info["global_step"] == DIE_AT_STEP
            and _first_time(self.config, "exited")
        ):
            os._exit(1)
        opt_d.zero_grad()
        fake = gen(noise).detach()
        loss_d = (self.criterion(disc(real), ones) + self.criterion(disc(fake), zeros)) / 2
        loss_d.backward()
        opt_d.step()
        return {"loss_d": loss_d.item(), "num_samples": len(real)}


class AlwaysExitOperator(LinearOperator):
    """Rank 1 exits at step 1 of every attempt: no retry budget is enough."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            os._exit(1)
        return super().train_batch(batch, batch_info)


class RaiseOnceOperator(LinearOperator):
    """Rank 1 raises a user error at step 1 of the first call; every raise is counted on disk."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if self.world_rank == 1 and batch_info["batch_idx"] == 1:
            if _first_time(self.config, "raised"):
                with open(os.path.join(self.config["marker_dir"], "raise_count"), "a") as f:
                    f.write("x\n")
                raise ValueError("boom from rank 1")
        return super().train_batch(batch, batch_info)


def _make(
    op_cls: type, tmp_path: Path, config: dict[str, Any] | None = None, **kwargs: Any
) -> TorchTrainer:
    kwargs.setdefault("num_workers", 2)
    return TorchTrainer(
        training_operator_cls=op_cls,
        config={BATCH_SIZE: GLOBAL_BATCH, "marker_dir": str(tmp_path), **(config or {})},
        timeout_s=60,  # safety net only: no test depends on it
        **kwargs,
    )


def _weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.get_model(to_cpu=True).state_dict().items()}


_CLEAN: dict[str, Any] = {}


def _clean_run(tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Two epochs without failure (computed once per module): the reference every recovery meets."""
    if not _CLEAN:
        (tmp_path / "clean").mkdir(exist_ok=True)
        trainer = _make(LinearOperator, tmp_path / "clean")
        try:
            stats = [trainer.train(), trainer.train()]
            _CLEAN["stats"], _CLEAN["weights"] = stats, _weights(trainer)
        finally:
            trainer.shutdown()
    return _CLEAN["stats"], _CLEAN["weights"]


def _assert_same_run(
    stats: list[dict[str, Any]],
    weights: dict[str, torch.Tensor],
    tmp_path: Path,
    interrupted: tuple[int, ...] = (0,),
) -> None:
    """The run trained exactly what the clean run did: every step and row of every call once,
    the same weights. The loss of a call that a lost worker interrupted averages the rows whose
    loss values survived (the lost worker's went with it), so only the others' are compared."""
    clean_stats, clean_weights = _clean_run(tmp_path)
    assert [s["epoch"] for s in stats] == [s["epoch"] for s in clean_stats]
    assert [s["num_samples"] for s in stats] == [NUM_SAMPLES, NUM_SAMPLES]
    assert [s["batch_count"] for s in stats] == [s["batch_count"] for s in clean_stats]
    for i, (got, want) in enumerate(zip(stats, clean_stats)):
        if i not in interrupted:
            assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert weights.keys() == clean_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], clean_weights[name])


def _hook_failing_in_first_replacement(folder: str) -> Any:
    def hook() -> None:
        # Claim the next start number atomically: starts 0 and 1 are the initial workers, start 2
        # is the first replacement after the loss, and its set-up fails.
        i = 0
        while True:
            try:
                os.close(os.open(os.path.join(folder, f"start-{i}"), os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                i += 1
        if i == 2:
            raise OSError("replacement machine is broken")

    return hook


@pytest.mark.timeout(150)
def test_worker_exit_mid_epoch_and_a_failed_replacement_start_recover_to_the_clean_result(
    tmp_path: Path,
) -> None:
    # Rank 1 exits at step 40; the first replacement's initialization hook then raises: a second
    # loss, during the restart, and the restart is retried with another worker.
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    trainer = _make(
        ExitOnceOperator,
        tmp_path,
        initialization_hook=_hook_failing_in_first_replacement(str(hook_dir)),
    )
    try:
        pids = trainer.apply_all_workers(os.getpid)
        stats = [trainer.train(max_retries=3), trainer.train(max_retries=3)]
        events = trainer.recovery_events
        kinds = [e.kind for e in events]
        # The loss in training: it really happened, once, and was rank 1's.
        assert (tmp_path / "exited").exists(), "loss in training: rank 1 never exited"
        assert kinds.count("failure") == 1, f"loss in training: {kinds}"
        failure = next(e for e in events if e.kind == "failure")
        assert failure.ranks == (1,), f"loss in training: {failure}"
        # The failed restart: counted as a loss of its own, logged with the hook's error; the
        # hook ran in the 2 initial workers, the failed replacement and the one that took over.
        starts = sorted(p.name for p in hook_dir.iterdir())
        assert starts == [f"start-{i}" for i in range(4)], f"failed restart: hook starts {starts}"
        assert trainer.failures == 2, f"failed restart: {trainer.failures} failures, not 2"
        failed = [e for e in events if e.kind == "restart_failed"]
        assert len(failed) == 1, f"failed restart: {len(failed)} restart_failed events"
        assert "replacement machine is broken" in (failed[0].error or ""), (
            f"failed restart: {failed[0].error}"
        )
        # The recovery: the survivor kept its process (and its loaded data); only rank 1 was
        # replaced, by the retried restart.
        assert "resize" in kinds and "recovered" in kinds, f"recovery: {kinds}"
        assert trainer.num_workers == 2, f"recovery: {trainer.num_workers} workers"
        new_pids = trainer.apply_all_workers(os.getpid)
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1], (
            f"recovery: pids {pids} -> {new_pids}"
        )
        resize = next(e for e in events if e.kind == "resize")
        assert (resize.path, resize.num_workers_after) == ("keep-healthy", 2), f"recovery: {resize}"
        # The survivor had finished step 40 (of 64) and gave its state to the replacement: only
        # the step in flight was redone, and each epoch trained every row once, the lost
        # worker's first 40 batches included.
        assert (resize.source, resize.steps_redone) == ("rank 0 at step 40", 1), (
            f"recovery: state from {resize.source}, {resize.steps_redone} step(s) redone"
        )
        assert resize.report is not None and resize.report.steps_redone == 1, (
            f"recovery: report {resize.report}"
        )
        rows = rows_by_epoch(tmp_path)
        assert sorted(rows[1]) == sorted(rows[2]) == list(range(NUM_SAMPLES)), (
            "result: an epoch did not train every row once"
        )
        # The result: the run the clean one was.
        _assert_same_run(stats, _weights(trainer), tmp_path)
    finally:
        trainer.shutdown()


@pytest.mark.timeout(120)
def test_the_survivor_trains_on_while_its_replacement_starts_then_it_joins(tmp_path: Path) -> None:
    trainer = _make(SlowAloneExitOnceOperator, tmp_path, failure_policy="elastic")
    try:
        pids = trainer.apply_all_workers(os.getpid)
        stats = [trainer.train(max_retries=3), trainer.train(max_retries=3)]
        assert (tmp_path / "exited").exists() and trainer.failures == 1
        events = trainer.recovery_events
        decision = next(e for e in events if e.kind == "decision")
        assert "RETRY with 1 worker(s), 1 more starting in the background" in decision.message
        resizes = [e for e in events if e.kind == "resize"]
        # At once: the survivor alone, from its own state at step 40 (the step in flight
        # redone); then the replacement, once up, joined at a step boundary with nothing redone.
        assert [(e.num_workers_before, e.num_workers_after) for e in resizes] == [(2, 1), (1, 2)]
        assert (resizes[0].source, resizes[0].steps_redone) == ("rank 0 at step 40", 1)
        assert "(grow)" in resizes[1].message and resizes[1].steps_redone == 0
        joined_at = int(resizes[1].source.rsplit(" ", 1)[1])
        assert DIE_AT_STEP < joined_at < NUM_SAMPLES // GLOBAL_BATCH  # inside the first call
        new_pids = trainer.apply_all_workers(os.getpid)
        assert new_pids[0] == pids[0] and new_pids[1] != pids[1] and trainer.num_workers == 2
        rows = rows_by_epoch(tmp_path)
        assert sorted(rows[1]) == sorted(rows[2]) == list(range(NUM_SAMPLES))
        # The global batch stays the same at every size: the run is the clean one.
        _assert_same_run(stats, _weights(trainer), tmp_path)
        assert trainer.goodput()["failures"] == 1
    finally:
        trainer.shutdown()


def _actor_handle() -> Any:
    ctx = ray.get_runtime_context()
    return ctx.current_actor if ctx.get_actor_id() else None


def _kill_when_blocked(handle: Any, marker: Path) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        ray.kill(handle, no_restart=True)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_ray_kill_from_another_thread_mid_epoch_recovers(tmp_path: Path) -> None:
    trainer = _make(BlockOnceOperator, tmp_path)
    try:
        handles = trainer.apply_all_workers(_actor_handle)
        killer = _kill_when_blocked(handles[1], tmp_path / "blocked")
        stats = [trainer.train(max_retries=2)]
        killer.join(timeout=5)
        stats.append(trainer.train(max_retries=2))
        assert trainer.failures == 1
        assert trainer.num_workers == 2
        _assert_same_run(stats, _weights(trainer), tmp_path)
    finally:
        trainer.shutdown()


@pytest.mark.timeout(180)
def test_every_worker_lost_at_once_restores_a_checkpoint_or_says_what_was_lost(
    tmp_path: Path,
) -> None:
    # No worker survives to give the state, and the driver keeps no copy (state_copy_limit_mb=0):
    # without a checkpoint the state is gone, and the error says how to keep it next time.
    trainer = _make(AllExitOnceOperator, tmp_path, state_copy_limit_mb=0)
    try:
        with pytest.raises(StateLostError, match=r"checkpoint='auto'\) or save\(\)"):
            trainer.train(max_retries=2)
        assert trainer.failures == 1  # given up at once: retrying cannot bring the state back
    finally:
        trainer.shutdown(force=True)
    # With the checkpoint written at the start of the call, the call is done again from it.
    again = tmp_path / "again"
    again.mkdir()
    trainer = _make(AllExitOnceOperator, again, state_copy_limit_mb=0)
    try:
        stats = [trainer.train(max_retries=2, checkpoint="auto"), trainer.train()]
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert resize.source is not None and resize.source.startswith("checkpoint ")
        # Back to the call's start; with no survivor to ask, the count is what the driver knows
        # for sure (the step in flight), a lower bound.
        assert resize.steps_redone == 1
        _assert_same_run(stats, _weights(trainer), tmp_path, interrupted=())
    finally:
        trainer.shutdown()
    # The workers' own checkpoints (checkpoint_every=16, written while the driver only waited
    # on the call) count too: the call goes on from the newest complete one, step 32.
    periodic = tmp_path / "periodic"
    periodic.mkdir()
    trainer = _make(
        AllExitOnceOperator,
        periodic,
        {"exit_after_checkpoint": (str(periodic / "checkpoints"), 32)},
        state_copy_limit_mb=0,
        checkpoint_dir=str(periodic / "checkpoints"),
        checkpoint_every=16,
    )
    try:
        stats = [trainer.train(max_retries=2), trainer.train()]
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert resize.source is not None and "s000000032" in resize.source, resize.source
        # The call's first 32 steps are in the checkpoint (their losses died with the workers):
        # it reports the 32 steps it trained after it, and the run ends as the clean one did.
        assert [s["num_samples"] for s in stats] == [NUM_SAMPLES // 2, NUM_SAMPLES]
        _, clean_weights = _clean_run(periodic)
        for name, value in _weights(trainer).items():
            torch.testing.assert_close(value, clean_weights[name])
    finally:
        trainer.shutdown()


@pytest.mark.timeout(150)
def test_every_worker_lost_after_a_load_that_went_back_restores_the_loaded_state(
    tmp_path: Path,
) -> None:
    # The driver keeps a copy of the state after each call, and the workers write a checkpoint
    # every 16 steps, keeping the newest two. Trained on past a save, both are of later steps;
    # loading the save goes back, and what was kept of the state the load replaced must go with
    # it: every worker lost in the next call restores a periodic checkpoint written since the
    # load (this run's newest state), never the later copy nor a checkpoint of the timeline left
    # behind, and the pruning keeps this timeline's checkpoints, not that one's.
    _, clean_weights = _clean_run(tmp_path)
    for rank in range(2):  # the exits are armed only once the load went back
        (tmp_path / f"exited-{rank}").touch()
    root = tmp_path / "ckpts"
    trainer = _make(
        AllExitOnceOperator,
        tmp_path,
        checkpoint_dir=str(root),
        checkpoint_every=16,
        keep_checkpoints=2,
    )
    try:
        trainer.train(num_steps=8)
        saved = trainer.save(tmp_path / "step8.pt")
        # The copy is of step 64 or later from here on; "auto" writes a checkpoint at step 32.
        trainer.train(), trainer.train(checkpoint="auto")
        trainer.load(saved)
        for rank in range(2):
            (tmp_path / f"exited-{rank}").unlink()
        trainer.train(max_retries=2)  # every rank exits at step 40
        assert trainer.failures == 1 and (tmp_path / "exited-0").exists()
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert resize.source is not None and resize.source.startswith("checkpoint "), resize
        step = int(resize.source.rsplit("at step ", 1)[1])
        assert 16 <= step <= 40, resize.source  # this timeline's, not the one left behind
        trainer.train()
        for name, value in _weights(trainer).items():
            torch.testing.assert_close(value, clean_weights[name])
    finally:
        trainer.shutdown()
    # The replaced timeline's two periodic checkpoints and its "auto" one stay, abandoned; the
    # newest complete one is this timeline's last (what `resume=True` would load), beside the
    # one before it.
    left = abandoned(Storage(root))
    assert AUTO_NAMES[WHOLE] in left and len(left) == 3, left
    assert all(name in os.listdir(root) for name in left)
    kept = [c for c in complete_checkpoints(Storage(root)) if c.location.name not in left]
    assert [c.step for c in kept] == [112, 128]
    assert newest_complete(Storage(root)).location.name == kept[-1].location.name


@pytest.mark.timeout(150)
def test_without_a_clean_survivor_the_call_starts_again_from_the_drivers_copy(
    tmp_path: Path,
) -> None:
    _clean_run(tmp_path)
    trainer = _make(TornOnceOperator, tmp_path)
    try:
        # A call of a given length: every worker, the kept one too, must start it again from the
        # copy's step, or they would run different numbers of steps and wait on each other.
        first = trainer.train(num_steps=48, max_retries=2)
        assert (tmp_path / "exited").exists() and trainer.failures == 1
        resize = next(e for e in trainer.recovery_events if e.kind == "resize")
        assert resize.source == "the driver's copy at step 0"
        assert resize.steps_redone is not None and resize.steps_redone >= 1
        assert (first["batch_count"], first["num_samples"]) == (48, 48 * GLOBAL_BATCH)
        trainer.train(), trainer.train()  # the rest of epoch 1, then epoch 2
        _, clean_weights = _clean_run(tmp_path)
        for name, value in _weights(trainer).items():
            torch.testing.assert_close(value, clean_weights[name])
    finally:
        trainer.shutdown()


def _gan_weights(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for m in trainer.get_model(to_cpu=True) for p in m.parameters()]


@pytest.mark.timeout(150)
def test_a_worker_torn_between_a_gans_two_steps_goes_back_before_it_gives_its_state(
    tmp_path: Path,
) -> None:
    runs, events = {}, {}
    for name in ("clean", "torn"):
        folder = tmp_path / name
        folder.mkdir()
        if name == "clean":
            (folder / "exited").touch()  # its marker is there from the start: it cannot fail
        trainer = _make(TornGANOperator, folder)
        try:
            trainer.train(max_retries=2)
            runs[name], events[name] = _gan_weights(trainer), trainer.recovery_events
        finally:
            trainer.shutdown()
    # The survivor had stepped the generator of step 41, not its discriminator: it went back to
    # step 40 and gave that state, so the run equals the one without a failure.
    assert events["clean"] == [] and (tmp_path / "torn" / "exited").exists()
    resize = next(e for e in events["torn"] if e.kind == "resize")
    assert (resize.source, resize.steps_redone) == (f"rank 0 at step {DIE_AT_STEP}", 1)
    for got, want in zip(runs["torn"], runs["clean"]):
        torch.testing.assert_close(got, want)


@pytest.mark.timeout(150)
def test_exhausted_retry_budget_raises_naming_the_failures(tmp_path: Path) -> None:
    trainer = _make(AlwaysExitOperator, tmp_path)
    try:
        with pytest.raises(RuntimeError) as excinfo:
            trainer.train(max_retries=1)
        message = str(excinfo.value)
        assert "max_retries=1" in message
        assert message.count("rank(s) [1] on node(s)") == 2  # every loss is named
        assert isinstance(excinfo.value.__cause__, WorkerDiedError)  # the last loss, in full
        assert trainer.failures == 2
    finally:
        trainer.shutdown(force=True)


@pytest.mark.timeout(120)
def test_user_error_once_with_traceback_then_a_loss_elsewhere_is_recovered(tmp_path: Path) -> None:
    trainer = _make(RaiseOnceOperator, tmp_path)
    try:
        with pytest.raises(WorkerError) as excinfo:
            trainer.train(max_retries=3)
        assert isinstance(excinfo.value, ValueError)  # the user's own type, too
        text = str(excinfo.value) + str(getattr(excinfo.value, "remote_traceback", ""))
        assert "boom from rank 1" in text
        assert "train_batch" in text  # the worker's traceback reached the caller
        assert (tmp_path / "raise_count").read_text().count("x") == 1  # not retried
        assert trainer.failures == 0
        assert [e.kind for e in trainer.recovery_events].count("user_error") == 1
        # The group was left usable, every worker at the last step finished before the error: the
        # next call goes on with the epoch from there (step 0 of its 64 was finished).
        stats = trainer.train(max_retries=3)
        assert (stats["epoch"], stats["num_samples"]) == (1, NUM_SAMPLES - GLOBAL_BATCH)
        assert trainer.num_workers == 2
        # A worker lost in a call other than train() goes through the same recovery loop: counted
        # and logged as a failure, replaced with the survivor's state, before the call raises.
        with pytest.raises(WorkerDiedError):
            trainer.apply_all_workers(_exit_on_rank_1)
        assert trainer.failures == 1 and trainer.num_workers == 2
        failure, repair = trainer.recovery_events[-2:]
        assert failure.kind == "failure" and failure.ranks == (1,)
        assert repair.kind == "resize" and "repair after a failed call" in repair.message
        assert repair.source.startswith("rank 0 at step") and repair.steps_redone == 0
        assert trainer.validate()["num_samples"] == NUM_SAMPLES
    finally:
        trainer.shutdown()


def _exit_on_rank_1() -> None:
    if get_context().world_rank == 1:
        os._exit(1)


def _operator_that_refers_to_the_trainer() -> tuple[type, Any]:
    """An operator class built in a function: pickled by value with its closure cells, like a class
    from a script's `__main__`. It refers to a variable that later holds the trainer (the shape
    ``trainer = None; class Op: ...; trainer = TorchTrainer(...)``)."""
    trainer = None

    class SeesTrainerOperator(ExitOnceOperator):
        def trainer_is_set(self) -> bool:
            return trainer is not None

    def hold(value: Any) -> None:
        nonlocal trainer
        trainer = value

    return SeesTrainerOperator, hold


@pytest.mark.timeout(120)
def test_restart_reuses_the_operator_class_shipped_at_construction(tmp_path: Path) -> None:
    # Rank 0 lives in this (driver) process and is inside a collective when rank 1 dies: it must be
    # released, not left blocked, and the run must end like a clean one. Were the class pickled
    # again at the restart, its closure would now carry the trainer; with rank 0 in this process
    # that cannot be pickled, the restart would fail as a second loss and the redone epoch would
    # run on one worker with another result.
    op_cls, hold = _operator_that_refers_to_the_trainer()
    trainer = _make(op_cls, tmp_path, use_local=True)
    hold(trainer)
    try:
        stats = [trainer.train(max_retries=3), trainer.train(max_retries=3)]
        assert (tmp_path / "exited").exists()
        assert trainer.failures == 1
        assert trainer.num_workers == 2
        _assert_same_run(stats, _weights(trainer), tmp_path)
    finally:
        hold(None)
        trainer.shutdown()
