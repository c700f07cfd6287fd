"""`DistributedTrainableCreator`: a plain Tune function, run data-parallel on several workers per trial.

Each trial starts a `raysgd_core.WorkerGroup` inside its own placement group, with the
`torch.distributed` process group ready, and runs `func(config, checkpoint_dir=None)` on every worker.
Inside `func` the calls a Tune function makes work unchanged: `ray.tune.report(...)` from rank 0 reaches
Tune (other ranks' reports are dropped, as in Ray Train), `ray.tune.get_checkpoint()` gives the trial's
restored checkpoint, and `distributed_checkpoint_dir(step)` gives rank 0 a folder that is attached to
its next report. The trial process itself only relays: it polls rank 0 for reports and calls the real
`tune.report`, so Tune's schedulers (PBT included), stoppers and `FailureConfig` see an ordinary
function trainable.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import shutil
import tarfile
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import tune

from raysgd_base import check_int
from raysgd_core import GroupOptions, resolve_use_gpu, scratch_dir, ship_by_value
from raysgd_tune._internal import worker_run
from raysgd_tune._internal.ray_session import trial_info as current_trial_info
from raysgd_tune._internal.resources import worker_bundles_request

__all__ = [
    "DistributedTrainableCreator",
    "distributed_checkpoint_dir",
    "is_distributed_trainable",
]

logger = logging.getLogger(__name__)

# How long one poll waits for rank 0's next report: it bounds how late a failure on another rank is
# noticed, not how late a report arrives (a poll returns as soon as one is queued).
_POLL_S = 1.0


def is_distributed_trainable() -> bool:
    """True inside a function run by a `DistributedTrainableCreator` trainable (on every worker)."""
    return worker_run.current_run() is not None


@contextlib.contextmanager
def distributed_checkpoint_dir(step: int, disable: bool = False) -> Iterator[str]:
    """A folder to write a checkpoint into, once per trial rather than once per worker.

    On rank 0 of a distributed trainable the folder is kept and attached, as a `ray.tune.Checkpoint`,
    to rank 0's next `ray.tune.report` (Tune then copies it to the trial's storage and deletes the
    folder). On the other ranks, with `disable=True`, or outside a distributed trainable, it is a
    throw-away temporary folder, removed when the block exits, so every rank can run the same code.
    `step` names the folder (for logs); Tune numbers the stored checkpoints itself.
    """
    run = worker_run.current_run()
    keep = run is not None and run.rank == 0 and not disable
    # In this worker's scratch folder: a folder left by a worker killed before it reported (a
    # trial stopped by its scheduler) is removed once that process is gone.
    path = tempfile.mkdtemp(
        prefix=f"checkpoint_{step}_", dir=scratch_dir() if run is not None else None
    )
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    if keep:
        assert run is not None
        run.keep_checkpoint(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class _Spec:
    func: Callable[..., Any]
    num_workers: int
    group: GroupOptions


def _check_signature(func: Callable[..., Any]) -> None:
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r}")
    try:
        inspect.signature(func).bind({}, checkpoint_dir=None)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            "func must have the signature func(config, checkpoint_dir=None): "
            f"{getattr(func, '__name__', func)!r} cannot be called that way ({exc})"
        ) from None


def _report_to_tune(report: worker_run.Report) -> None:
    """Hand one of rank 0's reports to the trial's real Tune session."""
    if report.archive is None and report.checkpoint_path is None:
        tune.report(report.metrics, checkpoint=report.remote_checkpoint)
        return
    path, owned = report.checkpoint_path, report.owned
    if report.archive is not None:  # rank 0 is on another node: unpack its folder here
        path, owned = tempfile.mkdtemp(prefix="raysgd_checkpoint_"), True
        with tarfile.open(fileobj=io.BytesIO(report.archive)) as tar:
            # The archive comes from our own worker; the "data" filter still refuses odd paths.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(path, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tar.extractall(path)
    try:
        # `tune.report` copies the folder to the trial's storage before it returns.
        tune.report(report.metrics, checkpoint=tune.Checkpoint.from_directory(path))
    finally:
        if owned:
            shutil.rmtree(path, ignore_errors=True)


def _run_trial(spec: _Spec, config: dict[str, Any]) -> None:
    """The trial's Tune function: start the workers, run `func` on them, relay rank 0's reports."""
    from raysgd_core import WorkerGroup

    checkpoint = tune.get_checkpoint()
    trial_info = current_trial_info()
    node_id = ray.get_runtime_context().get_node_id()
    group = WorkerGroup(spec.num_workers, spec.group)
    group.start()
    try:
        group.execute(worker_run.start_run, spec.func, config, checkpoint, trial_info)
        while True:
            # Rank 0's reports first, on their own: relayed even when another rank has failed.
            taken = group.execute_single(0, worker_run.poll_run, _POLL_S, node_id, True)
            for report in taken.reports:
                _report_to_tune(report)
            # Then every rank: raises the first error of any of them, or says all are done.
            polls = group.execute(worker_run.poll_run, 0.0, node_id, False)
            if all(p.done for p in polls):
                break
    except BaseException:
        # A worker's error, a lost worker, or Tune stopping the trial (its `tune.report` then
        # raises SystemExit): the workers may be stuck in a collective, so they are killed at once
        # instead of being asked to leave the process group.
        group.shutdown(force=True)
        raise
    group.shutdown()


def DistributedTrainableCreator(  # RaySGD's public name
    func: Callable[..., Any],
    num_workers: int = 1,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float = 0,
    num_workers_per_host: int | None = None,
    backend: str = "gloo",
    timeout_s: float | None = None,
    use_gpu: bool | str | None = None,
) -> Callable[[dict[str, Any]], None]:
    """Make a Tune trainable that runs `func(config, checkpoint_dir=None)` on `num_workers` workers.

    Pass the result to `tune.Tuner(...)` or `tune.run(...)` as any trainable; it carries its resource
    request (a placement group with one bundle per worker, or per `num_workers_per_host` workers,
    which are then kept together on one node), so `resources_per_trial` is not needed.
    `timeout_s` is the process group's timeout (default: `NCCL_TIMEOUT_S` or 1800).
    `use_gpu` is RaySGD 1.0's spelling of one GPU per worker; prefer `num_gpus_per_worker`.
    The keywords and their defaults are RaySGD's own for this function (`backend="gloo"` where a
    `GroupOptions` would say "auto"), kept so that its callers run unchanged; `GroupOptions`
    checks them.

    Raises `ValueError` when `func` cannot be called as `func(config, checkpoint_dir=None)` or when
    `num_workers` is not a multiple of `num_workers_per_host`.
    """
    _check_signature(func)
    check_int("num_workers", num_workers)
    if num_workers_per_host is not None:
        check_int("num_workers_per_host", num_workers_per_host)
        if num_workers % num_workers_per_host:
            raise ValueError(
                f"num_workers ({num_workers}) must be a multiple of num_workers_per_host "
                f"({num_workers_per_host})"
            )
    if use_gpu is not None:
        warnings.warn(
            "DistributedTrainableCreator(use_gpu=...) is deprecated; use num_gpus_per_worker",
            DeprecationWarning,
            stacklevel=2,
        )
        if resolve_use_gpu(use_gpu):
            num_gpus_per_worker = num_gpus_per_worker or 1
    # Checked here, on the driver, rather than in every trial.
    group = GroupOptions(
        num_cpus_per_worker=num_cpus_per_worker,
        num_gpus_per_worker=num_gpus_per_worker,
        backend=backend,
        timeout_s=timeout_s,
        # Tune's placement group captures child actors: the workers take the trial's bundles.
        placement_group="auto",
    )
    resources = worker_bundles_request(
        num_workers=num_workers,
        group=group,
        head_bundle=None,  # the trial process only relays reports: it needs no CPU of its own
        workers_per_bundle=num_workers_per_host or 1,
        placement_strategy="SPREAD" if num_workers_per_host else "PACK",
    )
    ship_by_value(func)
    spec = _Spec(func, num_workers, group)

    # A fresh function per call: Tune stores its resource request as an attribute on it.
    def trainable(config: dict[str, Any]) -> None:
        _run_trial(spec, config)

    name = getattr(func, "__name__", None) or getattr(
        getattr(func, "func", None), "__name__", "func"
    )
    trainable.__name__ = trainable.__qualname__ = f"Distributed_{name}"
    return tune.with_resources(trainable, resources)
