"""`strategy="fsdp"` end to end: same training as ddp, 1/N of the bytes per worker, sharded
checkpoints that load with another number of workers or strategy, and recovery from a lost worker.

All of it runs real FSDP2 (`fully_shard`) over gloo in Ray workers on the CPU, on a two-layer
transformer small enough that a trainer starts and trains in seconds.
"""

from __future__ import annotations

import os
import pickle
import shutil
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = pytest.mark.usefixtures("ray_local")

SAMPLES, SEQ, WIDTH, CLASSES = 64, 6, 16, 4
#: fsdp and ddp compute the same mean gradient with collectives that sum in another order.
LOSS_RTOL = 1e-4


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            WIDTH, 2, dim_feedforward=32, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class TransformerOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = TinyTransformer()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, SEQ, WIDTH, generator=gen)
        y = (x[:, 0, :CLASSES].argmax(dim=1)).long()
        self.x, self.y = x, y
        loader = DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss()
        )
        self.register_data(train_loader=loader, validation_loader=loader)


def _full_loss(operator: Any) -> float:
    """The loss over the whole data set on every worker (independent of how data is split)."""
    with torch.no_grad():
        return float(nn.functional.cross_entropy(operator.model(operator.x), operator.y))


FSDP_ARGS = {"shard_modules": nn.TransformerEncoderLayer}


def _trainer(num_workers: int, strategy: str = "fsdp", **kwargs: Any) -> TorchTrainer:
    return TorchTrainer(
        training_operator_cls=TransformerOperator,
        config={BATCH_SIZE: 16},
        num_workers=num_workers,
        strategy=strategy,
        strategy_args=FSDP_ARGS if strategy == "fsdp" else None,
        **kwargs,
    )


def _local_bytes(operator: Any) -> dict[str, int]:
    """Bytes of the parameters and optimizer state this worker holds (its shards under fsdp)."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = sum(size(p) for p in operator.model.parameters())
    optim = sum(
        size(v)
        for state in operator.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0  # Adam's step counters are scalars
    )
    return {"params": params, "optim": optim}


def test_sharded_checkpoint_loads_with_fewer_and_more_workers_and_other_strategies(
    tmp_path: Any,
) -> None:
    path, whole = str(tmp_path / "ckpt"), str(tmp_path / "whole.pt")
    trainer = _trainer(2)
    try:
        trainer.train()
        saved = trainer.save(path)
        expected = trainer.apply_all_operators(_full_loss)[0]
        # get_model() gathers the shards into a whole, plain model here: the same function.
        gathered = trainer.get_model()
        assert type(gathered).__name__ == "TinyTransformer"  # not an FSDP class
        assert all(
            type(p) is nn.Parameter and p.device.type == "cpu" for p in gathered.parameters()
        )
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, SEQ, WIDTH, generator=gen)
        with torch.no_grad():
            labels = x[:, 0, :CLASSES].argmax(dim=1)
            here = float(nn.functional.cross_entropy(gathered(x), labels))
        assert here == pytest.approx(expected, rel=LOSS_RTOL)
        # Validation counts every row once (no padded duplicate), so any number of workers and
        # any strategy give the same figures for the same weights.
        expected_val = trainer.validate()
        assert expected_val["num_samples"] == SAMPLES
        next_loss = trainer.train()["train_loss"]
        assert os.path.isfile(os.path.join(saved, ".metadata"))
        assert sorted(n for n in os.listdir(saved) if n.endswith(".distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        for num_workers, strategy in ((3, "fsdp"), (1, "none")):
            # half a CPU each: three more workers next to the first two on the 4-CPU test cluster
            if num_workers == 3:  # 5 rows each of the global batch of 16, and it says so
                with pytest.warns(UserWarning, match="global batch of 15"):
                    other = _trainer(num_workers, strategy, num_cpus_per_worker=0.5)
            else:  # rank 0 in this process: no worker process to start
                other = _trainer(num_workers, strategy, num_cpus_per_worker=0.5, use_local=True)
            try:
                other.load(path)
                assert other.apply_all_operators(_full_loss) == pytest.approx(
                    [expected] * num_workers, rel=LOSS_RTOL
                )
                val = other.validate()
                assert val["num_samples"] == SAMPLES
                for key in ("val_loss", "val_accuracy"):
                    assert val[key] == pytest.approx(expected_val[key], rel=LOSS_RTOL)
                if strategy == "none":
                    other.save(whole)  # the one-file format of ddp/none
                    # one worker with the whole global batch sees the same batches as two
                    assert other.train()["train_loss"] == pytest.approx(next_loss, rel=LOSS_RTOL)
                else:
                    assert other.train()["epoch"] == 2  # continues where the checkpoint was
            finally:
                other.shutdown()
        trainer.load(whole)  # a whole-model checkpoint back into fsdp shards
        assert trainer.apply_all_operators(_full_loss)[0] == pytest.approx(expected, rel=LOSS_RTOL)
        assert trainer.train()["train_loss"] == pytest.approx(next_loss, rel=LOSS_RTOL)
        _refuses_tampered_copies(trainer, path, tmp_path)
    finally:
        trainer.shutdown()


class _RunsCode:
    """A pickle that would run a shell command when un-pickled unsafely."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _refuses_tampered_copies(trainer: TorchTrainer, path: str, tmp_path: Any) -> None:
    """A checkpoint directory whose state file would run code, or whose data file is cut short,
    is refused in one line naming the file (no advice to load it unsafely); nothing runs, and
    the trainer keeps its weights and goes on."""
    marker = str(tmp_path / "code-ran")
    before = trainer.apply_all_operators(_full_loss)[0]

    def unsafe_state(file: str) -> None:
        with open(file, "wb") as handle:
            pickle.dump(_RunsCode(marker), handle)

    def cut_short(file: str) -> None:
        os.truncate(file, os.path.getsize(file) // 2)

    for name, spoil in (("raysgd_state.pt", unsafe_state), ("__0_0.distcp", cut_short)):
        bad = str(tmp_path / f"bad-{name}")
        shutil.copytree(path, bad)
        spoil(os.path.join(bad, name))
        with pytest.raises(ValueError) as info:
            trainer.load(bad)
        message = str(info.value)
        assert os.path.join(bad, name) in message, message
        assert "\n" not in message and "weights_only" not in message, message
    assert not os.path.exists(marker)
    assert trainer.apply_all_operators(_full_loss)[0] == pytest.approx(before, rel=LOSS_RTOL)
    assert trainer.train()["epoch"] >= 1


def test_bad_strategy_names_and_arguments_fail_before_workers_start() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'.*'ddp', 'fsdp', 'none'"):
        _trainer(1, "zero3")
    with pytest.raises(ValueError, match="bad strategy_args for strategy 'fsdp'"):
        TorchTrainer(
            training_operator_cls=TransformerOperator,
            strategy="fsdp",
            strategy_args={"shard": nn.Linear},
        )
    with pytest.raises(ValueError, match="shard_modules"):
        TorchTrainer(
            training_operator_cls=TransformerOperator,
            strategy="fsdp",
            strategy_args={"shard_modules": "Linear"},
        )
    with pytest.raises(ValueError, match="wrap_ddp=False"):
        TorchTrainer(training_operator_cls=TransformerOperator, strategy="fsdp", wrap_ddp=False)


def _first_time(path: str) -> bool:
    """True exactly once per marker path across all processes (O_EXCL create is atomic)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class ExitOnceOperator(TransformerOperator):
    """Rank 1 `os._exit`s mid-way through the second epoch, and both ranks mid-way through the
    third (each on the first attempt only)."""

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        step, marker = batch_info["global_step"], self.config["marker"]
        if step == 5 and self.world_rank == 1 and _first_time(marker):
            os._exit(1)
        if step == 9 and _first_time(f"{marker}-all-{self.world_rank}"):
            os._exit(1)
        return super().train_batch(batch, batch_info)


class PlainSGDOperator(TrainingOperator):
    """`Linear(1, 1)` with SGD without momentum: an optimizer that keeps no per-parameter state.
    Rank 1 `os._exit`s on the third step of the first attempt."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        x = torch.linspace(-1, 1, 16).unsqueeze(1)
        loader = DataLoader(TensorDataset(x, 3 * x + 1), batch_size=config[BATCH_SIZE])
        self.model, self.optimizer, self.criterion = self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=loader)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        marker = self.config.get("marker")
        if marker and batch_info["global_step"] == 2 and self.world_rank == 1:
            if _first_time(marker):
                os._exit(1)
        return super().train_batch(batch, batch_info)


def test_an_optimizer_without_state_saves_restores_and_recovers_under_fsdp(tmp_path: Any) -> None:
    # Plain SGD has nothing but its parameter groups (lr, ...) to save; a killed worker and a
    # checkpoint must still bring back the learning rate and the weights.
    def weights(operator: Any) -> list[float]:
        weight = float(operator.model.weight.detach().full_tensor())
        return [weight, float(operator.optimizer.param_groups[0]["lr"])]

    runs = {}
    # The clean run on one worker: the same global batch, so the same steps as on two.
    for marker, num_workers in ((None, 1), (str(tmp_path / "exited"), 2)):
        trainer = TorchTrainer(
            training_operator_cls=PlainSGDOperator,
            config={BATCH_SIZE: 4, "marker": marker},
            num_workers=num_workers,
            strategy="fsdp",
        )
        try:
            trainer.train(max_retries=1, checkpoint="auto")
            runs[marker is None] = trainer.apply_all_operators(weights)
            if marker:
                assert trainer.failures == 1 and os.path.exists(marker)
                path = trainer.save(str(tmp_path / "ckpt"))
                trainer.apply_all_operators(lambda op: op.optimizer.param_groups[0].update(lr=0.5))
                trainer.train()
                trainer.load(path)
                assert trainer.apply_all_operators(weights) == runs[False]
        finally:
            trainer.shutdown()
    # both workers hold the same weight and lr; recovery replays what training without it does
    assert runs[False][0] == runs[False][1] and runs[False][0][1] == 0.1
    assert runs[False][0][0] == pytest.approx(runs[True][0][0], rel=LOSS_RTOL)


def test_fsdp_trains_like_ddp_with_a_shard_per_worker_and_recovers_lost_workers(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # One ddp run is the reference; the fsdp run loses rank 1 mid-way through its second epoch and
    # both ranks in its third. With gradient accumulation (no sync on the first batch of two) and
    # clipping (a total norm over both workers' shards), fsdp must still compute what ddp computes.
    # Rank 1's shards come back from rank 0's in-memory replica of the last snapshot (one at the
    # end of every accumulation window here, so that at most the window in flight and the one
    # whose snapshot the loss interrupted are redone: 2 x 2 steps); when both die, a shard and its replica are lost together and the checkpoint written
    # at the start of the call is used.
    runs = {}
    for strategy, cls in (("ddp", TransformerOperator), ("fsdp", ExitOnceOperator)):
        trainer = TorchTrainer(
            training_operator_cls=cls,
            config={BATCH_SIZE: 16, "marker": str(tmp_path / "exited")},
            num_workers=2,
            strategy=strategy,
            strategy_args=FSDP_ARGS if strategy == "fsdp" else None,
            accumulate_grad_batches=2,
            clip_grad_norm=0.5,
            snapshot_every=1,
        )
        try:
            pids = trainer.apply_all_workers(os.getpid)
            results = [trainer.train(max_retries=2, checkpoint="auto") for _ in range(3)]
            # Every row of every epoch counted once, those before a restore included.
            assert [r["num_samples"] for r in results] == [SAMPLES] * 3
            losses = [r["train_loss"] for r in results]
            runs[strategy] = (losses, trainer.apply_all_operators(_full_loss)[0])
            runs[strategy + "_bytes"] = trainer.apply_all_operators(_local_bytes)
            if strategy == "fsdp":
                assert trainer.failures == 2 and trainer.num_workers == 2
                assert not set(trainer.apply_all_workers(os.getpid)) & set(pids)
                first, both = [e for e in trainer.recovery_events if e.kind == "resize"]
                assert "in-memory snapshot at step" in first.source and first.steps_redone <= 4
                assert "checkpoint" in both.source
                # Host memory: once committed, each worker keeps one snapshot, its own part and
                # its peer's.
                for held in trainer.apply_all_workers(_snapshots_kept):
                    assert len(held) == 1 and held[0][1] == [0, 1], held
        finally:
            trainer.shutdown()
    # the failures really happened
    assert all((tmp_path / name).exists() for name in ("exited", "exited-all-0", "exited-all-1"))
    assert caplog.text.count("in-memory snapshot was lost: restoring the last checkpoint") == 1
    (ddp_losses, ddp_final), (fsdp_losses, fsdp_final) = runs["ddp"], runs["fsdp"]
    assert ddp_losses[-1] < ddp_losses[0]  # it learns, so equal losses mean equal training
    assert fsdp_losses == pytest.approx(ddp_losses, rel=LOSS_RTOL)
    assert fsdp_final == pytest.approx(ddp_final, rel=LOSS_RTOL)
    full = runs["ddp_bytes"][0]
    for part in runs["fsdp_bytes"]:  # the replacement worker holds its half too
        for kind in ("params", "optim"):
            # dim-0 chunks: about half each, a row of a small tensor more or less
            assert 0.4 * full[kind] <= part[kind] <= 0.6 * full[kind]
    for kind in ("params", "optim"):
        assert sum(p[kind] for p in runs["fsdp_bytes"]) == full[kind]


def _snapshots_kept() -> list[tuple[int, list[int]]]:
    """On a worker: the snapshots it holds (step, the ranks whose parts it keeps)."""
    from raysgd._internal.worker.objects import worker_state

    snapshots = worker_state().snapshots
    snapshots.join()
    return [(g.step, sorted(g.parts)) for g in snapshots.held.values()]


def _model_type(operator: Any) -> str:
    return type(operator.model).__name__


def test_compile_trains_under_ddp_and_fsdp() -> None:
    # Dynamo's "eager" backend keeps this test quick (inductor's C++ compile takes minutes on two
    # cores); the wrapping order and the gradient-sync path are the same whatever the backend.
    losses = {}
    for strategy in ("ddp", "fsdp"):
        trainer = _trainer(2, strategy, compile=True, compile_args={"backend": "eager"})
        try:
            assert trainer.apply_all_operators(_model_type) == ["OptimizedModule"] * 2
            losses[strategy] = trainer.train()["train_loss"]
        finally:
            trainer.shutdown()
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=LOSS_RTOL)
