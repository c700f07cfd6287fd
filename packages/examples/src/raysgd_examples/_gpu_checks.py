"""The checks of `gpu_check`: the job each trains, where its workers run, and the checks.

Each check trains a tiny model for a few steps with `TorchTrainer` on the placement it is given
(`placements`) and returns the reason it passed, raises `CheckFailed`, or raises `Skipped`;
`CHECKS` lists them in the table's order. `gpu_check` runs them and prints the table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import DatasetOptions, TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_amp import NativePrecision

__all__ = [
    "CHECKS",
    "Check",
    "CheckFailed",
    "CheckOperator",
    "CheckRun",
    "Placement",
    "Skipped",
    "placements",
]

#: Input features of the checks' model, and rows of their synthetic data.
FEATURES = 8
ROWS = 256
#: The global batch: 16 rows per worker and 8 steps an epoch with two workers.
GLOBAL_BATCH = 32


class CheckFailed(AssertionError):
    """A check ran but what it checks did not hold; the message is the table's reason."""


class Skipped(Exception):
    """A check that cannot run here (bf16 on a GPU without it, Ray Data not installed)."""


def _expect(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


# -- the job every check trains ----------------------------------------------------------------
def _tensors(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed linear regression with a little noise: the same rows on every worker."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator)
    weight = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    return x, x @ weight + 0.01 * torch.randn(rows, 1, generator=generator)


def _same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    # cuda and cuda:0 name one device for a worker whose current device is 0.
    return tensor.device.type == device.type and (tensor.device.index or 0) == (device.index or 0)


class CheckOperator(TrainingOperator):
    """A small MLP with dropout (so that training draws from the device's generator) on synthetic
    rows, or on the "train" dataset when the trainer has one.

    `config["crash"]` (``{"marker": path, "rank": r, "batch": b}``) makes rank r end its process
    at batch b once: the marker file, written first, keeps the replacement from doing it again.
    Every result also says whether the batch arrived on the worker's device (`batch_on_device`).
    """

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        if self.get_dataset_shard("train") is None:
            batch = config[BATCH_SIZE]
            train, validation = _tensors(ROWS, seed=0), _tensors(64, seed=1)
            self.register_data(
                train_loader=DataLoader(TensorDataset(*train), batch_size=batch, shuffle=True),
                validation_loader=DataLoader(TensorDataset(*validation), batch_size=batch),
            )

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        crash = self.config.get("crash")
        if (
            crash
            and self.world_rank == crash["rank"]
            and batch_info["batch_idx"] == crash["batch"]
            and not os.path.exists(crash["marker"])
        ):
            Path(crash["marker"]).touch()
            os._exit(1)  # as a lost machine would: no exception, no clean-up
        on_device = all(_same_device(t, self.device) for t in batch)
        metrics = super().train_batch(batch, batch_info)
        metrics["batch_on_device"] = float(on_device)
        return metrics


# Functions run on the workers: module-level, so that Ray ships them by reference.
def _flat_parameters(op: CheckOperator) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in op.model.parameters()])


def _worker_place() -> tuple[str, str]:
    from raysgd_core import get_context

    context = get_context()
    return str(context.device), context.backend


def _shard_report(op: CheckOperator) -> tuple[str, str, int]:
    """(the first parameter's class, its local shard's device, the elements this worker holds)."""
    first = next(iter(op.model.parameters()))
    local = first.to_local() if hasattr(first, "to_local") else first
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in op.model.parameters()
    )
    return type(first).__name__, str(local.device), held


def _precision_report(op: CheckOperator) -> tuple[str, Optional[float]]:
    scaler = op.precision.scaler if hasattr(op.precision, "scaler") else None
    return op.precision.name, None if scaler is None else float(scaler.get_scale())


def _generator_state() -> torch.Tensor:
    """This worker's generator of its device: CUDA's on a GPU worker, the CPU's otherwise."""
    from raysgd_core import get_context

    if get_context().device.type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _advance_generator() -> None:
    from raysgd_core import get_context

    torch.rand(1024, device=get_context().device)


def _ray_data_features(batch: dict[str, Any]) -> dict[str, Any]:
    """`ray.data.range` ids to the checks' (x, y) columns, as a Ray Data preprocessing step."""
    import numpy as np

    ids = batch["id"].astype(np.float32)
    x = np.stack([np.sin(0.01 * (k + 1) * ids) for k in range(FEATURES)], axis=1)
    return {"x": x.astype(np.float32), "y": x.sum(axis=1, keepdims=True).astype(np.float32)}


# -- placements --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where a check's workers run, and over which backend."""

    num_workers: int
    use_gpu: bool
    num_gpus_per_worker: Optional[float]
    backend: str
    description: str

    def trainer_kwargs(self) -> dict[str, Any]:
        """The `TorchTrainer` keywords of this placement."""
        return {
            "num_workers": self.num_workers,
            "use_gpu": self.use_gpu,
            "num_gpus_per_worker": self.num_gpus_per_worker,
            "backend": self.backend,
        }


def placements(gpus: int) -> dict[str, Placement]:
    """The placement of the replicated checks ("ddp") and of the sharded ones ("fsdp") on a
    machine with `gpus` GPUs (0: the CPU dry run)."""
    if gpus == 0:
        cpu = Placement(2, False, None, "gloo", "2 CPU workers, gloo (dry run)")
        return {"ddp": cpu, "fsdp": cpu}
    if gpus >= 2:
        own = Placement(2, True, 1, "nccl", "2 workers x 1 GPU, nccl")
        return {"ddp": own, "fsdp": own}
    return {
        "ddp": Placement(2, True, 0.5, "gloo", "2 workers sharing 1 GPU (0.5 each), gloo"),
        # gloo has no reduce-scatter or all-gather for CUDA tensors, and NCCL no two ranks on one
        # device: fsdp gets the GPU to itself.
        "fsdp": Placement(1, True, 1, "nccl", "1 worker x 1 GPU, nccl (fsdp needs NCCL)"),
    }


@dataclass
class CheckRun:
    """What every check of one run shares: where to write, and how to build a trainer."""

    workdir: Path

    def folder(self, name: str) -> str:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def trainer(self, placement: Placement, **kwargs: Any) -> TorchTrainer:
        config = {BATCH_SIZE: GLOBAL_BATCH, **kwargs.pop("config", {})}
        # A bound on every collective well below the 30-minute default, so that a check that
        # hangs fails in minutes and the rest still run.
        options = {"timeout_s": 300.0, **placement.trainer_kwargs(), **kwargs}
        return TorchTrainer(training_operator_cls=CheckOperator, config=config, **options)

    def crash(self, name: str, rank: int, batch: int) -> dict[str, Any]:
        return {"marker": os.path.join(self.folder(name), "crashed"), "rank": rank, "batch": batch}


@contextmanager
def _shut_down_after(trainer: TorchTrainer) -> Iterator[TorchTrainer]:
    try:
        yield trainer
    finally:
        trainer.shutdown()


def _finite_loss(result: dict[str, Any]) -> float:
    loss = float(result["train_loss"])
    _expect(math.isfinite(loss), f"train_loss is {loss}")
    return loss


def _ranks_agree(trainer: TorchTrainer) -> None:
    weights = trainer.apply_all_operators(_flat_parameters)
    _expect(
        all(torch.equal(weights[0], w) for w in weights[1:]),
        f"the {len(weights)} ranks' weights differ after training",
    )


# -- the checks --------------------------------------------------------------------------------
def check_ddp(run: CheckRun, placement: Placement) -> str:
    """Two workers train a few steps with DDP on the placement's devices and backend."""
    with _shut_down_after(run.trainer(placement)) as trainer:
        places = trainer.apply_all_workers(_worker_place)
        kind = "cuda" if placement.use_gpu else "cpu"
        _expect(
            all(
                device.startswith(kind) and backend == placement.backend
                for device, backend in places
            ),
            f"workers on {places}, expected {kind} with {placement.backend}",
        )
        loss = _finite_loss(trainer.train(num_steps=4))
        _ranks_agree(trainer)
    where = ", ".join(device for device, _ in places)
    return f"ranks on {where} over {places[0][1]} agree after 4 steps (loss {loss:.3f})"


def check_fsdp(run: CheckRun, placement: Placement) -> str:
    """FSDP2 shards the model over the workers' devices, trains, and gathers it on the driver."""
    with _shut_down_after(run.trainer(placement, strategy="fsdp")) as trainer:
        loss = _finite_loss(trainer.train(num_steps=4))
        shards = trainer.apply_all_operators(_shard_report)
        kind = "cuda" if placement.use_gpu else "cpu"
        _expect(
            all(name == "DTensor" and device.startswith(kind) for name, device, _ in shards),
            f"parameters are {shards}, expected DTensor shards on {kind}",
        )
        model = trainer.get_model()
        whole = sum(p.numel() for p in model.parameters())
        _expect(
            sum(held for _, _, held in shards) == whole,
            f"the shards hold {[held for _, _, held in shards]} elements, the model {whole}",
        )
    return f"DTensor shards on {shards[0][1]}, {whole} parameters gathered (loss {loss:.3f})"


def check_fp16(run: CheckRun, placement: Placement) -> str:
    """Native fp16: autocast with a GradScaler whose scale stays finite."""
    # "fp16" on a CPU worker runs bf16 (raysgd_amp's rule): the dry run asks for fp16 by instance
    # so that the scaler's code path runs there too.
    use_fp16: Any = "fp16" if placement.use_gpu else NativePrecision("fp16")
    with _shut_down_after(run.trainer(placement, use_fp16=use_fp16)) as trainer:
        loss = _finite_loss(trainer.train(num_steps=4))
        reports = trainer.apply_all_operators(_precision_report)
    name, scale = reports[0]
    _expect(name == "fp16", f"precision is {name}, expected fp16")
    _expect(scale is not None and math.isfinite(scale) and scale > 0, f"GradScaler scale {scale}")
    return f"fp16 autocast, GradScaler scale {scale:g} (loss {loss:.3f})"


def check_bf16(run: CheckRun, placement: Placement) -> str:
    """Native bf16: autocast without a scaler."""
    if placement.use_gpu and not torch.cuda.is_bf16_supported():
        raise Skipped(f"{torch.cuda.get_device_name(0)} has no bf16")
    with _shut_down_after(run.trainer(placement, use_fp16="bf16")) as trainer:
        loss = _finite_loss(trainer.train(num_steps=4))
        name, scale = trainer.apply_all_operators(_precision_report)[0]
    _expect(name == "bf16" and scale is None, f"precision {name} with scale {scale}")
    return f"bf16 autocast, no scaler (loss {loss:.3f})"


def check_killed_worker(run: CheckRun, placement: Placement) -> str:
    """The last rank ends its process mid-call; the call goes on and finishes every step."""
    rank = placement.num_workers - 1
    crash = run.crash("killed_worker", rank=rank, batch=2)
    with _shut_down_after(run.trainer(placement, config={"crash": crash})) as trainer:
        result = trainer.train(num_steps=6, max_retries=2)
        _finite_loss(result)
        _expect(trainer.failures == 1, f"{trainer.failures} failures counted, expected 1")
        _expect(result["batch_count"] == 6, f"{result['batch_count']} steps of 6 trained")
        if placement.num_workers > 1:
            _ranks_agree(trainer)
        resize = [e for e in trainer.recovery_events if e.kind == "resize"][-1]
    return f"rank {rank} lost at step 2; state from {resize.source}, {resize.steps_redone} redone"


def check_save_load(run: CheckRun, placement: Placement) -> str:
    """save() then load() gives back the saved state: the same validation loss."""
    path = os.path.join(run.folder("save_load"), "checkpoint.pt")
    with _shut_down_after(run.trainer(placement)) as trainer:
        trainer.train(num_steps=4)
        saved = float(trainer.validate()["val_loss"])
        trainer.save(path)
        trainer.train(num_steps=4)
        moved = float(trainer.validate()["val_loss"])
        trainer.load(path)
        loaded = float(trainer.validate()["val_loss"])
    _expect(
        math.isclose(loaded, saved, rel_tol=1e-6, abs_tol=1e-9),
        f"val_loss {saved} saved, {loaded} after load()",
    )
    return f"val_loss {saved:.5f} saved, {moved:.5f} trained on, {loaded:.5f} after load()"


def check_resume(run: CheckRun, placement: Placement) -> str:
    """A new trainer with resume=True starts from checkpoint_dir's newest checkpoint."""
    folder = run.folder("resume")
    first = run.trainer(placement, checkpoint_dir=folder, checkpoint_every=2)
    with _shut_down_after(first):
        first.train(num_steps=4)
        before = first.apply_all_operators(_flat_parameters)[0]
    with _shut_down_after(run.trainer(placement, checkpoint_dir=folder, resume=True)) as second:
        after = second.apply_all_operators(_flat_parameters)[0]
        _expect(torch.equal(before, after), "the resumed weights differ from the saved ones")
        _finite_loss(second.train(num_steps=2))
    return "resumed at step 4 with the saved weights, then trained on"


def check_fsdp_snapshot(run: CheckRun, placement: Placement) -> str:
    """fsdp snapshots every step (copied from the device to host memory) and writes periodic
    checkpoints from a snapshot's copy; a lost worker's shards come back from its peer's copy of
    its snapshot. One worker alone has no peer: it comes back from the checkpoint written before
    the call (`train(checkpoint="auto")`), since the driver falls back only on a checkpoint it
    wrote or loaded."""
    rank = placement.num_workers - 1
    crash = run.crash("fsdp_snapshot", rank=rank, batch=3)
    trainer = run.trainer(
        placement,
        strategy="fsdp",
        snapshot_every=1,
        checkpoint_dir=run.folder("fsdp_snapshot/checkpoints"),
        checkpoint_every=2,
        # batch_idx counts within a call: the first call (2 steps) never reaches batch 3, the
        # second loses the worker at its batch 3, step 5 of the run.
        config={"crash": crash},
    )
    with _shut_down_after(trainer):
        trainer.train(num_steps=2)
        result = trainer.train(num_steps=6, max_retries=2, checkpoint="auto")
        _finite_loss(result)
        _expect(trainer.failures == 1, f"{trainer.failures} failures counted, expected 1")
        _expect(result["batch_count"] == 6, f"{result['batch_count']} steps of 6 trained")
        resize = [e for e in trainer.recovery_events if e.kind == "resize"][-1]
    return f"rank {rank} lost at step 5; state from {resize.source}, {resize.steps_redone} redone"


def check_get_model(run: CheckRun, placement: Placement) -> str:
    """get_model() on the driver: where the README says (the GPU on a driver with CUDA), the
    trained values, usable; to_cpu=True on the CPU."""
    with _shut_down_after(run.trainer(placement)) as trainer:
        trainer.train(num_steps=2)
        trained = trainer.apply_all_operators(_flat_parameters)[0]
        model = trainer.get_model()
        on_cpu = trainer.get_model(to_cpu=True)
    expected = "cuda" if placement.use_gpu and torch.cuda.is_available() else "cpu"
    device = next(model.parameters()).device
    _expect(device.type == expected, f"get_model() on {device}, expected {expected}")
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    _expect(torch.equal(flat, trained), "get_model()'s values are not rank 0's")
    _expect(model(torch.ones(3, FEATURES, device=device)).shape == (3, 1), "forward failed")
    _expect(
        all(p.device.type == "cpu" for p in on_cpu.parameters()), "to_cpu=True is not on the CPU"
    )
    return f"on {device}, rank 0's values, forward works; to_cpu=True on the CPU"


def check_ray_data(run: CheckRun, placement: Placement) -> str:
    """datasets={"train": ray.data...}: every batch reaches train_batch on the worker's device."""
    try:
        import pyarrow  # noqa: F401  (Ray Data's blocks: a slimmed Ray may lack it)
        import ray.data
    except ImportError as error:
        raise Skipped(f"Ray Data is not installed (raysgd[data]): {error}") from None
    ray.data.DataContext.get_current().enable_progress_bars = False
    dataset = ray.data.range(ROWS).map_batches(_ray_data_features)
    trainer = run.trainer(
        placement,
        datasets={"train": dataset},
        dataset_options=DatasetOptions(columns=("x", "y"), dtypes=torch.float32),
    )
    with _shut_down_after(trainer):
        result = trainer.train()
    _finite_loss(result)
    _expect(result["batch_on_device"] == 1.0, "some batches arrived off the worker's device")
    _expect(result["num_samples"] == ROWS, f"{result['num_samples']} rows of {ROWS} trained")
    kind = "cuda" if placement.use_gpu else "cpu"
    return f"{result['num_samples']} rows in {result['batch_count']} batches, all on {kind}"


def check_rng(run: CheckRun, placement: Placement) -> str:
    """Every rank's device generator (CUDA's on a GPU) is saved by save() and restored by load()."""
    path = os.path.join(run.folder("rng"), "checkpoint.pt")
    with _shut_down_after(run.trainer(placement)) as trainer:
        trainer.train(num_steps=2)
        saved = trainer.apply_all_workers(_generator_state)
        trainer.save(path)
        trainer.apply_all_workers(_advance_generator)
        moved = trainer.apply_all_workers(_generator_state)
        trainer.load(path)
        loaded = trainer.apply_all_workers(_generator_state)
    _expect(not all(map(torch.equal, saved, moved)), "drawing did not move the generators")
    _expect(
        all(map(torch.equal, saved, loaded)),
        "load() did not give the ranks the generators save() wrote",
    )
    kind = "CUDA" if placement.use_gpu else "CPU"
    return f"{len(saved)} ranks' {kind} generators restored by load()"


@dataclass(frozen=True)
class Check:
    """One row of the table: `run` returns the reason it passed, or raises."""

    name: str
    sharded: bool
    run: Callable[[CheckRun, Placement], str]


CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("ddp", False, check_ddp),
        Check("fsdp", True, check_fsdp),
        Check("fp16", False, check_fp16),
        Check("bf16", False, check_bf16),
        Check("killed_worker", False, check_killed_worker),
        Check("save_load", False, check_save_load),
        Check("resume", False, check_resume),
        Check("fsdp_snapshot", True, check_fsdp_snapshot),
        Check("get_model", False, check_get_model),
        Check("ray_data", False, check_ray_data),
        Check("rng", False, check_rng),
    )
}
