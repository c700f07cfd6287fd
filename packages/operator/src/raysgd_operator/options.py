"""`TrainingOptions`: every worker-side training option in one frozen, validated object.

The trainer builds one `TrainingOptions` on the driver (where a bad value costs nothing and the
error names the option), ships it whole to its workers, and `OperatorRunner` and `TrainingOperator`
take it whole. Nothing re-checks it on the way: a frozen dataclass is not run through
`__post_init__` again when it is unpickled.

Adding an option takes a field here (with its check in `_check`, when it needs one) and the keyword
of the same name and default in `TorchTrainer`'s signature, which fills the field by its name. The
operator reads it as ``self.options.<name>``.
Precision choices (`use_fp16`, `apex_args`) are checked by raysgd_amp's `check_precision`, the same
rule `get_precision` applies on the worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from raysgd_base import check_int, check_number, check_option_names
from raysgd_operator._internal.precision import check_precision
from raysgd_operator.dataset_options import DatasetOptions
from raysgd_operator.parallel_strategies.registry import resolve_strategy
from raysgd_operator.parallel_strategy import ParallelStrategy

__all__ = ["SCHEDULER_STEP_FREQS", "TrainingOptions"]

#: When registered schedulers step: after every optimizer step, after every epoch, or only through
#: `TorchTrainer.update_scheduler` (e.g. ReduceLROnPlateau).
SCHEDULER_STEP_FREQS = ("batch", "epoch", "manual")

#: Options that are plain switches; any truthy value is kept as True (RaySGD accepted 0/1 too).
_SWITCHES = ("use_gpu", "use_tqdm", "wrap_ddp", "add_dist_sampler", "distributed")


@dataclass(frozen=True)
class TrainingOptions:
    """How every worker trains; built once on the driver, read-only afterwards.

    Attributes:
        use_gpu: train on this worker's GPU (already resolved: the trainer turns "auto" into a bool).
        use_fp16: the precision choice, as `raysgd_amp.get_precision` takes it (False, True, "fp16",
            "bf16", "apex", a registered name, or a `raysgd_amp.Precision` instance or subclass).
        apex_args: keyword arguments for Apex's `amp.initialize` (with ``use_fp16="apex"``).
        use_tqdm: progress bars on rank 0.
        wrap_ddp: wrap registered models in DistributedDataParallel when distributed.
        add_dist_sampler: give registered DataLoaders a DistributedSampler when distributed.
        scheduler_step_freq: one of `SCHEDULER_STEP_FREQS`, or None (then no scheduler may be
            registered).
        accumulate_grad_batches: batches whose gradients are summed before each optimizer step.
        clip_grad_norm: clip the gradient norm to this value before each step (None: no clipping).
        num_threads: torch intra-op threads per worker (None: leave torch's default).
        strategy: how models are spread over the workers: "ddp" (default), "fsdp", "none", a
            registered name or a `raysgd_operator.ParallelStrategy` instance or subclass.
        strategy_args: keyword arguments of that strategy (checked by the strategy itself).
        compile: `torch.compile` every model on every worker, after wrapping.
        compile_args: keyword arguments for `torch.compile` (with ``compile=True``).
        dataset_options: how a worker draws batches from its dataset shards (`DatasetOptions`;
            None: its defaults).
        snapshot_every: with a sharded strategy, every how many steps each worker snapshots its
            part of the state in memory, with a copy on a peer (asynchronously: the loop pays
            for one copy of its part to CPU memory, the rest slows the steps it overlaps). A
            lost worker costs the steps since the last snapshot. "auto" (the default): as often
            as keeps the measured cost of the snapshots under 3% of the training time. 0: only
            at start-up, after a recovery and before a checkpoint.
        snapshot_memory_mb: with a sharded strategy, the host memory each worker's snapshots
            may take: they hold two copies of its part, four while one is taken. When four of
            the largest part do not fit, no snapshot is kept and a lost worker costs a return to
            the newest checkpoint. None (the default): no bound.
        peer_timeout_s: the shortest time a worker waits for a peer in a training step's
            collectives before treating it as silent (a frozen node, a hung process): the bound
            is this or a multiple of the slowest recent step, whichever is longer (the trainer's
            `collective_bound` says how; slow phases such as the first step of a call wait
            longer).
        flops_per_sample: the model's FLOPs in one training step (forward and backward) per unit
            of ``num_samples`` (per row, or per token when the batches count tokens); the
            results then report ``flops_per_s`` and ``mfu`` (`raysgd_operator.throughput`;
            `measure_flops_per_sample` counts them). None: neither.
        peak_flops_per_s: one device's peak FLOP/s, the denominator of ``mfu``. None: the
            table of known GPUs (`peak_flops_per_s`) for the worker's device and compute dtype;
            on a CPU or an unknown GPU, no ``mfu``.
        distributed: the trainer asked for more than one worker. Registered loaders are then split
            over the workers (`add_dist_sampler`) even while only one is left after a loss, so
            that the epoch's remaining rows carry over exactly when the group shrinks and grows.

    Raises TypeError or ValueError naming the option when a value is invalid. Use
    `dataclasses.replace(options, name=value)` for a changed copy (validated again).
    """

    use_gpu: bool = False
    use_fp16: Any = False
    apex_args: Optional[Mapping[str, Any]] = None
    use_tqdm: bool = False
    wrap_ddp: bool = True
    add_dist_sampler: bool = True
    scheduler_step_freq: Optional[str] = None
    accumulate_grad_batches: int = 1
    clip_grad_norm: Optional[float] = None
    num_threads: Optional[int] = None
    strategy: Any = "ddp"
    strategy_args: Optional[Mapping[str, Any]] = None
    compile: bool = False
    compile_args: Optional[Mapping[str, Any]] = None
    dataset_options: Optional[DatasetOptions] = None
    snapshot_every: Union[int, str] = "auto"
    snapshot_memory_mb: Optional[float] = None
    peer_timeout_s: float = 10.0
    flops_per_sample: Optional[float] = None
    peak_flops_per_s: Optional[float] = None
    distributed: bool = False
    #: The strategy object `strategy` names, resolved once here (see `parallel_strategy`).
    _parallel_strategy: Optional[ParallelStrategy] = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._check()
        # Normalised copies, so that the options do not change when the caller's objects do.
        for name in _SWITCHES:
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("apex_args", "strategy_args", "compile_args"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, dict(getattr(self, name)))

    def _check(self) -> None:
        check_precision(self.use_fp16, apex_args=self.apex_args)
        if (
            self.scheduler_step_freq is not None
            and self.scheduler_step_freq not in SCHEDULER_STEP_FREQS
        ):
            raise ValueError(
                f"scheduler_step_freq must be one of {SCHEDULER_STEP_FREQS} or None, "
                f"got {self.scheduler_step_freq!r}"
            )
        check_int("accumulate_grad_batches", self.accumulate_grad_batches)
        if self.clip_grad_norm is not None:
            check_number("clip_grad_norm", self.clip_grad_norm, above=0)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)
        if isinstance(self.snapshot_every, str) and self.snapshot_every != "auto":
            raise ValueError(
                f'snapshot_every must be "auto" or an int >= 0, got {self.snapshot_every!r}'
            )
        if self.snapshot_every != "auto":
            check_int("snapshot_every", self.snapshot_every, minimum=0)
        check_number("peer_timeout_s", self.peer_timeout_s, above=0)
        if self.snapshot_memory_mb is not None:
            check_number("snapshot_memory_mb", self.snapshot_memory_mb)
        for name in ("flops_per_sample", "peak_flops_per_s"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), above=0)
        # The strategy validates its own name and arguments (and wrap_ddp=False against it).
        strategy = resolve_strategy(self.strategy, self.strategy_args, wrap_ddp=bool(self.wrap_ddp))
        object.__setattr__(self, "_parallel_strategy", strategy)
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be True or False, got {self.compile!r}")
        if self.compile_args is not None and not isinstance(self.compile_args, Mapping):
            raise TypeError(f"compile_args must be a dict, got {type(self.compile_args).__name__}")
        if self.compile_args and not self.compile:
            raise ValueError("compile_args were given but compile=False")
        if self.dataset_options is not None and not isinstance(
            self.dataset_options, DatasetOptions
        ):
            raise TypeError(
                "dataset_options must be a DatasetOptions or None, "
                f"got {type(self.dataset_options).__name__}"
            )

    @property
    def parallel_strategy(self) -> ParallelStrategy:
        """The `ParallelStrategy` object that `strategy`, `strategy_args` and `wrap_ddp` choose."""
        assert self._parallel_strategy is not None  # set by __post_init__
        return self._parallel_strategy

    @property
    def sharded(self) -> bool:
        """Whether the chosen strategy shards the model (each worker holds only part of it)."""
        return bool(self.parallel_strategy.sharded)

    @classmethod
    def build(cls, options: Optional[TrainingOptions] = None, **overrides: Any) -> TrainingOptions:
        """`options` (default: all defaults) with `overrides` applied; unknown names raise TypeError.

        This is how `OperatorRunner(..., use_fp16="bf16")` and other keyword-style calls keep
        working: the keywords become one `TrainingOptions`.
        """
        if options is not None and not isinstance(options, TrainingOptions):
            raise TypeError(f"options must be a TrainingOptions, got {type(options).__name__}")
        if not overrides:
            return options if options is not None else cls()
        check_option_names(
            "training", overrides, (f.name for f in dataclasses.fields(cls) if f.init)
        )
        if options is None:
            return cls(**overrides)
        return dataclasses.replace(options, **overrides)
