"""`GroupOptions`: how a `WorkerGroup`'s workers are placed, started and connected, in one object.

Each option's name, type, default, check and documentation live here and nowhere else: `WorkerGroup`
takes a `GroupOptions` (or its fields as keywords), and frameworks built on raysgd-core (raysgd's
`TorchTrainer`, its Tune adapters) fill one from their own arguments instead of re-listing them. The
object is built and checked once, in the caller's process, so that a bad value fails before anything
starts and the error names the option.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

from raysgd_base import check_int, check_number, check_option_names

__all__ = [
    "BACKENDS",
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "DEFAULT_PEER_GRACE_S",
    "DEFAULT_TIMEOUT_S",
    "PLACEMENT_STRATEGIES",
    "TIMEOUT_ENV_VAR",
    "GroupOptions",
    "check_gpus_per_worker",
    "resolve_backend",
    "resolve_timeout",
]

#: Ray placement-group strategies a group may use for its workers.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Process-group backends: "auto" is resolved by `resolve_backend`.
BACKENDS = ("auto", "gloo", "nccl")
#: Timeout of the process group's collectives, in seconds, when none is given (RaySGD's).
DEFAULT_TIMEOUT_S = 1800.0
#: The environment variable RaySGD read the process group's timeout from; its users already set it.
TIMEOUT_ENV_VAR = "NCCL_TIMEOUT_S"


def check_gpus_per_worker(value: Any) -> None:
    """Ray's rule for the GPUs a worker reserves: a number, 0 for none, a share below one (Ray
    then puts several workers on one GPU), or a whole number above one.

    Raises:
        TypeError: not a number.
        ValueError: negative, or a fraction above one.
    """
    check_number("num_gpus_per_worker", value)
    if value > 1 and value != int(value):
        raise ValueError(
            f"num_gpus_per_worker must be at most 1 or a whole number of GPUs, got {value!r}"
        )


def resolve_backend(backend: str, uses_gpu: bool) -> str:
    """The backend a process group uses: "auto" is nccl when the workers have GPUs, else gloo.

    Raises ValueError for a name outside `BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "nccl" if uses_gpu else "gloo"
    return backend


def resolve_timeout(timeout_s: Union[float, timedelta, None]) -> Union[float, timedelta]:
    """The process group's timeout: `timeout_s` when given (`GroupOptions` checks it), else the
    seconds in `NCCL_TIMEOUT_S` (`TIMEOUT_ENV_VAR`), else `DEFAULT_TIMEOUT_S`.

    Raises ValueError when `NCCL_TIMEOUT_S` is set to anything but a number of seconds > 0.
    """
    if timeout_s is not None:
        return timeout_s
    raw = os.environ.get(TIMEOUT_ENV_VAR)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    # `not >` so that NaN (and a text that is no number) is refused too.
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV_VAR} must be a number of seconds > 0, got {raw!r}")
    return seconds


#: `GroupOptions.peer_grace_s` by default: gloo peers of a failing rank fail within milliseconds of
#: it leaving the group, and Ray needs up to a few seconds to report an actor death on a loaded
#: machine.
DEFAULT_PEER_GRACE_S = 5.0

#: `GroupOptions.liveness_timeout_s` by default: a live process answers a probe in milliseconds;
#: this leaves room for a machine loaded far past its cores.
DEFAULT_LIVENESS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GroupOptions:
    """Resources, placement, start-up, spares and timeouts of a `WorkerGroup`'s workers.

    Attributes:
        num_cpus_per_worker: CPUs reserved per worker; more than 0 (a worker with none would
            run torch with no thread of its own).
        num_gpus_per_worker: GPUs reserved per worker (each worker then computes on `cuda:0` of its
            own `CUDA_VISIBLE_DEVICES`).
        resources_per_worker: extra Ray resources per worker.
        backend: "gloo", "nccl" or "auto" (nccl when GPUs are requested, else gloo: the one
            rule, `resolve_backend`; `process_group_backend` is the result).
        timeout_s: timeout of the process group's collectives, in seconds (a `timedelta`, as
            `torch.distributed` takes it, is turned into seconds). None, the default, is
            `resolve_timeout`'s rule: `NCCL_TIMEOUT_S` when set, else `DEFAULT_TIMEOUT_S`. Built
            options always hold seconds.
        placement_strategy: placement-group strategy, one of `PLACEMENT_STRATEGIES`.
        init_hook: called with no arguments on every worker before the process group is formed
            (also on workers started by `recover`).
        env_vars: environment variables set in each actor before anything else runs there.
        use_local: run rank 0 in the calling process.
        placement_group: "auto" (use the current placement group when the caller runs inside one
            that captures child tasks, e.g. a Tune trial; else make one), a `PlacementGroup` to
            place the workers in (any bundle with room), or None (always make one).
        start_timeout_s: how long `start()` waits for resources, and then for the actors to come up.
        spare_workers: how many workers to keep started outside the process group, each in
            resources reserved like a worker's, to replace a lost worker at once: `recover`
            promotes the spares that are up (torch already imported) before it starts new actors,
            and starts new spares after every `start()` and `recover()`. They cost their
            resources and an idle process each; 0 keeps none.
        spare_imports: modules a spare imports while it waits, besides torch and the modules every
            worker imports: those a promoted worker would otherwise import after the loss (e.g.
            `torch.distributed.checkpoint` for a run whose state is sharded). A missing one is
            logged, not raised.
        peer_grace_s: after a rank fails in a call, how long the other ranks get to finish or fail
            on their own before they are killed as stuck. A caller whose ranks may wait in one
            collective for up to T seconds (see `raysgd_core.set_collective_timeout`) gives at
            least T, so that a rank waiting for a lost peer raises, keeps its state and is never
            killed for waiting. Once a rank reports a collective that waited out its bound, the
            ranks still silent a few seconds later are killed without waiting longer.
        liveness_timeout_s: how long a remote worker may leave the driver's liveness probes
            unanswered while a call waits for it before it counts as silent (a stopped process,
            a frozen or cut-off node) and is killed and reported lost (`WorkerDiedError.silent`),
            whatever the call was doing: a collective, a copy, a checkpoint, a restore. Probes
            run on a thread of the worker's own, so a busy worker answers them; None: no probes
            (a silent worker is then found only by its peers' collective bounds).
        keep_freed_memory: raise each worker's malloc thresholds (glibc only) so the memory a
            step frees is reused by the next one instead of being returned to the OS and faulted
            back in (what that costs: the raysgd-core README). Applied to the calling process too
            when `use_local` is set. Skipped where the environment already sets glibc's
            `MALLOC_*_` variables; False keeps the allocator's defaults.

    Raises TypeError or ValueError naming the option when a value is invalid. `replace` gives a
    changed copy, checked again.
    """

    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0
    resources_per_worker: Optional[Mapping[str, float]] = None
    backend: str = "auto"
    timeout_s: Union[float, timedelta, None] = None
    placement_strategy: str = "SPREAD"
    init_hook: Optional[Callable[[], Any]] = None
    env_vars: Optional[Mapping[str, str]] = None
    use_local: bool = False
    placement_group: Any = "auto"
    start_timeout_s: float = 30.0
    spare_workers: int = 0
    spare_imports: Sequence[str] = ()
    peer_grace_s: float = DEFAULT_PEER_GRACE_S
    liveness_timeout_s: Optional[float] = DEFAULT_LIVENESS_TIMEOUT_S
    keep_freed_memory: bool = True

    def __post_init__(self) -> None:
        check_number("num_cpus_per_worker", self.num_cpus_per_worker, above=0)
        check_gpus_per_worker(self.num_gpus_per_worker)
        if self.resources_per_worker is not None and not isinstance(
            self.resources_per_worker, Mapping
        ):
            raise TypeError(
                "resources_per_worker must be a dict of resource amounts, "
                f"got {type(self.resources_per_worker).__name__}"
            )
        for resource, amount in (self.resources_per_worker or {}).items():
            check_number(f"resources_per_worker[{resource!r}]", amount)
        timeout = resolve_timeout(self.timeout_s)
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        check_number("timeout_s", timeout, above=0)
        check_number("start_timeout_s", self.start_timeout_s, above=0)
        check_number("peer_grace_s", self.peer_grace_s, above=0)
        if self.liveness_timeout_s is not None:
            check_number("liveness_timeout_s", self.liveness_timeout_s, above=0)
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"got {self.placement_strategy!r}"
            )
        if self.init_hook is not None and not callable(self.init_hook):
            raise TypeError(f"init_hook must be callable, got {type(self.init_hook).__name__}")
        if self.env_vars is not None and not isinstance(self.env_vars, Mapping):
            raise TypeError(f"env_vars must be a dict, got {type(self.env_vars).__name__}")
        if isinstance(self.placement_group, str) and self.placement_group != "auto":
            raise ValueError(
                "placement_group must be 'auto', None or a PlacementGroup, "
                f"got {self.placement_group!r}"
            )
        check_int("spare_workers", self.spare_workers, minimum=0)
        if (
            isinstance(self.spare_imports, str)
            or not isinstance(self.spare_imports, Sequence)
            or not all(isinstance(name, str) and name for name in self.spare_imports)
        ):
            raise TypeError(
                f"spare_imports must be a sequence of module names, got {self.spare_imports!r}"
            )
        resolve_backend(self.backend, uses_gpu=False)  # a name outside BACKENDS fails here
        # Normalised copies: the options are plain values that do not change with the caller's
        # objects.
        normal = {
            "timeout_s": float(timeout),
            "start_timeout_s": float(self.start_timeout_s),
            "peer_grace_s": float(self.peer_grace_s),
            "liveness_timeout_s": None
            if self.liveness_timeout_s is None
            else float(self.liveness_timeout_s),
            "resources_per_worker": dict(self.resources_per_worker or {}),
            "env_vars": {str(k): str(v) for k, v in (self.env_vars or {}).items()},
            "spare_imports": tuple(self.spare_imports),
            "use_local": bool(self.use_local),
            "keep_freed_memory": bool(self.keep_freed_memory),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def process_group_backend(self) -> str:
        """`backend` with "auto" resolved for these workers ("gloo" or "nccl")."""
        return resolve_backend(self.backend, self.num_gpus_per_worker > 0)

    @classmethod
    def build(cls, options: Optional[GroupOptions] = None, **fields: Any) -> GroupOptions:
        """`options` (default: all defaults) with `fields` applied; an unknown name is a TypeError
        that lists the options."""
        if options is not None and not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions, got {type(options).__name__}")
        check_option_names("worker-group", fields, cls.field_names())
        if options is None:
            return cls(**fields)
        return options.replace(**fields) if fields else options

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the options, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> GroupOptions:
        """A copy with `changes` applied (checked again)."""
        return dataclasses.replace(self, **changes)
