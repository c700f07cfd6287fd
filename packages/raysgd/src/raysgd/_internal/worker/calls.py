"""Functions the trainer runs on its workers through `WorkerGroup.execute`.

Each worker keeps one long-lived `OperatorRunner` and its `WorkerState` in its `WorkerObjects`
(`objects`), so every call after construction ships only its own arguments. The training state stays on the workers: it reaches the driver only when
the user asks for it (`get_models`) or for the bounded copy (`state_copy`).
These functions are module-level and importable on the workers (raysgd is installed there), so
Ray pickles them by reference. An operator class arrives as a top-level argument: Ray resolves
its object-store reference on every rank (the driver's own rank gets the class itself).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Optional

from raysgd._internal.protocol import (
    CheckpointPlan,
    Holding,
    LoadAnswer,
    LoadSource,
    RestorePlan,
    RunnerArgs,
    StateCopy,
    TrainAnswer,
    WatchSpec,
)
from raysgd._internal.worker.build import (
    build_runner,
    current_runner,
)
from raysgd._internal.worker.objects import (
    bound_for,
    keep,
    periodic_for,
    this_worker,
    uploads,
    watch_for,
    worker_state,
)
from raysgd._internal.worker.state import (
    WorkerState,
    state_within,
)
from raysgd_core import get_context
from raysgd_operator import TrainingOptions

__all__ = [
    "apply_fn",
    "apply_operator",
    "create_runner",
    "drop_runner",
    "epoch",
    "finish_uploads",
    "get_models",
    "get_operator",
    "holding",
    "load",
    "models_nbytes",
    "remove_file",
    "restore",
    "state_copy",
    "train_epoch",
    "update_scheduler",
    "validate",
    "write_probe",
]


# ------------------------------------------------------------------------------ the runner
def create_runner(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    dataset_splits: Sequence[Mapping[str, Any]],
    state_class: type[WorkerState],
    copy_limit_bytes: int = 0,
) -> Optional[tuple[Optional[bytes], int]]:
    """Build this worker's runner (which runs the user's `setup`) and the state it holds.

    Rank 0 also returns what the state offers the driver's bounded copy
    (`WorkerState.copy_for_driver`: ``(state bytes, state size)``, the bytes only when the state
    is at most `copy_limit_bytes`), so that the copy starts current.
    """
    runner = build_runner(
        RunnerArgs(operator_cls, dict(config), options, dataset_splits, state_class)
    )
    state = keep(state_class(runner))
    ctx = get_context()
    this_worker().slot_of = (ctx.world_rank, ctx.generation)
    if ctx.world_rank != 0 or copy_limit_bytes <= 0:
        return None
    return state.copy_for_driver(copy_limit_bytes)


def drop_runner(graceful: bool) -> None:
    """Forget this worker's runner and state; with `graceful`, let them release their resources
    first."""
    objects = this_worker()
    state, runner = objects.state, objects.runner
    objects.state = objects.runner = None
    objects.slot_of = None
    if graceful:
        if state is not None:
            state.close()
        if runner is not None:
            runner.shutdown()


# ------------------------------------------------------------------------------ the state
def holding() -> Holding:
    """What this worker holds of the training state (a new worker: nothing)."""
    state = this_worker().state
    return Holding(None) if state is None else state.holding()


def restore(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    dataset_splits: Sequence[Mapping[str, Any]],
    state_class: type[WorkerState],
    plan: RestorePlan,
) -> None:
    """After a resize: make this worker ready to go on training where `plan` says (see
    `WorkerState.restore`)."""
    args = RunnerArgs(operator_cls, dict(config), options, dataset_splits, state_class)
    state_class.restore(args, plan)


def load(source: LoadSource) -> LoadAnswer:
    """Load a checkpoint into this worker's runner. A whole state that is not a checkpoint is
    refused before anything changes (the answer says why: no worker raises, so the group stays
    formed); a bad sharded part raises (its load is a collective)."""
    runner = current_runner()
    try:
        worker_state().load(source)
    except ValueError as exc:
        if not source.checked_first:
            raise
        return LoadAnswer(runner.position.step, runner.position.finished_epochs, str(exc))
    return LoadAnswer(runner.position.step, runner.position.finished_epochs)


def finish_uploads() -> Optional[str]:
    """Wait for this worker's checkpoint upload in flight; why the last one failed, if it did."""
    periodic = uploads()
    if periodic is None:
        return None
    periodic.finish()
    return periodic.error


def state_copy(limit_bytes: int) -> StateCopy:
    """For the driver's bounded copy: the state's bytes only when it is at most `limit_bytes`."""
    runner = current_runner()
    started = time.perf_counter()
    data, size = state_within(runner, limit_bytes)
    return StateCopy(data, size, runner.position.step, time.perf_counter() - started)


def epoch() -> int:
    """This worker's epoch (the same on every worker)."""
    return current_runner().position.epoch


# ------------------------------------------------------------------------------ the calls
def train_epoch(
    num_steps: Optional[int],
    profile: bool,
    info: Optional[dict],
    call_id: Hashable = None,
    watch: Optional[WatchSpec] = None,
    checkpoints: Optional[CheckpointPlan] = None,
    step_hint_s: float = 0.0,
) -> TrainAnswer:
    """One `train` call on this worker (`call_id` names it: see `OperatorRunner.train_epoch`),
    watching `watch`'s nodes for a drain (see `preemption`), its collectives bounded by the step
    time (see `collective_bound`; `step_hint_s` is the group's recent step time, for a worker that
    measured none), writing the checkpoints `checkpoints` asks for in the background (see
    `worker.periodic_checkpoints`)."""
    runner = current_runner()
    watch_for(runner, watch)
    periodic_for(worker_state(), checkpoints)
    bound = bound_for(runner)
    bound.begin_call(step_hint_s)
    finished = False
    try:
        metrics = runner.train_epoch(
            num_steps=num_steps, profile=profile, info=info, call_id=call_id
        )
        finished = not runner.yielded
    finally:
        bound.end_call(finished)
    call = runner.position.call
    # The group's count of the call's rows replaces the workers' (a lost worker's went with it)
    # only where they counted rows: a count of something else keeps the survivors' sum.
    rows = call.rows if call is not None and call.recovered and runner.counts_rows else None
    periodic, watch = uploads(), this_worker().watch
    stopped_for = watch.stopped_for if watch is not None and runner.yielded else None
    return TrainAnswer(
        metrics,
        runner.position.step,
        rows,
        stopped_for,
        runner.position.finished_epochs,
        bound.mean_step_s(),
        periodic.take_blocked() if periodic is not None else 0.0,
    )


def validate(num_steps: Optional[int], profile: bool, info: Optional[dict]) -> dict:
    """One `validate` call on this worker."""
    return current_runner().validate(num_steps=num_steps, profile=profile, info=info)


def get_models(to_cpu: bool, cpu_if_on_device: bool = False) -> Any:
    """The unwrapped model(s) of this worker's runner (see `OperatorRunner.get_models`)."""
    return current_runner().get_models(to_cpu=to_cpu, cpu_if_on_device=cpu_if_on_device)


def models_nbytes() -> int:
    """What this worker's `get_models` brings into one process, in bytes."""
    return current_runner().models_nbytes()


def get_operator() -> Any:
    """The operator itself (only returned by value in the driver, with `use_local=True`)."""
    return current_runner().operator


def update_scheduler(metric: Any) -> None:
    """`scheduler.step(metric)` on every registered scheduler (e.g. ReduceLROnPlateau)."""
    current_runner().update_scheduler(metric)


def apply_fn(fn: Callable[[], Any]) -> Any:
    """`fn()` on this worker."""
    return fn()


def apply_operator(fn: Callable[[Any], Any]) -> Any:
    """`fn(operator)` on this worker."""
    return current_runner().apply_operator(fn)


# ------------------------------------------------------------------------------ files
def write_probe(directory: str) -> Optional[str]:
    """Create an empty, uniquely named file in `directory` and return its path, so that the driver
    can tell whether it sees this worker's files there; None when it cannot (the directory does
    not exist here: nothing is created on this node)."""
    try:
        path = os.path.join(directory, f".raysgd-probe-{uuid.uuid4().hex}")
        with open(path, "x"):
            pass
    except OSError:
        return None
    return path


def remove_file(path: str) -> None:
    """Remove `path` on this worker's node (missing: nothing to do)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
