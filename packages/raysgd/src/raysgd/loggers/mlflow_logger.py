"""MLflow: one MLflow run per trainer, through `mlflow.MlflowClient` (no global active run, so
several trainers, or Tune trials, in one process never write into each other's runs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from raysgd.loggers.logger import (
    Logger,
    TuneTrial,
    current_trial,
    event_fields,
    event_metrics,
    flatten_params,
)

__all__ = ["MLflowLogger"]

INSTALL_HINT = "pip install 'raysgd[mlflow]'"
#: The experiment a run goes to outside Tune when none is named.
DEFAULT_EXPERIMENT = "raysgd"
#: The artifact holding the run's recovery events, one JSON object a line.
EVENTS_ARTIFACT = "recovery_events.jsonl"
#: The tag that marks the parent run of a Tune experiment's trials; its value is the experiment.
PARENT_TAG = "raysgd.tune.experiment_run"
#: MLflow's tag that nests a run under another.
PARENT_RUN_TAG = "mlflow.parentRunId"

# MLflow's own limits on one `log_batch` call and on a parameter's value.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_PARAM_VALUE_CHARS = 6000


def _key(name: str) -> str:
    """`name` as MLflow accepts it: letters, digits, ``_ - . : / space``; no empty path parts."""
    key = re.sub(r"[^\w\-. :/]", "_", name)
    return re.sub(r"/+", "/", key).strip("/") or "_"


class MLflowLogger(Logger):
    """Metrics ``train/<metric>`` and ``validate/<metric>`` at each call's step, the config
    (``config/<key>``) and the trainer's options (``trainer/<option>``) as parameters, recovery
    events as metrics (``recovery/<kind>``: how many of that kind so far; ``recovery/num_workers``
    when the group's size changed; the event's numbers, `event_metrics`:
    ``recovery/resize_steps_redone``, ...) and whole, every field, as the artifact
    ``recovery_events.jsonl``. `finish` marks the run FINISHED, or FAILED when it ends by a
    failure (`finish` with status "failed": the trainer's construction failed after the run started, ...).

    In a Ray Tune trial the run is nested (MLflow's ``mlflow.parentRunId``) under one parent run
    per Tune experiment, named after it and tagged ``raysgd.tune.experiment_run``: the first trial
    to start creates it, the others find it by that tag. In a local store (a directory or
    ``sqlite:///`` file) a lock file makes that safe between trials starting at once; with a
    tracking server no lock is shared, so two trials starting at the same moment may each create
    one: each then keeps the earliest created and deletes its own, and only trials whose start
    overlaps to the millisecond can still end up under two parents. Each trial marks the parent
    FINISHED when it finishes, so it ends with the last trial.

    Args:
        tracking_uri: Where runs go: an MLflow server (``http://host:5000``), a database
            (``sqlite:///mlflow.db``, needs the full ``mlflow`` package) or a directory. Default:
            ``MLFLOW_TRACKING_URI`` when set, else the local file store ``./mlruns`` (no server
            needed; ``mlflow ui --backend-store-uri ./mlruns`` shows it). MLflow 3 keeps its file
            store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``: for a
            file store this logger sets that variable in this process (when it is unset).
        experiment_name: The MLflow experiment (created when missing). Default: ``"raysgd"``; in a
            Ray Tune trial, the Tune experiment's name (`TuneTrial.group`), so that the trials of
            one Tune run are the runs of one MLflow experiment.
        run_name: The run's name. Default: MLflow's; in a Tune trial, the trial's name. Each
            Tune trial's run is also tagged ``raysgd.tune.trial_id``, ``raysgd.tune.trial_name``
            and ``raysgd.tune.group``.
        tags: More tags for the run.

    Raises:
        ImportError: MLflow is not installed (``pip install 'raysgd[mlflow]'``, which installs
            ``mlflow-skinny``; the full ``mlflow`` works too).
    """

    name = "mlflow"

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: Optional[str] = None,
        run_name: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
    ) -> None:
        for arg, value in (
            ("tracking_uri", tracking_uri),
            ("experiment_name", experiment_name),
            ("run_name", run_name),
        ):
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{arg} must be a non-empty str or None, got {value!r}")
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ImportError(
                f"MLflowLogger needs MLflow, which is not installed: {INSTALL_HINT}"
            ) from None
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: Optional[str] = None
        #: In a Tune trial, the run of the Tune experiment this run is nested under.
        self.parent_run_id: Optional[str] = None
        self._client: Any = None
        self._event_counts: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []

    def resolved_tracking_uri(self) -> str:
        """The tracking URI the run goes to (see `tracking_uri`)."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            return "file:" + os.path.abspath("mlruns")
        if "://" not in uri and not uri.startswith(("file:", "sqlite:", "databricks")):
            return "file:" + os.path.abspath(uri)  # a plain directory
        return uri

    def start(self, config: Mapping[str, Any], options: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient

        uri = self.resolved_tracking_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        trial = current_trial()
        tags = dict(self.tags)
        run_name = self.run_name
        experiment = self.experiment_name
        if trial is not None:
            tags.update(
                {
                    "raysgd.tune.trial_id": trial.trial_id,
                    "raysgd.tune.trial_name": trial.trial_name,
                    "raysgd.tune.group": trial.group,
                }
            )
            run_name = run_name or trial.trial_name
            experiment = experiment or trial.group
        experiment_id = self._experiment_id(experiment or DEFAULT_EXPERIMENT)
        self.parent_run_id = None
        if trial is not None:
            self.parent_run_id = self._parent_run(experiment_id, trial)
            tags[PARENT_RUN_TAG] = self.parent_run_id
        run = self._client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        self._event_counts, self._events = {}, []
        self._log_params(flatten_params({"config": dict(config), "trainer": dict(options)}))

    @contextlib.contextmanager
    def _store_lock(self) -> Iterator[bool]:
        """Held while finding or creating what concurrent Tune trials share (the experiment, the
        parent run); yields whether it locks anything. A store checks that a name is free and
        then creates it, so two processes starting at once could both create one: for a local
        store (a directory or an SQLite file) a lock file beside it lets one create it and the
        other find it. A tracking server is reached from many machines: nothing to lock."""
        from filelock import FileLock

        uri = self.resolved_tracking_uri()
        if uri.startswith("file:"):
            root = uri[len("file:") :]
        elif uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
            root = os.path.dirname(os.path.abspath(uri[len("sqlite:///") :]))
        else:
            yield False
            return
        os.makedirs(root, exist_ok=True)
        with FileLock(os.path.join(root, ".raysgd-experiments.lock")):
            yield True

    def _experiment_id(self, name: str) -> str:
        with self._store_lock():
            return self._get_or_create(name)

    def _parent_run(self, experiment_id: str, trial: TuneTrial) -> str:
        """The id of the Tune experiment's parent run in `experiment_id`, created when missing."""
        with self._store_lock() as locked:
            found = self._parent_runs(experiment_id, trial.group)
            if found:
                return found[0]
            created = self._client.create_run(
                experiment_id,
                run_name=trial.group,
                tags={PARENT_TAG: trial.group, "raysgd.tune.group": trial.group},
            ).info.run_id
        if locked:
            return str(created)
        # Unlocked (a server), another trial may have created one meanwhile: every trial keeps
        # the earliest created, and a later one of its own is deleted.
        earliest = self._parent_runs(experiment_id, trial.group)[0]
        if earliest != created:
            self._client.delete_run(created)
        return earliest

    def _parent_runs(self, experiment_id: str, group: str) -> list[str]:
        # Filtered by the marker tag's presence here, by its value below: a Tune experiment's
        # name may hold quotes, which MLflow's filter grammar cannot escape.
        runs = self._client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` != ''",
            order_by=["attributes.start_time ASC"],
        )
        found = [r for r in runs if r.data.tags.get(PARENT_TAG) == group]
        found.sort(key=lambda r: (r.info.start_time, r.info.run_id))
        return [str(r.info.run_id) for r in found]

    def _get_or_create(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(name))
        except MlflowException:
            # Another trial (another process) created it in between: use theirs.
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        entries = [
            Param(_key(key), str(value)[:_PARAM_VALUE_CHARS]) for key, value in params.items()
        ]
        for i in range(0, len(entries), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=entries[i : i + _PARAMS_PER_BATCH])

    def _log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(_key(key), float(v), now, step) for key, v in values.items()]
        for i in range(0, len(entries), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=entries[i : i + _METRICS_PER_BATCH])

    def log_metrics(
        self, kind: str, metrics: Mapping[str, float], *, epoch: int, step: int
    ) -> None:
        self._log({f"{kind}/{key}": value for key, value in metrics.items()}, step)

    def log_event(self, event: Any, *, step: int) -> None:
        kind = str(event.kind)
        self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
        values = {f"recovery/{kind}": float(self._event_counts[kind]), **event_metrics(event)}
        after = getattr(event, "num_workers_after", None)
        if after is not None:
            values["recovery/num_workers"] = float(after)
        self._log(values, step)
        self._events.append({"step": step, **event_fields(event)})
        # The whole list each time: an artifact is a file, and the events are few.
        text = "\n".join(json.dumps(e, default=str) for e in self._events) + "\n"
        self._client.log_text(self.run_id, text, EVENTS_ARTIFACT)

    def finish(self, status: str = "success") -> None:
        if self._client is not None and self.run_id is not None:
            client, self._client = self._client, None
            client.set_terminated(self.run_id, "FAILED" if status == "failed" else "FINISHED")
            if self.parent_run_id is not None:
                # The parent has no end of its own: it ends with the last of its trials.
                client.set_terminated(self.parent_run_id, "FINISHED")

    def __repr__(self) -> str:
        return (
            f"MLflowLogger(tracking_uri={self.tracking_uri!r}, "
            f"experiment_name={self.experiment_name!r}, run_name={self.run_name!r})"
        )
