"""The per-batch hot path: metrics read once per call, persistent loader workers, pinned memory,
and models handed back on the CPU."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset, TensorDataset

from raysgd_operator import AverageMeterCollection, OperatorRunner, TrainingOperator
from raysgd_operator._internal.loaders import pin_for_device, rebuild_loader, should_pin
from raysgd_operator.runner import on_device

# -- metrics ----------------------------------------------------------------------------------


def _feed(values: list[dict[str, Any]], ns: list[int]) -> dict[str, Any]:
    meters = AverageMeterCollection()
    for metrics, n in zip(values, ns):
        meters.update(metrics, n=n)
    return meters.summary()


def test_tensor_metrics_summarise_exactly_like_numbers() -> None:
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(9, generator=gen, dtype=torch.float32) * 10
    counts = torch.randint(0, 5, (9,), generator=gen)
    ns = [3, 5, 1, 7, 2, 2, 8, 4, 6]
    as_numbers = [
        {"loss": loss.item(), "correct": c.item(), "flag": bool(c.item() > 2)}
        for loss, c in zip(losses, counts)
    ]
    as_tensors = [
        {"loss": loss.clone(), "correct": c.clone(), "flag": c > 2}
        for loss, c in zip(losses, counts)
    ]
    expected, got = _feed(as_numbers, ns), _feed(as_tensors, ns)
    # Bit-for-bit the same numbers, of the same Python types, in the same key order.
    assert list(got) == list(expected)
    assert got == expected
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}
    assert type(got["last_correct"]) is int and type(got["last_flag"]) is bool


def test_tensor_and_number_values_of_one_key_keep_batch_order() -> None:
    values = [{"m": torch.tensor(1.5)}, {"m": 2.5}, {"m": torch.tensor(4.0)}, {"m": 8.0}]
    got = _feed(values, [1, 1, 1, 1])
    assert got["m"] == (1.5 + 2.5 + 4.0 + 8.0) / 4
    assert got["last_m"] == 8.0 and type(got["last_m"]) is float


def test_long_calls_read_tensors_in_bounded_batches() -> None:
    meters = AverageMeterCollection()
    numbers = AverageMeterCollection()
    for i in range(2500):
        value = torch.tensor(float(i % 7), dtype=torch.float64)
        meters.update({"loss": value}, n=2)
        numbers.update({"loss": value.item()}, n=2)
    assert len(meters._pending.get("loss", [])) < 1024
    assert meters.summary() == numbers.summary()


class _Regression(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        x = torch.randn(40, 3)
        y = torch.randint(0, 2, (40,))
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
        )
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, y), batch_size=7),
            validation_loader=DataLoader(TensorDataset(x, y), batch_size=7),
        )


class _HostReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to Python (each waits for the device)."""

    READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(fn: Any) -> tuple[Any, int]:
    """``fn()``'s result and how many tensor values it brought to Python."""
    with _HostReads() as reads:
        result = fn()
    return result, reads.count


def test_default_loops_read_no_value_per_batch_and_report_the_same_numbers() -> None:
    # With every throughput key (rates and MFU come from counts and times, read from nothing).
    runner = OperatorRunner(_Regression, {}, flops_per_sample=12.0, peak_flops_per_s=1e12)
    reference = OperatorRunner(_Regression, {})
    # One batch, then two, then three (the epoch's 6): the reads must not grow with the batches.
    first, reads_1 = _host_reads(lambda: runner.train_epoch(num_steps=1))
    second, reads_2 = _host_reads(lambda: runner.train_epoch(num_steps=2))
    third, reads_3 = _host_reads(lambda: runner.train_epoch(num_steps=3))
    assert reads_2 == reads_3 <= 1
    assert [m["batch_count"] for m in (first, second, third)] == [1, 2, 3]
    runner.validate(num_steps=1)  # starts the pass (DataLoader draws its seed then)
    _, reads_1 = _host_reads(lambda: runner.validate(num_steps=1))
    val, reads_4 = _host_reads(lambda: runner.validate(num_steps=4))
    assert reads_4 == reads_1 <= 2 and val["batch_count"] == 4

    # What the loops reported before: every batch's loss read with item(), averaged in Python.
    op = reference.operator
    losses: list[tuple[float, int]] = []
    for x, y in op.components.loaders["train"]:
        op.optimizer.zero_grad()
        loss = op.criterion(op.model(x), y)
        loss.backward()
        op.optimizer.step()
        losses.append((loss.item(), len(y)))
    for got, part in zip((first, second, third), (losses[:1], losses[1:3], losses[3:])):
        total = 0.0
        for value, n in part:
            total += value * n
        assert got["train_loss"] == total / sum(n for _, n in part)
        assert got["last_train_loss"] == part[-1][0]
    total, accuracies = 0.0, []
    with torch.no_grad():
        batches = list(op.components.loaders["validation"])[2:]  # the last call's four batches
        for x, y in batches:
            out = op.model(x)
            total += op.criterion(out, y).item() * len(y)
            accuracies.append(((out.argmax(dim=1) == y).sum().item() / len(y), len(y)))
    assert val["val_loss"] == total / sum(len(y) for _, y in batches)
    acc_total = 0.0
    for value, n in accuracies:
        acc_total += value * n
    assert val["val_accuracy"] == acc_total / sum(n for _, n in accuracies)
    assert val["last_val_accuracy"] == accuracies[-1][0]
    assert all(type(v) is float for k, v in val.items() if k.startswith(("val", "last")))


# -- data loader workers ----------------------------------------------------------------------


class _Pids(Dataset):
    """Each item is the pid of the process that produced it (a DataLoader worker)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getpid()])


class _PidOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0))
        loader = DataLoader(
            _Pids(), batch_size=1, num_workers=1, persistent_workers=config["persistent"]
        )
        self.register_data(train_loader=loader)
        self.pids: list[int] = []

    def train_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
        self.pids.append(int(batch[0]))
        return {"num_samples": 1}


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_workers_survive_between_calls(persistent: bool) -> None:
    runner = OperatorRunner(_PidOperator, {"persistent": persistent})
    try:
        for _ in range(4):  # four calls of one batch: one epoch
            runner.train_epoch(num_steps=1)
        pids = runner.operator.pids
        assert len(set(pids)) == 1 and pids[0] != os.getpid()
        runner.train_epoch(num_steps=2)  # into the next epoch
        after = runner.operator.pids[4:]
        # Across epochs only a persistent loader keeps its worker (DataLoader's own rule).
        assert (set(after) == set(pids)) is persistent
    finally:
        runner.shutdown()


class _WorkerLoaded(TrainingOperator):
    """A regression whose loader has a worker process, split as a trainer splits it (a pass
    then resumes from its epoch's row)."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.MSELoss(),
        )
        data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
        loader = DataLoader(data, batch_size=2, num_workers=1)
        self.register_data(train_loader=rebuild_loader(loader, world_size=1, rank=0))


def test_a_pass_of_loader_workers_resumed_mid_epoch_says_its_draws_differ(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Resumed from its row, the pass skips the rows before it without drawing them: random
    # transforms inside the worker processes then differ from the run never interrupted.
    first = OperatorRunner(_WorkerLoaded, {})
    try:
        first.train_epoch(num_steps=2)
        state = first.state.state_dict()
    finally:
        first.shutdown()
    resumed = OperatorRunner(_WorkerLoaded, {})
    try:
        resumed.state.load_state_dict(state)
        with caplog.at_level(logging.WARNING, logger="raysgd_operator"):
            assert resumed.train_epoch()["num_samples"] == 4  # the epoch's last two batches
        (record,) = [r for r in caplog.records if "worker processes" in r.getMessage()]
        assert "num_workers=1" in record.getMessage()
    finally:
        resumed.shutdown()


# -- pinned memory ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_only_cuda_loaders_are_switched_to_pinned_memory() -> None:
    data = TensorDataset(torch.zeros(4, 1))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert should_pin(DataLoader(data), cuda)
    assert not should_pin(DataLoader(data), cpu)
    assert not should_pin(DataLoader(data, pin_memory=True), cuda)
    assert not should_pin([torch.zeros(1)], cuda)
    loader = DataLoader(data, batch_size=2)
    assert pin_for_device(loader, cpu) is loader and not loader.pin_memory
    assert pin_for_device(loader, cuda) is loader and loader.pin_memory
    # Still a working loader where CUDA is absent (DataLoader then skips the pinning).
    assert [b[0].shape[0] for b in loader] == [2, 2]


# -- get_models -------------------------------------------------------------------------------


def test_on_device_sees_any_tensor_off_the_cpu() -> None:
    assert not on_device(nn.Linear(2, 2))
    assert on_device(nn.Linear(2, 2, device="meta"))
    mixed = nn.BatchNorm1d(2)
    mixed.register_buffer("extra", torch.zeros(1, device="meta"))
    assert on_device(mixed)


def test_get_models_copies_to_cpu_only_when_needed() -> None:
    runner = OperatorRunner(_Regression, {})
    (live,) = runner.get_models()
    # A model already on the CPU is handed back as it is ...
    assert runner.get_models(cpu_if_on_device=True)[0] is live
    # ... and to_cpu still asks for a copy.
    (copied,) = runner.get_models(to_cpu=True, cpu_if_on_device=True)
    assert copied is not live
    assert torch.equal(copied.weight, live.weight) and copied.weight.device.type == "cpu"
