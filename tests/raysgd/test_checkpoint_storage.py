"""Checkpoints that outlive the cluster: any fsspec URL (a real S3 server: moto's, through s3fs),
checkpoints written in the background inside an epoch, complete or invisible, retention, and a run
whose driver was killed resumed at its row."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from tests._support.rows import record_rows, rows_by_epoch, writers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd._internal.storage.catalog import complete_checkpoints, newest_complete
from raysgd._internal.storage.format import MANIFEST_NAME
from raysgd._internal.storage.location import Storage, StorageError
from raysgd.utils import BATCH_SIZE

ROWS = 128
GLOBAL_BATCH = 16  # 8 steps an epoch
REPO = Path(__file__).resolve().parents[2]


class LinearOperator(TrainingOperator):
    """A deterministic regression (the same weights for the same rows in the same order)."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(ROWS, config.get("width", 4), generator=gen)
        y = x.sum(dim=1, keepdim=True)
        model = nn.Linear(x.shape[1], 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        ids = torch.arange(ROWS)
        loader = DataLoader(TensorDataset(x, y, ids), batch_size=config[BATCH_SIZE], shuffle=True)
        self.register_data(train_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        die_at = self.config.get("die_at")
        if self.world_rank == 0 and die_at is not None and batch_info["global_step"] == die_at:
            marker = Path(self.config["marker_dir"]) / "died"
            if not marker.exists():
                marker.touch()
                os._exit(1)  # the step after a checkpoint was staged: its upload is in flight
        metrics = super().train_batch((x, y), batch_info)
        record_rows(self.config.get("marker_dir"), batch_info["epoch_idx"] + 1, ids)
        return metrics


def _weights(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.get_model(to_cpu=True).parameters()]


@pytest.mark.timeout(240)
def test_save_and_load_a_sharded_state_through_an_s3_server(ray_local: None, s3_server) -> None:
    # A sharded state: every worker writes its part straight to the bucket; loaded on one worker
    # (onto more workers than wrote it: tests/raysgd/test_fsdp.py). A ddp state's save and load
    # through the server: the resumed trainer of the test after this one.
    # The periodic checkpoints are written from the in-memory snapshots' host copies, in the
    # background: the one at the epoch's last step (8) holds the same weights.
    prefix = uuid.uuid4().hex
    options = s3_server.storage_options
    periodic = Storage(s3_server.url(prefix, "periodic"), options)
    fsdp = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=2,
        config={BATCH_SIZE: GLOBAL_BATCH, "width": 8},
        strategy="fsdp",
        storage_options=options,
        checkpoint_dir=periodic.url,
        checkpoint_every=4,
    )
    try:
        fsdp.train()
        folder = s3_server.url(prefix, "fsdp")
        fsdp.save(folder)
        expected = _weights(fsdp)
    finally:
        fsdp.shutdown()
    parts = Storage(folder, options).listdir()
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "raysgd_state.pt", MANIFEST_NAME} <= set(
        parts
    )
    one = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=1,
        config={BATCH_SIZE: GLOBAL_BATCH, "width": 8},
        strategy="fsdp",
        storage_options=options,
    )
    try:
        one.load(folder)
        assert all(torch.allclose(a, b) for a, b in zip(expected, _weights(one)))
        assert one.epoch == 1
        assert [c.step for c in complete_checkpoints(periodic)] == [4, 8]
        newest = newest_complete(periodic)
        assert newest is not None and set(newest.location.listdir()) >= set(parts)
        one.load(newest.location.url)
        assert all(torch.allclose(a, b) for a, b in zip(expected, _weights(one)))
    finally:
        one.shutdown()


@pytest.mark.timeout(240)
def test_checkpoints_inside_an_epoch_survive_a_worker_lost_during_an_upload(
    ray_local: None, s3_server, tmp_path: Path
) -> None:
    options = s3_server.storage_options
    root = s3_server.url(uuid.uuid4().hex)
    trainer = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=2,
        # Wide enough that an upload to the server takes longer than the step after it.
        config={BATCH_SIZE: GLOBAL_BATCH, "width": 2048, "marker_dir": str(tmp_path), "die_at": 5},
        checkpoint_dir=root,
        storage_options=options,
        checkpoint_every=4,
        keep_checkpoints=2,
    )
    try:
        # Rank 0 writes the whole state; it dies in step 6, while its checkpoint of step 4 (of
        # this attempt) is still uploading. The group recovers from the survivor.
        trainer.train()
        trainer.train()
        assert (tmp_path / "died").exists() and trainer.failures == 1
    finally:
        trainer.shutdown()  # waits for the upload in flight
    location = Storage(root, options)
    complete = complete_checkpoints(location)
    # Retention: the two newest complete ones (steps 12 and 16 of the two epochs).
    assert [c.step for c in complete] == [12, 16]
    for checkpoint in complete:  # nothing mixed: every listed part there, nothing else
        assert set(checkpoint.location.listdir()) == {MANIFEST_NAME, "raysgd_checkpoint.pt"}
    # The interrupted attempt, if a trace of it is left, has no manifest: never loaded.
    folders = location.listdir()
    assert all(
        name in {c.name for c in complete} for name in folders if _has_manifest(location, name)
    )

    # A new trainer resumes from the newest complete one: at the end of the second epoch.
    again = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=2,
        config={BATCH_SIZE: GLOBAL_BATCH, "width": 2048},
        checkpoint_dir=root,
        storage_options=options,
        resume=True,
    )
    try:
        assert again.epoch == 2
        assert again.train()["epoch"] == 3
        # A ddp state saved to a URL on the server and loaded back from it.
        url = s3_server.url(uuid.uuid4().hex, "ddp.pt")
        assert again.save(url) == url
        saved = _weights(again)
        again.train()
        assert not all(map(torch.equal, saved, _weights(again)))
        again.load(url)
        assert all(map(torch.equal, saved, _weights(again)))
    finally:
        again.shutdown()


def _host_copy() -> Any:
    """On a worker, once its checkpoint thread is idle: where rank 0's host copy for periodic
    checkpoints lives and what it holds (None on the other ranks, which copy nothing)."""
    from raysgd._internal.worker.objects import this_worker, worker_state

    this_worker().uploads.finish()
    writers = sum(t.name == "raysgd-checkpoint" for t in threading.enumerate())
    staged = worker_state()._host_copy
    if staged is None:
        return None, writers
    return {k: (t.data_ptr(), t.clone()) for k, t in staged["models"][0].items()}, writers


@pytest.mark.timeout(120)
def test_checkpoints_copy_into_memory_mapped_ahead_and_share_one_writer(
    ray_local: None, tmp_path: Path
) -> None:
    trainer = TorchTrainer(
        training_operator_cls=LinearOperator,
        num_workers=2,
        config={BATCH_SIZE: GLOBAL_BATCH, "width": 512},
        checkpoint_dir=str(tmp_path),
        checkpoint_every=4,
    )
    try:
        # Two steps: no checkpoint is due yet, but rank 0 has its host copy's memory ready.
        trainer.train(num_steps=2)
        (ahead, _), (other, _) = trainer.apply_all_workers(_host_copy)
        assert other is None and not complete_checkpoints(Storage(str(tmp_path)))
        assert set(ahead) == {"weight", "bias"} and ahead["weight"][1].shape == (1, 512)
        # Step 4's checkpoint copied into that same memory, which holds step 4's weights.
        trainer.train(num_steps=2)
        (staged, _), _ = trainer.apply_all_workers(_host_copy)
        assert {k: ptr for k, (ptr, _) in staged.items()} == {k: p for k, (p, _) in ahead.items()}
        live = trainer.get_model(to_cpu=True).state_dict()
        assert all(torch.equal(staged[k][1], live[k]) for k in live)
        # Step 8's as well; one writer thread on each worker did all of it.
        trainer.train(num_steps=4)
        (again, writers), (_, other_writers) = trainer.apply_all_workers(_host_copy)
        assert [again[k][0] for k in live] == [ahead[k][0] for k in live]
        assert writers == other_writers == 1
    finally:
        trainer.shutdown()
    assert [c.step for c in complete_checkpoints(Storage(str(tmp_path)))] == [4, 8]


def _has_manifest(location: Storage, name: str) -> bool:
    return location.join(name).exists(MANIFEST_NAME)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_the_background_writer_gives_the_cpu_to_the_training_loop_first() -> None:
    from raysgd._internal.worker.periodic_checkpoints import WRITER_NICE, _behind_training

    seen: dict[str, int] = {}

    def writer() -> None:
        _behind_training()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    # The writer runs at the lowest priority; the thread that started it (the training loop's)
    # keeps its own.
    assert seen["writer"] == WRITER_NICE > before
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.timeout(60)
def test_a_storage_problem_fails_before_any_worker_starts(ray_local: None, s3_server) -> None:
    free = ray.available_resources().get("CPU", 0)
    # A URL whose client library is not installed names the extra that brings it (gcsfs is not
    # in the test environment).
    assert importlib.util.find_spec("gcsfs") is None
    with pytest.raises(ImportError, match=r"pip install 'raysgd\[gcs\]'"):
        TorchTrainer(
            training_operator_cls=LinearOperator,
            config={BATCH_SIZE: GLOBAL_BATCH},
            checkpoint_dir="gs://a-bucket/run",
        )
    # A location the credentials cannot reach: one line, without the secret.
    secret = "not-the-right-secret-" + uuid.uuid4().hex
    options = {
        "endpoint_url": s3_server.endpoint_url,
        "key": "someone-else",
        "secret": secret,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with pytest.raises(StorageError) as info:
        TorchTrainer(
            training_operator_cls=LinearOperator,
            config={BATCH_SIZE: GLOBAL_BATCH},
            checkpoint_dir="s3://no-such-bucket-here/run",
            storage_options=options,
        )
    message = str(info.value)
    assert "\n" not in message and secret not in message and "s3://no-such-bucket-here" in message
    with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
        TorchTrainer(
            training_operator_cls=LinearOperator,
            config={BATCH_SIZE: GLOBAL_BATCH},
            checkpoint_every=5,
        )
    assert ray.available_resources().get("CPU", 0) == free  # nothing was started


def _run_args(folder: Path, marks: Path) -> dict[str, Any]:
    """The trainer's arguments in every run of the killed-driver test (the killed driver's, in
    its own process, and the runs in the test's process)."""
    return dict(
        training_operator_cls=LinearOperator,
        num_workers=2,
        config={BATCH_SIZE: 16, "marker_dir": str(marks)},
        checkpoint_dir=str(folder),
        checkpoint_every=3,
        resume=True,
    )


#: A driver to kill: only a driver in its own process can be killed with SIGKILL.
DRIVER = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    import ray
    sys.path.insert(0, {repo!r})
    from raysgd import TorchTrainer
    from tests.raysgd.test_checkpoint_storage import _run_args

    folder, marks, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address=os.environ["RAYSGD_TEST_ADDRESS"], log_to_driver=False)
    trainer = TorchTrainer(**_run_args(Path(folder), Path(marks)))

    def die():  # SIGKILL this driver once kill_after rows of epoch 2 are recorded
        while True:
            rows = 0
            for name in os.listdir(marks):
                with open(os.path.join(marks, name)) as handle:
                    rows += handle.read().count("2:")
            if rows >= kill_after:
                os.kill(os.getpid(), 9)
            time.sleep(0.005)

    threading.Thread(target=die, daemon=True).start()
    for _ in range(trainer.epoch, 3):
        trainer.train()
    trainer.shutdown()
    """
)


def _all_exited(pids: set[int], timeout_s: float) -> bool:
    """Whether every process of `pids` is gone, waiting up to `timeout_s` for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = set()
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.add(pid)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.1)


def _kill_driver(folder: Path, marks: Path, kill_after: int) -> subprocess.CompletedProcess:
    """Run a driver with `_run_args` in its own process, killed once `kill_after` rows of its
    second epoch are recorded."""
    script = folder.parent / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO)))
    env = {**os.environ, "RAYSGD_TEST_ADDRESS": ray.get_runtime_context().gcs_address}
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(marks), str(kill_after)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=str(REPO),
    )


def _run_to_the_end(folder: Path, marks: Path) -> tuple[int, list[float]]:
    """A run with `_run_args` in this process, to the end of its third epoch: (the epoch it
    started at, its weights at the end)."""
    trainer = TorchTrainer(**_run_args(folder, marks))
    try:
        started_at = trainer.epoch
        for _ in range(started_at, 3):
            trainer.train()
        weights = [w for p in trainer.get_model().parameters() for w in p.flatten().tolist()]
    finally:
        trainer.shutdown()
    return started_at, weights


@pytest.mark.timeout(420)
def test_a_run_whose_driver_was_killed_goes_on_at_its_row(
    ray_local: None, tmp_path: Path, wait_for_cpus
) -> None:
    clean_marks, marks = tmp_path / "clean-rows", tmp_path / "rows"
    clean_marks.mkdir()
    marks.mkdir()
    _, clean_weights = _run_to_the_end(tmp_path / "clean", clean_marks)

    # The driver dies with SIGKILL in the middle of epoch 2 (after 5 of its 8 steps).
    free = ray.available_resources().get("CPU", 0)
    killed = _kill_driver(tmp_path / "ckpt", marks, 5 * GLOBAL_BATCH)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # Its workers go on for a moment (a step, an upload finishing) until Ray stops them: what
    # the next run finds is what they left.
    assert wait_for_cpus(free, timeout_s=60) >= free, "the killed driver's workers never stopped"
    # Ray frees their CPUs once it has told them to stop; a worker may still be finishing a step
    # (its rows) or an upload then: what they left is read once their processes are gone.
    assert _all_exited(writers(marks), timeout_s=60), "the killed driver's workers never exited"
    every, first_epoch = 3, ROWS // GLOBAL_BATCH  # the driver's checkpoint_every; 8 steps
    newest = newest_complete(Storage(tmp_path / "ckpt"))
    assert newest is not None and newest.epoch == 2 and newest.step > first_epoch
    # The steps the killed run finished: the workers may finish one or two after their driver
    # died, before Ray stops them.
    killed_rows = len(rows_by_epoch(marks)[2])
    killed_steps = first_epoch + math.ceil(killed_rows / GLOBAL_BATCH)
    # One upload in flight, and the next checkpoint waits for it: the newest complete one is
    # at most two intervals behind (exactly two when the workers were stopped while the next
    # checkpoint waited; one when no upload was in flight).
    assert killed_steps - newest.step <= 2 * every

    # Started again: it loads the newest complete checkpoint and goes on at the row after it.
    started_at, resumed_weights = _run_to_the_end(tmp_path / "ckpt", marks)
    assert started_at == 1  # one epoch finished; the second goes on
    rows = rows_by_epoch(marks)
    assert sorted(set(rows[2])) == list(range(ROWS))  # every row of the interrupted epoch
    # Exactly the steps after the checkpoint's step are trained again, no more.
    assert len(rows[2]) - ROWS == killed_rows - (newest.step - first_epoch) * GLOBAL_BATCH
    assert sorted(rows[3]) == list(range(ROWS))
    # A deterministic job: the same weights as the run that was never interrupted.
    assert resumed_weights == pytest.approx(clean_weights, abs=1e-6)
