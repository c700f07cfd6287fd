"""Experiment loggers (`TorchTrainer(loggers=...)`), read back from what the real libraries wrote.

One small trainer (2 workers, rank 0 in this process) runs once for the whole module with every
logger at once: train, validate, a train in which rank 1 really dies and is replaced, validate, a
train with profiling (new metrics: the CSV header widens), shutdown. Each test then reads one
logger's output: MLflow's file store through `MlflowClient`, W&B's offline run file with W&B's own
protobuf schema (the `read_wandb_run` fixture), TensorBoard's event file, the CSV files; plus a
logger that raises (dropped after one warning, training unharmed) and one that records the calls
in memory (steps, epochs, order). Every logger must carry the recovery's numbers (the resize's
`steps_redone`, its source) as the trainer recorded them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd._internal.driver.events import RecoveryLog
from raysgd._internal.driver.run_loggers import RunLoggers
from raysgd.loggers import (
    CSVLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    available_loggers,
    get_logger,
    register_logger,
)
from raysgd.utils import BATCH_SIZE

pytestmark = pytest.mark.timeout(60)

NUM_ROWS = 64
CONFIG = {BATCH_SIZE: 16, "lr": 0.05, "nested": {"depth": 2}}


class LinearOperator(TrainingOperator):
    """A linear regression; rank 1 exits in the middle of the call after `die` appears."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(NUM_ROWS, 4, generator=gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        loader = DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE])
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=config["lr"]),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=loader, validation_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        marker = Path(self.config["marker_dir"])
        if self.world_rank == 1 and batch_info["batch_idx"] == 1 and (marker / "die").exists():
            os.replace(marker / "die", marker / "died")  # once: the redone call must not die
            os._exit(1)
        return super().train_batch(batch, batch_info)


class RecordingLogger(Logger):
    """Keeps every call, in order."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, config, options):  # type: ignore[no-untyped-def]
        self.calls.append(("start", (dict(config), dict(options))))

    def log_metrics(self, kind, metrics, *, epoch, step):  # type: ignore[no-untyped-def]
        self.calls.append(("metrics", (kind, dict(metrics), epoch, step)))

    def log_event(self, event, *, step):  # type: ignore[no-untyped-def]
        self.calls.append(("event", (event.kind, step)))

    def finish(self):  # type: ignore[no-untyped-def]
        self.calls.append(("finish", None))


class FailingLogger(RecordingLogger):
    """Raises on its second result, as a tracker going down mid-run would."""

    def log_metrics(self, kind, metrics, *, epoch, step):  # type: ignore[no-untyped-def]
        super().log_metrics(kind, metrics, epoch=epoch, step=step)
        if len([c for c in self.calls if c[0] == "metrics"]) == 2:
            raise ConnectionError("tracker unreachable")

    def __repr__(self) -> str:
        return "FailingLogger()"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def run(ray_local_module: None, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The module's one training run, with every logger; what it returned and where it wrote."""
    tmp = tmp_path_factory.mktemp("loggers")
    (tmp / "markers").mkdir()
    recording, failing = RecordingLogger(), FailingLogger()
    mlflow_logger = MLflowLogger(tracking_uri=str(tmp / "mlruns"), experiment_name="loggers-test")
    wandb_logger = WandbLogger(
        project="loggers-test", dir=str(tmp / "wandb"), settings={"silent": True}
    )
    warnings = _Records()
    logging.getLogger("raysgd").addHandler(warnings)
    trainer = TorchTrainer(
        training_operator_cls=LinearOperator,
        config={**CONFIG, "marker_dir": str(tmp / "markers")},
        num_workers=2,
        num_cpus_per_worker=1,
        use_local=True,
        use_gpu=False,
        logdir=str(tmp / "tb"),
        loggers=[CSVLogger(tmp / "csv"), mlflow_logger, wandb_logger, recording, failing],
    )
    try:
        results = [("train", trainer.train()), ("validate", trainer.validate())]
        (tmp / "markers" / "die").touch()
        results.append(("train", trainer.train(max_retries=3)))
        assert (tmp / "markers" / "died").exists(), "rank 1 did not die: no recovery to log"
        results.append(("validate", trainer.validate()))
        results.append(("train", trainer.train(profile=True)))
        events = list(trainer.recovery_events)
    finally:
        trainer.shutdown()
        logging.getLogger("raysgd").removeHandler(warnings)
    return SimpleNamespace(
        tmp=tmp,
        results=results,
        events=events,
        recording=recording,
        failing=failing,
        warnings=warnings.messages,
        mlflow=mlflow_logger,
        wandb=wandb_logger,
    )


def _resize(run: SimpleNamespace) -> Any:
    """The recovery's resize event (rank 1's replacement joined), as the trainer recorded it."""
    resize = next(e for e in run.events if e.kind == "resize")
    assert isinstance(resize.steps_redone, int) and resize.source, resize
    return resize


def _expected(kind: str, result: dict[str, Any]) -> dict[str, float]:
    """The numbers of a result as the loggers get them: flattened, with num_workers."""
    flat: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{k}": float(v) for k, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return {**flat, "num_workers": 2.0}


@pytest.mark.timeout(120)
def test_every_result_reaches_the_loggers_with_its_step_and_epoch(run: SimpleNamespace) -> None:
    calls = run.recording.calls
    assert calls[0][0] == "start" and calls[-1] == ("finish", None)
    logged = [c[1] for c in calls if c[0] == "metrics"]
    metrics = [m for m in logged if m[0] != "goodput"]
    # After every call the trainer's goodput so far follows its result.
    goodputs = [m for m in logged if m[0] == "goodput"]
    assert [m[0] for m in logged] == [k for m in metrics for k in (m[0], "goodput")]
    assert all(0 < g[1]["goodput"] <= 1 and g[1]["wall_s"] > 0 for g in goodputs)
    assert goodputs[-1][1]["failures"] == 1 and "lost_s/start" in goodputs[-1][1]
    # step: train() calls so far; a validate() shares the step of the train() before it.
    assert [(kind, step) for kind, _, _, step in metrics] == [
        ("train", 1),
        ("validate", 1),
        ("train", 2),
        ("validate", 2),
        ("train", 3),
    ]
    assert [epoch for _, _, epoch, _ in metrics] == [1, 1, 2, 2, 3]
    for (kind, values, _, _), (want_kind, result) in zip(metrics, run.results):
        assert kind == want_kind and values == pytest.approx(_expected(kind, result))
    assert "profile/mean_fwd_s" in metrics[-1][1]  # nested results are flattened
    # The recovery happened in the second train(): its events come before that call's metrics.
    kinds = [c[1][0] for c in calls if c[0] == "event"]
    assert kinds == [e.kind for e in run.events]
    assert {"failure", "resize", "recovered"} <= set(kinds)
    second_train = calls.index(("metrics", metrics[2]))
    assert all(calls.index(c) < second_train and c[1][1] == 2 for c in calls if c[0] == "event")


def test_config_and_options_are_the_run_parameters(run: SimpleNamespace) -> None:
    config, options = run.recording.calls[0][1]
    assert config["lr"] == 0.05 and config["nested"] == {"depth": 2}
    assert options["num_workers"] == 2 and options["use_local"] is True
    assert options["failure_policy"] == "default" and options["backend"] == "gloo"
    assert options["strategy"] == "ddp" and options["accumulate_grad_batches"] == 1


def test_a_logger_that_raises_is_dropped_after_one_warning(run: SimpleNamespace) -> None:
    failing = [c[0] for c in run.failing.calls]
    # Called twice, raised on the second, finished once when dropped, never called again.
    assert failing.count("metrics") == 2 and failing.count("finish") == 1
    assert failing[-1] == "finish"
    about_it = [m for m in run.warnings if "FailingLogger" in m]
    assert len(about_it) == 1
    assert "dropped" in about_it[0] and "ConnectionError: tracker unreachable" in about_it[0]
    # No other logger failed: each kept recording to the end.
    assert [m for m in run.warnings if "experiment logger" in m] == about_it
    # Training went on, and the other loggers saw every call.
    assert len(run.results) == 5
    # (each result followed by the goodput so far)
    assert [c[0] for c in run.recording.calls].count("metrics") == 2 * 5


def test_mlflow_file_store_holds_metrics_params_and_events(run: SimpleNamespace) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=run.mlflow.resolved_tracking_uri())
    experiment = client.get_experiment_by_name("loggers-test")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == run.mlflow.run_id and found.info.status == "FINISHED"
    history = client.get_metric_history(run.mlflow.run_id, "train/train_loss")
    trains = [r for kind, r in run.results if kind == "train"]
    assert [(m.step, m.value) for m in history] == [
        (step, pytest.approx(r["train_loss"])) for step, r in enumerate(trains, start=1)
    ]
    workers = client.get_metric_history(run.mlflow.run_id, "validate/num_workers")
    assert [(m.step, m.value) for m in workers] == [(1, 2.0), (2, 2.0)]
    assert [m.step for m in client.get_metric_history(run.mlflow.run_id, "recovery/failure")] == [2]
    sizes = client.get_metric_history(run.mlflow.run_id, "recovery/num_workers")
    want = [float(e.num_workers_after) for e in run.events if e.num_workers_after is not None]
    assert [m.value for m in sizes] == want and want[:2] == [1.0, 2.0]  # loss, replacement
    params = found.data.params
    assert params["config/lr"] == "0.05" and params["config/nested/depth"] == "2"
    assert params["config/_batch_size"] == "16"  # "*batch_size": MLflow allows no "*"
    assert params["trainer/num_workers"] == "2" and params["trainer/use_local"] == "True"
    resize = _resize(run)
    redone = client.get_metric_history(run.mlflow.run_id, "recovery/resize_steps_redone")
    assert [(m.step, m.value) for m in redone] == [(2, float(resize.steps_redone))]
    local = client.download_artifacts(run.mlflow.run_id, "recovery_events.jsonl", str(run.tmp))
    lines = [json.loads(line) for line in Path(local).read_text().splitlines()]
    assert [e["kind"] for e in lines] == [e.kind for e in run.events]
    assert {e["step"] for e in lines} == {2}
    logged = next(e for e in lines if e["kind"] == "resize")
    assert (logged["steps_redone"], logged["source"]) == (resize.steps_redone, resize.source)
    assert json.loads(logged["phases"]) == pytest.approx(resize.phases)
    assert next(e for e in lines if e["kind"] == "failure")["preempted"] is False


def test_wandb_offline_run_holds_history_config_and_events(
    run: SimpleNamespace, read_wandb_run: Callable[[Path], list[Any]]
) -> None:
    (run_file,) = (run.tmp / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_wandb_run(run_file)
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert info.project == "loggers-test"
    config = {u.key: json.loads(u.value_json) for u in info.config.update}
    assert config["config/lr"] == 0.05 and config["trainer/num_workers"] == 2
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
            history[record.history.step.num] = row
    trains = [r for kind, r in run.results if kind == "train"]
    validates = [r for kind, r in run.results if kind == "validate"]
    assert sorted(history) == [1, 2, 3]
    for step, result in enumerate(trains, start=1):
        assert history[step]["train/train_loss"] == pytest.approx(result["train_loss"])
        assert history[step]["epoch"] == result["epoch"]
    for step, result in enumerate(validates, start=1):
        assert history[step]["validate/val_loss"] == pytest.approx(result["val_loss"])
    assert history[2]["recovery/failure"] == 1 and history[2]["recovery/num_workers"] == 2
    resize = _resize(run)
    assert history[2]["recovery/resize_steps_redone"] == resize.steps_redone
    assert history[2]["recovery/resize_num_workers_after"] == 2
    # Every event whole, message included, in the table logged with the last of them.
    table_file = run_file.parent / "files" / history[2]["recovery/events/path"]
    table = json.loads(table_file.read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["step"], r["kind"], r["message"]) for r in rows] == [
        (2, e.kind, e.message) for e in run.events
    ]
    logged = next(r for r in rows if r["kind"] == "resize")
    assert (logged["steps_redone"], logged["source"]) == (resize.steps_redone, resize.source)
    assert history[3]["train/num_workers"] == 2
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0  # finished, not failed


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TensorBoard event file in `logdir` (TFRecord framing: length, crc,
    event proto, crc)."""
    from tensorboardX.proto import event_pb2

    (path,) = logdir.glob("events.out.tfevents.*")
    scalars: dict[str, list[tuple[int, float]]] = {}
    data, offset = path.read_bytes(), 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_logdir_is_a_tensorboard_logger(run: SimpleNamespace) -> None:
    scalars = read_scalars(run.tmp / "tb")
    trains = [r for kind, r in run.results if kind == "train"]
    assert [step for step, _ in scalars["train/train_loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/train_loss"]] == pytest.approx(
        [r["train_loss"] for r in trains]
    )
    assert [step for step, _ in scalars["validate/val_loss"]] == [1, 2]
    assert [step for step, _ in scalars["train/profile/mean_fwd_s"]] == [3]
    assert [v for _, v in scalars["train/samples_per_s"]] == pytest.approx(
        [r["samples_per_s"] for r in trains]
    )
    # The worker count through the recovery: 1 survivor after the loss, 2 again after it.
    sizes = [(2, float(e.num_workers_after)) for e in run.events if e.num_workers_after is not None]
    assert scalars["recovery/num_workers"] == sizes and sizes[0] == (2, 1.0)
    assert scalars["recovery/resize_steps_redone"] == [(2, float(_resize(run).steps_redone))]


def test_csv_files_one_per_kind_with_a_widening_header(run: SimpleNamespace) -> None:
    import csv

    def rows(name: str) -> list[dict[str, str]]:
        with open(run.tmp / "csv" / f"{name}.csv", newline="") as f:
            return list(csv.DictReader(f))

    train = rows("train")
    trains = [r for kind, r in run.results if kind == "train"]
    assert [int(r["step"]) for r in train] == [1, 2, 3]
    assert [float(r["train_loss"]) for r in train] == pytest.approx(
        [r["train_loss"] for r in trains]
    )
    assert [r["num_workers"] for r in train] == ["2.0"] * 3
    # The throughput of every call, the one a lost worker interrupted included: the call's rows
    # over the loop time of the steps it kept.
    assert [float(r["samples_per_s"]) for r in train] == pytest.approx(
        [r["samples_per_s"] for r in trains]
    )
    for row in train:
        assert float(row["samples_per_s"]) == pytest.approx(
            float(row["num_samples"]) / float(row["loop_s"])
        )
        assert float(row["samples_per_s"]) > 0
    # The profile columns came with the third call: the header widened, earlier rows are empty.
    assert [r["profile/mean_fwd_s"] for r in train[:2]] == ["", ""]
    assert float(train[2]["profile/mean_fwd_s"]) > 0
    assert [r["step"] for r in rows("validate")] == ["1", "2"]
    events = rows("events")
    assert [e["kind"] for e in events] == [e.kind for e in run.events]
    resize = next(e for e in events if e["kind"] == "resize")
    assert (resize["step"], resize["num_workers_after"]) == ("2", "2")
    recorded = _resize(run)
    assert (resize["steps_redone"], resize["source"]) == (
        str(recorded.steps_redone),
        recorded.source,
    )
    assert [e["preempted"] for e in events if e["kind"] == "failure"] == ["False"]
    params = {r["name"]: r["value"] for r in rows("params")}
    assert params["config/lr"] == "0.05" and params["trainer/num_workers"] == "2"


def test_names_build_the_built_in_and_registered_loggers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raysgd.loggers import registry

    monkeypatch.setattr(registry, "_registry", registry._registry.copy())
    assert set(available_loggers()) >= {"csv", "mlflow", "tensorboard", "wandb"}
    assert isinstance(get_logger("CSV", directory=str(tmp_path)), CSVLogger)
    assert isinstance(get_logger("tensorboard"), TensorBoardLogger)
    register_logger("Recording", RecordingLogger)
    assert "recording" in available_loggers()
    assert isinstance(get_logger("recording"), RecordingLogger)
    with pytest.raises(ValueError, match="already registered"):
        register_logger("recording", RecordingLogger)
    register_logger("bad", lambda: object())
    with pytest.raises(TypeError, match="not a Logger"):
        get_logger("bad")
    with pytest.raises(ValueError, match=r"unknown experiment logger 'neptune'.*'csv'"):
        get_logger("neptune")
    with pytest.raises(TypeError, match="cannot be applied"):
        get_logger(CSVLogger(tmp_path), directory="x")
    with pytest.raises(ValueError, match="mode"):
        WandbLogger(mode="sometimes")


def test_a_logger_failing_to_start_fails_the_trainer_before_any_worker(
    ray_local: None, tmp_path: Path
) -> None:
    class Unreachable(RecordingLogger):
        def start(self, config, options):  # type: ignore[no-untyped-def]
            raise ConnectionError("no tracker at that address")

    first = RecordingLogger()
    with pytest.raises(ConnectionError, match="no tracker"):
        TorchTrainer(
            training_operator_cls=LinearOperator,
            config={**CONFIG, "marker_dir": str(tmp_path)},
            loggers=[first, Unreachable()],
        )
    assert [c[0] for c in first.calls] == ["start", "finish"]  # the started one is finished
    with pytest.raises(TypeError, match="list of logger names"):
        TorchTrainer(training_operator_cls=LinearOperator, config=CONFIG, loggers="csv")
    with pytest.raises(ValueError, match="unknown experiment logger"):
        TorchTrainer(training_operator_cls=LinearOperator, config=CONFIG, loggers=["nope"])


def test_a_construction_failure_after_the_loggers_started_marks_their_runs_failed(
    ray_local: None, tmp_path: Path
) -> None:
    """A model creator that cannot be shipped to the workers (it holds a lock) fails the
    trainer's construction after the loggers started: their runs end, marked failed."""
    from mlflow import MlflowClient

    lock = threading.Lock()

    def model_creator(config: dict[str, Any]) -> nn.Module:
        with lock:
            return nn.Linear(4, 1)

    recording = RecordingLogger()
    mlflow_logger = MLflowLogger(tracking_uri=str(tmp_path / "mlruns"))
    with pytest.raises(TypeError, match="lock"):
        TorchTrainer(
            model_creator=model_creator,
            data_creator=lambda config: None,
            optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
            loss_creator=nn.MSELoss,
            config=CONFIG,
            use_gpu=False,
            loggers=[recording, mlflow_logger],
        )
    assert [c[0] for c in recording.calls] == ["start", "finish"]
    run = MlflowClient(tracking_uri=mlflow_logger.resolved_tracking_uri()).get_run(
        mlflow_logger.run_id
    )
    assert run.info.status == "FAILED" and run.info.end_time is not None


def test_a_logger_published_under_the_entry_point_group_is_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution laid out as pip installs one (a module and its dist-info declaring
    ``[raysgd.logger]``) on sys.path: its logger is listed without being imported, and a name
    builds it with keyword arguments, as ``loggers=["neptune"]`` does."""
    (tmp_path / "raysgd_logger_plugin.py").write_text(
        textwrap.dedent(
            """
            from raysgd.loggers import Logger

            class NeptuneLogger(Logger):
                def __init__(self, project="default"):
                    self.project = project

                def log_metrics(self, kind, metrics, *, epoch, step):
                    pass
            """
        )
    )
    info = tmp_path / "raysgd_logger_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: raysgd_logger_plugin\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[raysgd.logger]\nNeptune = raysgd_logger_plugin:NeptuneLogger\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "raysgd_logger_plugin", raising=False)
    assert "neptune" in available_loggers()
    assert "raysgd_logger_plugin" not in sys.modules  # listing names imports nothing
    built = get_logger("NEPTUNE", project="demo")
    assert type(built).__name__ == "NeptuneLogger" and built.project == "demo"


def test_a_loss_found_to_be_a_preemption_reaches_the_loggers_as_one() -> None:
    """The loggers observe the recovery log: an event waits for its call's result, and a loss
    Ray reports preempted before that result is passed on amended (no Ray: the log alone)."""
    log, recording = RecoveryLog(), RecordingLogger()
    run = RunLoggers([recording])
    log.subscribe(run.take, amended=run.amend)
    events: list[Any] = []
    recording.log_event = lambda event, *, step: events.append((event, step))  # type: ignore[method-assign]
    log.record("failure", "lost rank 1", ranks=(1,), nodes=("node-a",))
    log.mark_preempted({"node-a"})
    assert events == []  # nothing before the call's result
    run.log("train", {"loss": 1.0}, num_workers=2)
    ((event, step),) = events
    assert event.kind == "failure" and event.preempted and step == 1
    log.record("resize", "resized 1 -> 2")
    run.finish()  # what is left goes out at the end, with the last step
    assert [(e.kind, s) for e, s in events[1:]] == [("resize", 1)]


@pytest.mark.timeout(90)
def test_a_missing_library_fails_at_construction_with_the_install_hint() -> None:
    """In a fresh process where mlflow, wandb and tensorboardX cannot be imported: `import
    raysgd` and `raysgd.loggers` work, building their loggers raises ImportError with the hint."""
    code = textwrap.dedent(
        """
        import sys
        for name in ("mlflow", "wandb", "tensorboardX"):
            sys.modules[name] = None  # `import name` now raises ImportError
        import raysgd
        from raysgd.loggers import MLflowLogger, TensorBoardLogger, WandbLogger
        for cls in (MLflowLogger, WandbLogger, TensorBoardLogger):
            try:
                cls()
            except ImportError as exc:
                print(cls.__name__, "|", exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=80, check=True
    ).stdout.splitlines()
    assert out == [
        "MLflowLogger | MLflowLogger needs MLflow, which is not installed: "
        "pip install 'raysgd[mlflow]'",
        "WandbLogger | WandbLogger needs wandb, which is not installed: "
        "pip install 'raysgd[wandb]'",
        "TensorBoardLogger | TensorBoardLogger (and logdir=) writes with tensorboardX, which is "
        "not installed: pip install 'raysgd[tensorboard]'",
    ]
