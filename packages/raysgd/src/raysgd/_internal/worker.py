"""Functions the trainer runs on its workers through `WorkerGroup.execute`.

Each worker keeps one long-lived `OperatorRunner` in its `get_context().store` (the operator, its data
iterators, epoch and step counters), so every call after construction ships only its own arguments.
The training state stays on the workers: after a resize the survivor that got furthest sends it to
the workers that need it (`restore_runner`), and it reaches the driver only when the user asks for
it (`state_bytes`, `get_models`) or for the bounded copy (`state_copy`). These functions are
module-level and importable on the workers (raysgd is installed there), so Ray pickles them by
reference.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Optional

import torch

from raysgd._internal.checkpoint import state_from_bytes, state_to_bytes, write_file
from raysgd._internal.drain_watch import WatchSpec, watch_for
from raysgd._internal.restore_plan import RestorePlan
from raysgd._internal.state_transfer import broadcast_state, flatten
from raysgd_core import get_context
from raysgd_operator import OperatorRunner, Progress, TrainingOptions

__all__ = [
    "RUNNER_KEY",
    "apply_fn",
    "apply_operator",
    "create_runner",
    "drop_runner",
    "get_models",
    "get_operator",
    "load_state",
    "remove_file",
    "report_progress",
    "restore_runner",
    "state_bytes",
    "state_copy",
    "train_epoch",
    "update_scheduler",
    "validate",
    "write_checkpoint",
    "write_probe",
]

#: Key of the runner in the worker's `store` (namespaced: the store is shared with other libraries).
RUNNER_KEY = "raysgd.runner"


def _runner() -> OperatorRunner:
    runner = get_context().store.get(RUNNER_KEY)
    if runner is None:
        raise RuntimeError("this worker has no raysgd runner (it was shut down or never set up)")
    return runner


def _my_dataset_splits(dataset_splits: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """This worker's dataset splits out of every rank's (None without datasets)."""
    if not dataset_splits:
        return None
    return dict(dataset_splits[get_context().world_rank])


def _build(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    dataset_splits: Sequence[Mapping[str, Any]] = (),
    *,
    restoring: bool = False,
) -> OperatorRunner:
    ctx = get_context()
    if torch.device(ctx.device).type == "cuda":
        # Let cuDNN time its algorithms once per input shape and keep the fastest, as GPU training
        # scripts usually do; an operator that needs bitwise reproducibility turns it off in setup().
        torch.backends.cudnn.benchmark = True
    runner = OperatorRunner(
        operator_cls,
        dict(config),
        world_rank=ctx.world_rank,
        local_rank=ctx.local_rank,
        world_size=ctx.world_size,
        device=ctx.device,
        datasets=_my_dataset_splits(dataset_splits),
        options=options,
        restoring=restoring,
    )
    ctx.store[RUNNER_KEY] = runner
    return runner


def _state_nbytes(runner: OperatorRunner) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(runner.state_dict(live=True))[1])


def create_runner(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    copy_limit_bytes: int = 0,
    dataset_splits: Sequence[Mapping[str, Any]] = (),
) -> Optional[tuple[Optional[bytes], int]]:
    """Build this worker's runner (which runs the user's `setup`).

    Rank 0 of a replicated run also returns ``(state bytes, state size)``: the bytes only when the
    state is at most `copy_limit_bytes`, so that the driver's bounded copy starts current.
    `dataset_splits` holds every rank's split of the datasets (`{name: DataIterator}` in rank
    order); each worker takes its own.
    """
    runner = _build(operator_cls, config, options, dataset_splits)
    if get_context().world_rank != 0 or runner.sharded:
        return None
    size = _state_nbytes(runner)
    data = state_to_bytes(runner.state_dict()) if size <= copy_limit_bytes else None
    return data, size


def report_progress() -> Optional[Progress]:
    """How far this worker got (None on a worker without a runner: a replacement)."""
    runner = get_context().store.get(RUNNER_KEY)
    return None if runner is None else runner.progress()


def restore_runner(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    plan: RestorePlan,
    fallback: Optional[bytes],
    dataset_splits: Sequence[Mapping[str, Any]] = (),
) -> None:
    """After a resize: make this worker ready to go on training where `plan` says.

    A kept runner re-binds to its new rank and size (or is built again when it cannot, keeping
    its state); a new worker builds one. Then the source sends its state to the receivers over the
    new process group, or, when no worker held a usable state, everyone loads `fallback` (the
    driver's copy or a checkpoint). Last, everyone takes the source's place in the epoch and the
    call it was in. `dataset_splits`: the datasets split over the new group, as for `create_runner`.
    """
    ctx = get_context()
    rank = ctx.world_rank
    placement = dict(world_rank=rank, local_rank=ctx.local_rank, world_size=ctx.world_size)
    runner: Optional[OperatorRunner] = ctx.store.get(RUNNER_KEY)
    if runner is not None and not runner.rebind(
        **placement, config=dict(config), datasets=_my_dataset_splits(dataset_splits)
    ):
        # The loaders cannot follow (the user's own sampler): set up again, keeping the state.
        old = runner
        runner = _build(operator_cls, config, options, dataset_splits, restoring=True)
        runner.take_over(old)
        old.shutdown()
    if runner is None:
        runner = _build(operator_cls, config, options, dataset_splits, restoring=True)
    if plan.source is None:
        if fallback is None:
            raise RuntimeError("no worker holds the training state and there is no copy of it")
        runner.load_state_dict(state_from_bytes(fallback))
        # The copy or checkpoint predates the interrupted call: every worker, kept or new,
        # starts that call again from the loaded step (a survivor's own record of it would have
        # it run fewer steps than the new workers, and the group would wait in a collective).
        runner.adopt(runner.position_state(), None)
        return
    live = runner.state_dict(live=True) if rank == plan.source else None
    received = broadcast_state(
        live, source=plan.source, receivers=plan.receivers, device=torch.device(ctx.device)
    )
    if rank in plan.receivers:
        runner.load_state_dict(received)
    _adopt_from(runner, plan.source)


def _adopt_from(runner: OperatorRunner, source: int) -> None:
    """Every rank takes the source's place in the epoch and its call (small: one object)."""
    import torch.distributed as dist

    ctx = get_context()
    holder = [(runner.position_state(), runner.call) if ctx.world_rank == source else None]
    # NCCL moves objects through device tensors; gloo through CPU ones.
    device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(holder, src=source, device=device)
    position, call = holder[0]  # type: ignore[misc]
    runner.adopt(position, call)


def train_epoch(
    num_steps: Optional[int],
    profile: bool,
    info: Optional[dict],
    call_id: Hashable = None,
    watch: Optional[WatchSpec] = None,
) -> tuple[dict, int, Optional[int], bool]:
    """One `train` call on this worker (`call_id` names it: see `OperatorRunner.train_epoch`),
    watching `watch`'s nodes for a drain (see `drain_watch`).

    Returns (metrics, finished steps since training began, rows the whole group trained in the
    call when it went on after a recovery and the split is known, else None, whether the call
    stopped early because a node of the group is draining).
    """
    runner = _runner()
    watch_for(runner, watch)
    metrics = runner.train_epoch(num_steps=num_steps, profile=profile, info=info, call_id=call_id)
    call = runner.call
    rows = call.rows if call is not None and call.recovered else None
    return metrics, runner.step, rows, runner.yielded


def validate(num_steps: Optional[int], profile: bool, info: Optional[dict]) -> dict:
    """One `validate` call on this worker."""
    return _runner().validate(num_steps=num_steps, profile=profile, info=info)


def state_bytes() -> bytes:
    """This worker's full state, serialised (asked for by the user: `state_dict`, `save`)."""
    return state_to_bytes(_runner().state_dict())


def state_copy(limit_bytes: int) -> tuple[Optional[bytes], int, int, float]:
    """For the driver's bounded copy: ``(bytes or None, state size, step, seconds spent)``; the
    bytes only when the state is at most `limit_bytes`."""
    runner = _runner()
    started = time.perf_counter()
    size = _state_nbytes(runner)
    data = state_to_bytes(runner.state_dict()) if size <= limit_bytes else None
    return data, size, runner.step, time.perf_counter() - started


def write_checkpoint(path: str) -> str:
    """Write this worker's full state to `path` (on its own disk), atomically."""
    return write_file(path, state_to_bytes(_runner().state_dict()))


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


def load_state(state: bytes) -> None:
    """Load a serialised state (validated and loaded safely) into this worker's runner."""
    _runner().load_state_dict(state_from_bytes(state))


def get_models(to_cpu: bool, cpu_if_on_device: bool = False) -> Any:
    """The unwrapped model(s) of this worker's runner (see `OperatorRunner.get_models`)."""
    return _runner().get_models(to_cpu=to_cpu, cpu_if_on_device=cpu_if_on_device)


def get_operator() -> Any:
    """The operator itself (only returned by value in the driver, with `use_local=True`)."""
    return _runner().operator


def update_scheduler(metric: Any) -> None:
    """`scheduler.step(metric)` on every registered scheduler (e.g. ReduceLROnPlateau)."""
    _runner().update_scheduler(metric)


def apply_fn(fn: Callable[[], Any]) -> Any:
    """`fn()` on this worker."""
    return fn()


def apply_operator(fn: Callable[[Any], Any]) -> Any:
    """`fn(operator)` on this worker."""
    return _runner().apply_operator(fn)


def drop_runner(graceful: bool) -> None:
    """Forget this worker's runner; with `graceful`, let it release its resources first."""
    runner = get_context().store.pop(RUNNER_KEY, None)
    if runner is not None and graceful:
        runner.shutdown()
