"""Registration shapes, creators, multi-model operators and bad input."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import OperatorRunner, TrainingOperator


def tiny_loader(n: int = 8, batch_size: int = 4, inputs: int = 1) -> DataLoader:
    tensors = [torch.randn(n, 1) for _ in range(inputs)] + [torch.randn(n, 1)]
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size)


class IterableSGD(torch.optim.SGD):
    """An optimizer that defines __iter__ (RaySGD issue #14352's case); it is still one optimizer."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.param_groups)


class SequentialOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        model = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
        optimizer = IterableSGD(model.parameters(), lr=0.05)
        self.returned = self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
        # A target the network can learn (y = 3x + 1, from a fixed generator), so that the loss
        # falls whatever the global seed: random targets made the check a coin toss.
        inputs = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(inputs, 3 * inputs + 1)
        self.register_data(train_loader=DataLoader(data, batch_size=16))


def test_sequential_and_iterable_optimizer_are_one_object() -> None:
    runner = OperatorRunner(SequentialOperator, {})
    model, optimizer, criterion = runner.operator.returned
    assert isinstance(model, nn.Sequential) and isinstance(optimizer, IterableSGD)
    assert runner.operator.models is model and runner.operator.optimizers is optimizer
    assert isinstance(criterion, nn.MSELoss)
    losses = [runner.train_epoch()["train_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    assert len(runner.get_models()) == 1


@pytest.mark.parametrize("n_models", [1, 2])
@pytest.mark.parametrize("n_opts", [1, 2])
@pytest.mark.parametrize("n_scheds", [0, 1, 2])
def test_register_keeps_shapes(n_models: int, n_opts: int, n_scheds: int) -> None:
    class MatrixOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            models = [nn.Linear(1, 1) for _ in range(n_models)]
            opts = [torch.optim.SGD(models[0].parameters(), lr=0.1) for _ in range(n_opts)]
            scheds = [torch.optim.lr_scheduler.StepLR(o, 1) for o in opts[:n_scheds]]
            self.returned = self.register(
                models=models[0] if n_models == 1 else tuple(models),
                optimizers=opts[0] if n_opts == 1 else opts,
                schedulers=None
                if n_scheds == 0
                else (scheds[0] if n_scheds == 1 else tuple(scheds)),
            )

    op = OperatorRunner(MatrixOperator, {}, scheduler_step_freq="epoch").operator
    assert len(op.returned) == (3 if n_scheds else 2)
    models, opts = op.returned[:2]
    assert (
        isinstance(models, nn.Module)
        if n_models == 1
        else (type(models), len(models)) == (tuple, 2)
    )
    assert (
        isinstance(opts, torch.optim.Optimizer)
        if n_opts == 1
        else (type(opts), len(opts)) == (list, 2)
    )
    assert op.model is (models if n_models == 1 else models[0])
    if n_scheds:
        scheds = op.returned[2]
        assert op.schedulers is scheds if n_scheds == 1 else list(op.schedulers) == list(scheds)
    else:
        assert not hasattr(op, "scheduler")


class GANOperator(TrainingOperator):
    """Two models and two optimizers with a custom train_batch using the precision helpers."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(config.get("seed", 0))
        disc, gen = nn.Linear(2, 1), nn.Linear(3, 2)
        self.models, self.optimizers = self.register(
            models=(disc, gen),
            optimizers=(
                torch.optim.Adam(disc.parameters(), lr=0.01),
                torch.optim.Adam(gen.parameters(), lr=0.01),
            ),
        )
        self.register_data(train_loader=DataLoader(torch.randn(32, 2), batch_size=8))
        self.rounds = 0

    def train_batch(self, batch: torch.Tensor, batch_info: dict[str, Any]) -> dict[str, Any]:
        disc, gen = self.models
        opt_d, opt_g = self.optimizers
        bce = nn.BCEWithLogitsLoss()
        ones, zeros = torch.ones(len(batch), 1), torch.zeros(len(batch), 1)
        opt_g.zero_grad()
        with self.autocast():
            fake = gen(torch.randn(len(batch), 3))
            loss_g = bce(disc(fake), ones)
        self.backward(loss_g, opt_g)
        self.optimizer_step(opt_g)
        opt_d.zero_grad()
        with self.autocast():
            loss_d = (bce(disc(batch), ones) + bce(disc(fake.detach()), zeros)) / 2
        self.backward(loss_d, opt_d)
        self.clip_grad_norm(1.0, opt_d)
        self.optimizer_step(opt_d)
        self.rounds += 1
        return {"loss_g": loss_g.item(), "loss_d": loss_d.item(), "num_samples": len(batch)}

    def state_dict(self) -> dict[str, int]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rounds = state["rounds"]


def test_gan_two_models_state_round_trip(tmp_path: Any) -> None:
    runner = OperatorRunner(GANOperator, {})
    result = runner.train_epoch()
    assert {"loss_g", "loss_d", "last_loss_g", "last_loss_d"} <= set(result)
    path = tmp_path / "gan.pt"
    torch.save(runner.state.state_dict(), path)
    other = OperatorRunner(GANOperator, {"seed": 1})
    other.state.load_state_dict(torch.load(path, weights_only=True))
    assert other.operator.rounds == 4 and other.position.epoch == 1
    for a, b in zip(runner.get_models(), other.get_models()):
        for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
            assert torch.equal(pa, pb)
    assert len(other.get_models()) == 2
    opt_state = other.operator.optimizers[0].state_dict()["state"]
    assert opt_state[0]["step"].item() == 4


def test_multi_input_model() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(y)

    def data_creator(config: dict[str, Any]) -> tuple[DataLoader, None]:
        return tiny_loader(8, 4, inputs=2), None

    cls = TrainingOperator.from_creators(
        lambda config: TwoInputs(),
        lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        data_creator,
        loss_creator=lambda config: nn.MSELoss(),
    )
    runner = OperatorRunner(cls, {})
    result = runner.train_epoch(num_steps=1)
    assert (result["batch_count"], result["num_samples"]) == (1, 4)
    with pytest.raises(ValueError, match="validation loader"):
        runner.validate()


def test_creator_serializes_data_creation_under_a_lock() -> None:
    lock = os.path.join(tempfile.gettempdir(), ".raysgd_data.lock")

    def data_creator(config: dict[str, Any]) -> DataLoader:
        config["lock_seen"] = os.path.exists(lock)
        return tiny_loader()

    cls = TrainingOperator.from_creators(
        lambda c: nn.Linear(1, 1),
        lambda m, c: torch.optim.SGD(m.parameters(), lr=0.1),
        data_creator,
        loss_creator=nn.MSELoss,
    )
    runner = OperatorRunner(cls, {})
    assert runner.operator.config["lock_seen"] is True
    assert runner.train_epoch()["num_samples"] == 8


def test_from_creators_on_a_custom_operator_keeps_its_loop() -> None:
    def model_creator(config: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
        return nn.Linear(2, 1), nn.Linear(3, 2)

    def optimizer_creator(models: Any, config: dict[str, Any]) -> tuple[torch.optim.Optimizer, ...]:
        return tuple(torch.optim.Adam(m.parameters(), lr=0.01) for m in models)

    cls = GANOperator.from_creators(
        model_creator,
        optimizer_creator,
        lambda c: DataLoader(torch.randn(16, 2), batch_size=8),
        loss_creator=nn.BCELoss,
    )
    runner = OperatorRunner(cls, {})
    runner.operator.rounds = 0  # GANOperator.setup (replaced by the creators' setup) set it
    assert issubclass(cls, GANOperator)
    assert runner.train_epoch()["batch_count"] == 2
    assert isinstance(runner.operator.criterion, nn.BCELoss)


def _creators(**overrides: Any) -> dict[str, Any]:
    creators: dict[str, Any] = {
        "model_creator": lambda c: nn.Linear(1, 1),
        "optimizer_creator": lambda m, c: torch.optim.SGD(m.parameters(), lr=0.1),
        "data_creator": lambda c: tiny_loader(),
        "loss_creator": nn.MSELoss,
    }
    creators.update(overrides)
    return creators


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"data_creator": lambda c: (tiny_loader(), tiny_loader(), tiny_loader())},
            ValueError,
            "3 loaders",
        ),
        ({"model_creator": lambda c: "not a model"}, TypeError, "model_creator"),
        ({"optimizer_creator": lambda m, c: [1, 2]}, TypeError, "optimizer_creator"),
        ({"data_creator": lambda c: 42}, TypeError, "data_creator"),
    ],
)
def test_creators_returning_wrong_things(
    overrides: dict[str, Any], error: type, match: str
) -> None:
    cls = TrainingOperator.from_creators(**_creators(**overrides))
    with pytest.raises(error, match=match):
        OperatorRunner(cls, {})


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="model_creator"):
        TrainingOperator.from_creators("model", lambda m, c: None)
    with pytest.raises(TypeError, match="loss_creator"):
        TrainingOperator.from_creators(lambda c: None, lambda m, c: None, loss_creator=3)
    with pytest.raises(TypeError, match="TrainingOperator subclass"):
        OperatorRunner(nn.Linear, {})  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="setup"):
        OperatorRunner(TrainingOperator, {})
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        OperatorRunner(SequentialOperator, {}, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        OperatorRunner(SequentialOperator, {}, clip_grad_norm=-1.0)

    def registering(**kwargs: Any) -> type[TrainingOperator]:
        class Bad(TrainingOperator):
            def setup(self, config: dict[str, Any]) -> None:
                model = nn.Linear(1, 1)
                args = {"models": model, "optimizers": torch.optim.SGD(model.parameters(), lr=0.1)}
                self.register(**{**args, **kwargs})

        return Bad

    with pytest.raises(ValueError, match="ddp_args must be a dict"):
        OperatorRunner(registering(ddp_args=["x"]), {})
    with pytest.raises(ValueError, match="apex_args must be a dict"):
        OperatorRunner(registering(apex_args="O1"), {})
    with pytest.raises(TypeError, match="models must be"):
        OperatorRunner(registering(models=[nn.Linear(1, 1), "x"]), {})
    with pytest.raises(TypeError, match="optimizers must be"):
        OperatorRunner(registering(optimizers=[object()]), {})


def test_default_train_batch_needs_a_criterion() -> None:
    class NoLoss(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            model = nn.Linear(1, 1)
            self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
            self.register_data(train_loader=tiny_loader())

    with pytest.raises(RuntimeError, match="criterion"):
        OperatorRunner(NoLoss, {}).train_epoch()


def test_unregistered_attributes_say_what_to_do() -> None:
    class Empty(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            pass

    op = OperatorRunner(Empty, {}).operator
    with pytest.raises(AttributeError, match="register"):
        _ = op.model
    assert op.config == {} and op.world_size == 1 and op.device == torch.device("cpu")
    assert op.device_ids is None and op.use_gpu is False and op.use_fp16 is False


class Scaled(nn.Module):
    """A block whose own reset_parameters sets its child's weight its way (after the child's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.proj.weight, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Bare(nn.Module):
    """A module with a parameter of its own and no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _meta_operator(build: Any, init: Any = None) -> type[TrainingOperator]:
    class MetaOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            torch.manual_seed(0)
            with torch.device("meta"):
                model = build()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
            self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
            self.register_data(train_loader=tiny_loader(64, 16, inputs=1))

    if init is not None:
        MetaOperator.init_weights = init  # type: ignore[method-assign]
    return MetaOperator


def test_a_model_built_on_the_meta_device_gets_memory_and_its_layers_values() -> None:
    runner = OperatorRunner(
        _meta_operator(lambda: nn.Sequential(nn.Linear(1, 3), Scaled(), nn.Linear(3, 1))), {}
    )
    model = runner.operator.model
    assert all(not p.is_meta and p.device.type == "cpu" for p in model.parameters())
    # Each layer's own initialisation, the block's after its child's (innermost first).
    assert torch.equal(model[1].proj.weight, torch.full((3, 3), 0.5))
    assert model[0].weight.abs().max() <= 1.0 and model[0].weight.std() > 0
    # The optimizer steps the new parameters: training moves the loss.
    losses = [runner.train_epoch()["train_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    assert runner.operator.optimizer.param_groups[0]["params"][0] is model[0].weight


def test_init_weights_can_be_overridden_and_a_module_nothing_fills_is_named() -> None:
    def ones(self: Any, model: nn.Module) -> None:
        for p in model.parameters():
            p.fill_(1.0)

    runner = OperatorRunner(
        _meta_operator(lambda: nn.Sequential(Bare(), nn.Linear(3, 1)), ones), {}
    )
    assert all(torch.equal(p, torch.ones_like(p)) for p in runner.operator.model.parameters())
    with pytest.raises(ValueError, match=r"\['0'\] have parameters but no reset_parameters"):
        OperatorRunner(_meta_operator(lambda: nn.Sequential(Bare(), nn.Linear(3, 1))), {})
