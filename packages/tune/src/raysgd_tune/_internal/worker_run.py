"""The worker side of `DistributedTrainableCreator`: run the user's function, forward rank 0's reports.

`ray.tune.report` and `ray.tune.get_checkpoint` need a Tune session; in an actor that Tune did not
start there is none, so they only warn and drop the metrics. While the user's function runs a small
stand-in session is installed (`ray_session.installed_session`): rank 0's reports are queued for the
trial process (which polls them and calls the real `tune.report`), other ranks' reports are dropped,
and `get_checkpoint()` returns the trial's restored checkpoint.

The function runs in a background thread so that the worker actor stays free to answer the trial's
polls: the trial asks rank 0 for reports (the call returns as soon as one is queued), relays them, then
checks every rank for errors; a report is never lost with a failing peer's call.
"""

from __future__ import annotations

import io
import logging
import shutil
import tarfile
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch.distributed as dist

from raysgd_core import scratch_dir
from raysgd_tune._internal.ray_session import TrialInfo, installed_session

__all__ = [
    "Report",
    "WorkerRun",
    "current_run",
    "poll_run",
    "start_run",
]

logger = logging.getLogger(__name__)


@dataclass
class Report:
    """One `tune.report` call of rank 0, on its way to the trial."""

    metrics: dict[str, Any]
    checkpoint_path: str | None = None
    # True: a `distributed_checkpoint_dir` folder that the trial deletes once Tune has persisted it.
    owned: bool = False
    # Set instead of `checkpoint_path` when rank 0 is on another node than the trial process.
    archive: bytes | None = None
    # A user's `tune.Checkpoint` on remote storage (S3, GCS, ...): passed on as it is.
    remote_checkpoint: Any = None


@dataclass
class PollResult:
    """What one poll of one rank returns to the trial."""

    reports: list[Report] = field(default_factory=list)
    done: bool = False


class _ForwardingSession:
    """Stands in for Tune's session inside the user's function on a worker (see module docstring).

    Only what `ray.tune.report`, `ray.tune.get_checkpoint` and `ray.tune.get_context` read is here.
    """

    def __init__(self, run: WorkerRun, trial_info: TrialInfo | None, checkpoint: Any) -> None:
        self._run = run
        self.trial_info = trial_info or TrialInfo()
        self.loaded_checkpoint = checkpoint
        self.world_rank = run.rank
        self.world_size = run.world_size
        self.local_rank = run.local_rank
        self.local_world_size = run.local_world_size
        self.node_rank = None

    # What `ray.tune.get_context()` reads (the trial process's TrialInfo, copied here).
    @property
    def experiment_name(self) -> str | None:
        return self.trial_info.experiment_name

    @property
    def trial_name(self) -> str | None:
        return self.trial_info.trial_name

    @property
    def trial_id(self) -> str | None:
        return self.trial_info.trial_id

    @property
    def trial_resources(self) -> Any:
        return self.trial_info.trial_resources

    @property
    def trial_dir(self) -> str | None:
        return self.trial_info.trial_dir

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, **_: Any) -> None:
        self._run.report(metrics, checkpoint)


class WorkerRun:
    """One run of the user's function on one worker."""

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        # Rank 0's reports not yet taken by the trial. Rank 0 may run at most one report ahead
        # of the trial (a bounded lag, as Tune's own function API blocks in `report`).
        self._reports: deque[Report] = deque()
        self._cond = threading.Condition()
        self.pending_checkpoint: str | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.thread: threading.Thread | None = None

    # -- inside the user's function ---------------------------------------------------------
    def report(self, metrics: dict[str, Any], checkpoint: Any) -> None:
        if self.rank != 0:
            return  # as in Ray Train: only rank 0's metrics are tracked
        report = Report(metrics=dict(metrics))
        if checkpoint is not None:
            # A checkpoint the user made: a folder of his (kept), or a place on remote storage.
            if getattr(checkpoint.filesystem, "type_name", "local") == "local":
                report.checkpoint_path = checkpoint.path
            else:
                report.remote_checkpoint = checkpoint
        elif self.pending_checkpoint is not None:
            report.checkpoint_path, report.owned = self.pending_checkpoint, True
            self.pending_checkpoint = None
        with self._cond:
            self._cond.wait_for(lambda: not self._reports)
            self._reports.append(report)
            self._cond.notify_all()

    def keep_checkpoint(self, path: str) -> None:
        """Attach `path` to the next report (rank 0); an older unreported one is superseded."""
        if self.pending_checkpoint is not None:
            shutil.rmtree(self.pending_checkpoint, ignore_errors=True)
        self.pending_checkpoint = path

    # -- the function thread ------------------------------------------------------------------
    def main(
        self,
        func: Callable[..., Any],
        config: dict[str, Any],
        checkpoint: Any,
        trial_info: TrialInfo | None,
    ) -> None:
        global _CURRENT
        restore_dir = None
        try:
            if checkpoint is not None:
                # Each worker gets its own copy, on its own node (the storage may be remote).
                restore_dir = checkpoint.to_directory(
                    tempfile.mkdtemp(prefix="restore_", dir=scratch_dir())
                )
            with installed_session(_ForwardingSession(self, trial_info, checkpoint)):
                _CURRENT = self
                func(config, checkpoint_dir=restore_dir)
        except BaseException as exc:  # reported to the trial by the next poll
            self.error = exc
        finally:
            _CURRENT = None
            if restore_dir is not None:
                shutil.rmtree(restore_dir, ignore_errors=True)
            if self.pending_checkpoint is not None:
                logger.warning(
                    "A checkpoint written in distributed_checkpoint_dir() was never followed by "
                    "tune.report(); it is discarded. Report after checkpointing to keep it."
                )
                shutil.rmtree(self.pending_checkpoint, ignore_errors=True)
                self.pending_checkpoint = None
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    # -- polled by the trial ------------------------------------------------------------------
    def poll(self, timeout_s: float, trial_node_id: str, take: bool) -> PollResult:
        """`take` (rank 0): wait up to `timeout_s` for a report, return all queued ones. Without
        `take`, only raise the function's error or say whether it is done (a health check that
        never consumes a report, so a report cannot be lost with a failing peer's call)."""
        with self._cond:
            if take:
                self._cond.wait_for(lambda: self._reports or self.finished, timeout_s)
                taken = list(self._reports)
                self._reports.clear()
                self._cond.notify_all()
            else:
                taken = []
            done = self.finished and not self._reports and self.error is None
        if self.error is not None and not taken:
            if isinstance(self.error, Exception):
                raise self.error
            # SystemExit or KeyboardInterrupt raised here would end the worker actor itself and
            # hide what happened; report it as an error of the function instead.
            raise RuntimeError(f"the function exited with {self.error!r}") from self.error
        return PollResult(reports=[_portable(r, trial_node_id) for r in taken], done=done)


def _portable(report: Report, trial_node_id: str) -> Report:
    """Pack the checkpoint folder into bytes when the trial cannot read it from this node's disk."""
    if report.checkpoint_path is None or ray.get_runtime_context().get_node_id() == trial_node_id:
        return report
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(report.checkpoint_path, arcname=".")
    if report.owned:
        shutil.rmtree(report.checkpoint_path, ignore_errors=True)
    return Report(metrics=report.metrics, archive=buffer.getvalue())


_CURRENT: WorkerRun | None = None  # the run whose function is executing in this process
_LAST: WorkerRun | None = None  # the run the trial polls (it outlives the function thread)


def current_run() -> WorkerRun | None:
    """The run of the user's function executing in this process, if any."""
    return _CURRENT


def _rank_info() -> tuple[int, int, int, int]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        from raysgd_core import get_context

        ctx = get_context()
        return rank, world, ctx.local_rank, ctx.local_world_size
    except Exception:  # local ranks are informational only
        return rank, world, 0, 1


def start_run(
    func: Callable[..., Any], config: dict[str, Any], checkpoint: Any, trial_info: TrialInfo | None
) -> None:
    """Run on every worker: start `func(config, checkpoint_dir=...)` in a background thread."""
    global _LAST
    if _LAST is not None and not _LAST.finished:
        raise RuntimeError("a distributed trainable function is already running on this worker")
    run = WorkerRun(*_rank_info())
    run.thread = threading.Thread(
        target=run.main,
        args=(func, config, checkpoint, trial_info),
        name="raysgd-tune-function",
        daemon=True,
    )
    _LAST = run
    run.thread.start()


def poll_run(timeout_s: float, trial_node_id: str, take: bool) -> PollResult:
    """Run on a worker by the trial: with `take` (rank 0), its queued reports (waiting up to
    `timeout_s` for one); on every rank, the function's exception is raised and `done` says
    whether it has returned."""
    if _LAST is None:
        raise RuntimeError("poll_run() before start_run() on this worker")
    return _LAST.poll(timeout_s, trial_node_id, take)
