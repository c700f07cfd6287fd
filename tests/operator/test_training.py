"""Training loops through `OperatorRunner` in one process (world of 1): learning, metrics, num_steps."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import BATCH_SIZE, OperatorRunner, TrainingOperator


def linear_loaders(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    """y = 2x + 5 on x in [-1, 1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(256, 1, generator=gen) * 2 - 1
    y = 2 * x + 5
    batch = config.get(BATCH_SIZE, 32)
    return (
        DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True),
        DataLoader(TensorDataset(x[:64], y[:64]), batch_size=batch),
    )


def model_creator(config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def optimizer_creator(model: nn.Module, config: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.1))


class LinearOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        model = model_creator(config)
        optimizer = optimizer_creator(model, config)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss()
        )
        train, val = linear_loaders(config)
        self.register_data(train_loader=train, validation_loader=val)


def assert_learned_line(runner: OperatorRunner) -> None:
    (model,) = runner.get_models()
    assert model.weight.item() == pytest.approx(2.0, abs=0.15)
    assert model.bias.item() == pytest.approx(5.0, abs=0.1)


@pytest.mark.parametrize("style", ["operator", "creators"])
def test_learns_linear_function(style: str) -> None:
    if style == "operator":
        cls: type[TrainingOperator] = LinearOperator
    else:
        cls = TrainingOperator.from_creators(
            model_creator, optimizer_creator, linear_loaders, loss_creator=nn.MSELoss
        )
    runner = OperatorRunner(cls, {"lr": 0.1, BATCH_SIZE: 16})
    first = runner.validate()["val_loss"]
    for _ in range(20):
        runner.train_epoch()
    assert runner.validate()["val_loss"] < first / 100
    assert_learned_line(runner)
    assert runner.position.epoch == 20


def test_default_metric_keys_and_values() -> None:
    runner = OperatorRunner(LinearOperator, {BATCH_SIZE: 32})
    train = runner.train_epoch()
    assert set(train) == {
        "epoch",
        "batch_count",
        "num_samples",
        "train_loss",
        "last_train_loss",
        "loop_s",
        "samples_per_s",
    }
    assert (train["epoch"], train["batch_count"], train["num_samples"]) == (1, 8, 256)
    val = runner.validate()
    assert set(val) == {
        "batch_count",
        "num_samples",
        "val_loss",
        "last_val_loss",
        "val_accuracy",
        "last_val_accuracy",
    }
    assert (val["batch_count"], val["num_samples"]) == (2, 64)
    # The model outputs one column, so argmax is always 0 and no target (>= 5) equals it.
    assert val["val_accuracy"] == 0.0
    # val_loss is the sample-weighted mean of per-batch MSE, i.e. the MSE over the set here.
    (model,) = runner.get_models()
    x, y = runner.operator.validation_loader.dataset.tensors
    with torch.no_grad():
        assert val["val_loss"] == pytest.approx(
            nn.functional.mse_loss(model(x), y).item(), rel=1e-5
        )


class ScoreOperator(TrainingOperator):
    """Returns a custom metric: 1 on the first (size-3) batch, 0 on the later ones."""

    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0))
        data = torch.arange(float(config["n"])).unsqueeze(1)
        self.register_data(
            train_loader=DataLoader(data, batch_size=3),
            validation_loader=DataLoader(data, batch_size=3),
        )

    def train_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
        score = 1.0 if batch_info["batch_idx"] == 0 else 0.0
        if self.config.get("nan") and batch_info["batch_idx"] == 1:
            score = float("nan")
        return {"score": score, "num_samples": len(batch)}

    def validate_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
        return {"score": float(batch.sum()), "num_samples": len(batch)}


def test_custom_metrics_weighted_by_samples() -> None:
    runner = OperatorRunner(ScoreOperator, {"n": 10})  # batches of 3, 3, 3, 1
    result = runner.train_epoch()
    assert result["score"] == pytest.approx(3 / 10)
    assert result["last_score"] == 0.0
    assert (result["num_samples"], result["batch_count"]) == (10, 4)
    val = runner.validate()
    # Per-batch sums 3, 12, 21, 9 weighted by 3, 3, 3, 1.
    assert val["score"] == pytest.approx((3 * 3 + 12 * 3 + 21 * 3 + 9) / 10)


def test_nan_metric_gives_nan_mean_but_last_stays() -> None:
    result = OperatorRunner(ScoreOperator, {"n": 10, "nan": True}).train_epoch()
    assert math.isnan(result["score"])
    assert result["last_score"] == 0.0


class MeanOperator(TrainingOperator):
    """Reports the mean of each batch: the data is [0]*5 + [1]*5 with batches of one."""

    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Linear(1, 1)
        self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0))
        data = torch.tensor([0.0] * 5 + [1.0] * 5)
        self.register_data(
            train_loader=DataLoader(data, batch_size=1),
            validation_loader=DataLoader(data, batch_size=1),
        )

    def train_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
        return {"average": float(batch.mean()), "num_samples": len(batch)}

    validate_batch = train_batch


def test_num_steps_continuation_and_wrap_around() -> None:
    """RaySGD's test_num_steps: averages 0.5, 0, 1, 0.4, 5/7 at epochs 1, 2, 2, 3, 3."""
    runner = OperatorRunner(MeanOperator, {})
    expected = [(None, 0.5, 1), (5, 0.0, 2), (3, 1.0, 2), (5, 0.4, 3), (None, 5 / 7, 3)]
    for num_steps, average, epoch in expected:
        result = runner.train_epoch(num_steps=num_steps)
        assert result["average"] == pytest.approx(average)
        assert result["epoch"] == epoch
    for num_steps, average, _ in expected:
        result = runner.validate(num_steps=num_steps)
        assert result["average"] == pytest.approx(average)
        assert "epoch" not in result
    assert runner.position.epoch == 3


def test_batch_info_keys() -> None:
    seen: list[dict[str, Any]] = []

    class InfoOperator(MeanOperator):
        def train_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
            seen.append(dict(batch_info))
            return super().train_batch(batch, batch_info)

    runner = OperatorRunner(InfoOperator, {})
    runner.train_epoch(num_steps=2, info={"custom": 7})
    runner.train_epoch(num_steps=1)
    assert [(i["batch_idx"], i["global_step"]) for i in seen] == [(0, 0), (1, 1), (0, 2)]
    assert seen[0]["custom"] == 7 and "custom" not in seen[2]
    assert (seen[0]["num_steps"], seen[0]["__num_steps__"], seen[0]["epoch_idx"]) == (2, 2, 0)
    assert seen[0]["__use_fp16__"] is False


def test_num_steps_one_and_exact_epoch_end() -> None:
    runner = OperatorRunner(MeanOperator, {})
    assert runner.train_epoch(num_steps=1)["batch_count"] == 1
    assert runner.validate(num_steps=1)["batch_count"] == 1
    assert runner.train_epoch(num_steps=9)["epoch"] == 1
    # The epoch was used up exactly: a call without num_steps is a new, full epoch.
    result = runner.train_epoch()
    assert (result["epoch"], result["batch_count"]) == (2, 10)


@pytest.mark.parametrize("freq", ["batch", "epoch", "manual"])
def test_scheduler_step_frequencies(freq: str) -> None:
    class SchedOperator(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            self.register(
                models=model, optimizers=optimizer, criterion=nn.MSELoss(), schedulers=scheduler
            )
            self.register_data(train_loader=linear_loaders({BATCH_SIZE: 64})[0])

    runner = OperatorRunner(SchedOperator, {}, scheduler_step_freq=freq)
    for _ in range(2):
        runner.train_epoch()  # 4 batches per epoch
    steps = {"batch": 8, "epoch": 2, "manual": 0}[freq]
    assert runner.operator.scheduler.last_epoch == steps
    runner.update_scheduler(None)
    assert runner.operator.scheduler.last_epoch == steps + 1
    assert runner.operator.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 ** (steps + 1))


def test_scheduler_without_frequency_is_value_error() -> None:
    class SchedOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            self.register(
                models=model,
                optimizers=optimizer,
                schedulers=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1),
            )

    with pytest.raises(ValueError, match="scheduler_step_freq"):
        OperatorRunner(SchedOperator, {})
    with pytest.raises(ValueError, match="scheduler_step_freq"):
        OperatorRunner(SchedOperator, {}, scheduler_step_freq="sometimes")


def test_reduce_on_plateau_manual_update() -> None:
    class PlateauOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            self.register(models=model, optimizers=optimizer, schedulers=sched)

    runner = OperatorRunner(PlateauOperator, {}, scheduler_step_freq="manual")
    runner.update_scheduler(0.5)
    runner.update_scheduler(0.5)
    assert runner.operator.scheduler.last_epoch == 2


def test_profile_keys() -> None:
    runner = OperatorRunner(LinearOperator, {})
    assert "profile" not in runner.train_epoch()
    train = runner.train_epoch(profile=True)
    assert set(train["profile"]) == {
        "mean_fwd_s",
        "mean_grad_s",
        "mean_apply_s",
        "mean_train_epoch_s",
    }
    assert all(v > 0 for v in train["profile"].values())
    val = runner.validate(profile=True)
    assert set(val["profile"]) == {"mean_eval_fwd_s", "mean_validation_s"}


def test_tqdm_bar_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    runner = OperatorRunner(LinearOperator, {}, use_tqdm=True)
    runner.train_epoch()
    runner.train_epoch(num_steps=3)
    runner.validate()
    err = capsys.readouterr().err
    assert "8/8" in err and "3/3" in err and "2/2" in err
    assert "loss=" in err and "samples/s=" in err
    quiet = OperatorRunner(LinearOperator, {}, use_tqdm=True, world_rank=1)
    quiet.train_epoch()
    assert "batch" not in capsys.readouterr().err


def test_validate_without_validation_loader() -> None:
    class TrainOnly(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            super().setup(config)
            self.register_data(train_loader=linear_loaders(config)[0])

    runner = OperatorRunner(TrainOnly, {})
    with pytest.raises(ValueError, match="needs a validation loader"):
        runner.validate()
    assert runner.train_epoch()["num_samples"] == 256


def test_custom_loop_without_loaders_counts_epochs() -> None:
    class OwnData(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            self.calls = 0

        def train_epoch(self, iterator: Any, info: dict[str, Any]) -> dict[str, Any]:
            self.calls += 1
            return {"done": self.calls}

    runner = OperatorRunner(OwnData, {})
    assert [runner.train_epoch(num_steps=n)["epoch"] for n in (None, 1, None)] == [1, 2, 3]
    with pytest.raises(ValueError, match="needs a validation loader"):
        runner.validate()

    class NoData(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            super().setup(config)
            self.register_data()

    with pytest.raises(ValueError, match="needs a train loader"):
        OperatorRunner(NoData, {}).train_epoch()


def test_a_runner_without_a_train_loader_has_a_state_and_validates() -> None:
    class ValidateOnly(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            super().setup(config)
            self.register_data(validation_loader=linear_loaders(config)[1])

    runner = OperatorRunner(ValidateOnly, {})
    # What a worker's start asks for (the driver's copy of the state): position 0, no epoch open.
    assert runner.position.position_state() == {
        "epoch": 0,
        "position": 0,
        "epoch_rows": None,
        "in_epoch": False,
        "epoch_steps": 0,
        "step": 0,
        "global_step": 0,
        "trained_to": 0,
        "epoch_ended": 0,
    }
    state = runner.state.state_dict()
    assert (state["position"], state["in_epoch"], state["step"]) == (0, False, 0)
    runner.state.load_state_dict(state)
    assert runner.validate()["num_samples"] == 64
    with pytest.raises(ValueError, match=r"train\(\) needs a train loader"):
        runner.train_epoch()
    assert runner.position.position_state()["step"] == 0
    assert runner.validate()["num_samples"] == 64


def test_clip_grad_norm_option_limits_the_update() -> None:
    class BigStep(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
            self.register_data(train_loader=linear_loaders({})[0])

    for clip, bound in ((0.01, 0.01), (None, 1.0)):
        runner = OperatorRunner(BigStep, {}, clip_grad_norm=clip)
        params = list(runner.operator.model.parameters())
        before = torch.cat([p.detach().clone().flatten() for p in params])
        runner.train_epoch(num_steps=1)
        change = (torch.cat([p.detach().flatten() for p in params]) - before).norm().item()
        if clip is None:
            assert change > bound  # the unclipped gradient is large at the start
        else:
            assert change == pytest.approx(clip, rel=1e-4)


def test_accumulation_in_one_process_equals_big_batch() -> None:
    class Acc(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            torch.manual_seed(0)
            # Assigning before register must not hide what register returns (or wraps).
            self.model = nn.Linear(1, 1)
            self.register(
                models=self.model,
                optimizers=torch.optim.SGD(self.model.parameters(), lr=0.1),
                criterion=nn.MSELoss(),
            )
            x = torch.linspace(-1, 1, 16).unsqueeze(1)
            loader = DataLoader(TensorDataset(x, 2 * x + 5), batch_size=config["bs"])
            self.register_data(train_loader=loader)

    small = OperatorRunner(Acc, {"bs": 4}, accumulate_grad_batches=4)
    small.train_epoch()
    big = OperatorRunner(Acc, {"bs": 16})
    big.train_epoch()
    for a, b in zip(small.get_models()[0].parameters(), big.get_models()[0].parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert small.operator.global_step == 4 and small.operator.accumulate_grad_batches == 4
    assert "model" not in small.operator._assigned


def test_tqdm_without_a_terminal_redraws_rarely_and_ends_its_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Captured stderr is not a terminal (as in a log file or under Ray): each bar is drawn at its
    start and end only, and ends with a newline so that the next print starts a fresh line."""

    class SlowOperator(LinearOperator):
        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            import time

            time.sleep(0.15)  # longer than tqdm's default redraw interval
            return super().train_batch(batch, batch_info)

    runner = OperatorRunner(SlowOperator, {}, use_tqdm=True)
    runner.train_epoch()
    print("epoch table")
    out = capsys.readouterr()
    draws = [part for part in out.err.split("\r") if part.strip()]
    assert len(draws) <= 2, draws  # the empty bar and the finished one, not one per batch
    assert "8/8" in draws[-1] and out.err.endswith("\n")
    assert out.out == "epoch table\n"


def test_a_loop_that_counts_something_else_than_rows_is_told_apart() -> None:
    # After a lost worker the group's count of a call's rows stands in for num_samples; that is
    # right only where the batches counted rows, not tokens.
    class TokenCounting(LinearOperator):
        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            metrics = super().train_batch(batch, batch_info)
            metrics["num_samples"] = 7 * metrics["num_samples"]  # "tokens"
            return metrics

    rows = OperatorRunner(LinearOperator, {})
    rows.train_epoch()
    assert rows.counts_rows
    tokens = OperatorRunner(TokenCounting, {})
    result = tokens.train_epoch()
    assert not tokens.counts_rows
    assert result["num_samples"] == 7 * rows.train_epoch()["num_samples"]


class SelfScoringModel(nn.Module):
    """A model that computes its own loss when given the targets, as GPT trainers' do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x)
        return out, nn.functional.mse_loss(out, y)


def test_a_model_that_returns_its_own_loss_trains_without_a_criterion() -> None:
    class OwnLoss(LinearOperator):
        def setup(self, config: dict[str, Any]) -> None:
            torch.manual_seed(0)
            model = SelfScoringModel()
            self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
            train, validation = linear_loaders(config)
            self.register_data(train_loader=train, validation_loader=validation)

    runner = OperatorRunner(OwnLoss, {})
    first = runner.validate()["val_loss"]
    for _ in range(3):
        result = runner.train_epoch()
    assert result["num_samples"] == 256 and runner.validate()["val_loss"] < first / 4

    class Unscored(OwnLoss):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)  # returns predictions: without a criterion, no loss
            self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
            self.register_data(train_loader=linear_loaders(config)[0])

    with pytest.raises(
        RuntimeError, match=r"need a criterion .* or a model that takes the whole batch"
    ):
        OperatorRunner(Unscored, {}).train_epoch()
