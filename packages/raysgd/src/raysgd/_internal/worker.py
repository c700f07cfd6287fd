"""Functions the trainer runs on its workers through `WorkerGroup.execute`.

Each worker keeps one long-lived `OperatorRunner` in its `get_context().store` (the operator, its data
iterators, epoch and step counters), so every call after construction ships only its own arguments.
These functions are module-level and importable on the workers (raysgd is installed there), so Ray
pickles them by reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

from raysgd._internal.checkpoint import state_from_bytes, state_to_bytes
from raysgd_core import get_context
from raysgd_operator import OperatorRunner, TrainingOptions

__all__ = [
    "RUNNER_KEY",
    "STATE_KEY",
    "apply_fn",
    "apply_operator",
    "create_runner",
    "drop_runner",
    "get_models",
    "get_operator",
    "load_state",
    "restore_runner",
    "state_bytes",
    "train_epoch",
    "update_scheduler",
    "validate",
]

#: Key of the runner in the worker's `store` (namespaced: the store is shared with other libraries).
RUNNER_KEY = "raysgd.runner"

#: Key under which rank 0 keeps the serialised state the driver last took as its good state, so that
#: a restore can broadcast it from there over the new process group instead of shipping it again.
STATE_KEY = "raysgd.last_state"


def _keep_if_rank0(state: bytes) -> bytes:
    ctx = get_context()
    if ctx.world_rank == 0:
        ctx.store[STATE_KEY] = state
    return state


def _runner() -> OperatorRunner:
    runner = get_context().store.get(RUNNER_KEY)
    if runner is None:
        raise RuntimeError("this worker has no raysgd runner (it was shut down or never set up)")
    return runner


def _my_shards(shards: Sequence[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """This worker's dataset shards out of every rank's (None without datasets)."""
    if not shards:
        return None
    return dict(shards[get_context().world_rank])


def _build(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    shards: Sequence[Mapping[str, Any]] = (),
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
        datasets=_my_shards(shards),
        options=options,
    )
    ctx.store[RUNNER_KEY] = runner
    return runner


def create_runner(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    return_state: bool = False,
    shards: Sequence[Mapping[str, Any]] = (),
) -> Optional[bytes]:
    """Build this worker's runner (which runs the user's `setup`).

    With `return_state`, rank 0 also returns its initial state, so that the trainer has its first
    in-memory checkpoint without another round trip before the first `train()`. `shards` holds every
    rank's dataset shards (`{name: DataIterator}` in rank order); each worker takes its own.
    """
    runner = _build(operator_cls, config, options, shards)
    if return_state and get_context().world_rank == 0:
        return _keep_if_rank0(state_to_bytes(runner.state_dict()))
    return None


def restore_runner(
    operator_cls: type,
    config: Mapping[str, Any],
    options: TrainingOptions,
    state: Optional[bytes],
    shards: Sequence[Mapping[str, Any]] = (),
    source: Optional[int] = None,
) -> None:
    """After a resize: re-bind a kept runner (or build one on a new worker), then load `state`.

    `shards`: the datasets split over the new group, as for `create_runner`. With `state=None`,
    rank `source` (a survivor that kept the last good state, see `STATE_KEY`) broadcasts it to every
    rank over the new process group first.
    """
    ctx = get_context()
    if state is None:
        # First, before any other collective (DDP's own broadcast when wrapping), on every rank.
        state = _broadcast_kept_state(-1 if source is None else source)
    runner: Optional[OperatorRunner] = ctx.store.get(RUNNER_KEY)
    rebound = False
    if runner is not None:
        rebound = runner.rebind(
            world_rank=ctx.world_rank,
            local_rank=ctx.local_rank,
            world_size=ctx.world_size,
            config=dict(config),
            datasets=_my_shards(shards),
        )
        if not rebound:
            ctx.store.pop(RUNNER_KEY, None)
            runner.shutdown()
    if not rebound:
        runner = _build(operator_cls, config, options, shards)
    assert runner is not None
    runner.load_state_dict(state_from_bytes(state))
    _keep_if_rank0(state)


def _broadcast_kept_state(source: int) -> bytes:
    import torch.distributed as dist

    ctx = get_context()
    payload = [ctx.store.get(STATE_KEY) if ctx.world_rank == source else None]
    # NCCL moves objects through device tensors; gloo through CPU ones.
    device = torch.device(ctx.device) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(payload, src=source, device=device)
    if not isinstance(payload[0], bytes):
        raise RuntimeError(f"rank {source} holds no saved state to restore from")
    return payload[0]


def train_epoch(num_steps: Optional[int], profile: bool, info: Optional[dict]) -> dict:
    """One `train` call on this worker."""
    return _runner().train_epoch(num_steps=num_steps, profile=profile, info=info)


def validate(num_steps: Optional[int], profile: bool, info: Optional[dict]) -> dict:
    """One `validate` call on this worker."""
    return _runner().validate(num_steps=num_steps, profile=profile, info=info)


def state_bytes() -> bytes:
    """This worker's full state, serialised (rank 0 also keeps it: the driver's new good state)."""
    return _keep_if_rank0(state_to_bytes(_runner().state_dict()))


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
    get_context().store.pop(STATE_KEY, None)
    runner = get_context().store.pop(RUNNER_KEY, None)
    if runner is not None and graceful:
        runner.shutdown()
