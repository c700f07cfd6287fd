"""RaySGD import paths (`raysgd`, `raysgd.torch`, `raysgd.utils`, `raysgd.integration.torch`), lazy
Tune, and a RaySGD 1.x-style script that only had its imports changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def test_import_paths():
    import raysgd
    import raysgd.integration.torch
    import raysgd.torch
    import raysgd.utils
    import raysgd_operator
    from raysgd import BATCH_SIZE, PyTorchTrainer, TorchTrainer, TrainingOperator, __version__
    from raysgd.torch import TorchTrainer as TorchTrainer2
    from raysgd.torch import TrainingOperator as TrainingOperator2
    from raysgd.utils import BATCH_SIZE as BATCH_SIZE2
    from raysgd.utils import AverageMeter, AverageMeterCollection

    assert TorchTrainer is TorchTrainer2 and TrainingOperator is TrainingOperator2
    assert TrainingOperator is raysgd_operator.TrainingOperator
    assert BATCH_SIZE == BATCH_SIZE2 == raysgd_operator.BATCH_SIZE
    assert issubclass(PyTorchTrainer, TorchTrainer)
    assert AverageMeter is raysgd_operator.AverageMeter
    assert AverageMeterCollection is raysgd_operator.AverageMeterCollection
    assert __version__ == raysgd.__version__
    for module in (raysgd, raysgd.torch, raysgd.utils, raysgd.integration.torch):
        assert module.__all__, module
    assert set(raysgd.torch.__all__) >= {
        "BaseTorchTrainable",
        "is_distributed_trainable",
        "distributed_checkpoint_dir",
        "PyTorchTrainable",
    }
    assert set(raysgd.integration.torch.__all__) == {
        "DistributedTrainableCreator",
        "distributed_checkpoint_dir",
        "is_distributed_trainable",
    }


def test_importing_raysgd_does_not_import_tune():
    code = (
        "import sys, raysgd, raysgd.torch, raysgd.utils, raysgd.integration.torch\n"
        "bad = [m for m in sys.modules if m.startswith(('ray.tune', 'raysgd_tune'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(30)
def test_tune_names_resolve_lazily():
    pytest.importorskip("raysgd_tune")
    import raysgd.integration.torch as integration
    import raysgd.torch as sgd_torch
    import raysgd_tune

    for name in ("is_distributed_trainable", "distributed_checkpoint_dir"):
        if not hasattr(raysgd_tune, name):
            pytest.skip(f"raysgd_tune has no {name} yet")
        assert getattr(sgd_torch, name) is getattr(raysgd_tune, name)
        assert getattr(integration, name) is getattr(raysgd_tune, name)
    with pytest.raises(AttributeError):
        sgd_torch.NoSuchName  # noqa: B018


# A RaySGD 1.x creator-style script in which only `ray.util.sgd` became `raysgd`. It starts no Ray
# itself (the trainer starts a local instance) and defines everything in `__main__`.
LEGACY_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    import torch.nn as nn

    from raysgd import TorchTrainer
    from raysgd.torch import TrainingOperator
    from raysgd.utils import BATCH_SIZE


    class LinearDataset(torch.utils.data.Dataset):
        def __init__(self, a, b, size=256):
            x = np.linspace(-1, 1, size, dtype=np.float32)
            self.x, self.y = torch.from_numpy(x), torch.from_numpy(a * x + b)

        def __getitem__(self, index):
            return self.x[index, None], self.y[index, None]

        def __len__(self):
            return len(self.x)


    def model_creator(config):
        return nn.Linear(1, 1)


    def optimizer_creator(model, config):
        return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))


    def scheduler_creator(optimizer, config):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)


    def data_creator(config):
        train = torch.utils.data.DataLoader(LinearDataset(2, 5), batch_size=config[BATCH_SIZE])
        val = torch.utils.data.DataLoader(LinearDataset(2, 5, 64), batch_size=config[BATCH_SIZE])
        return train, val


    operator = TrainingOperator.from_creators(
        model_creator=model_creator,
        optimizer_creator=optimizer_creator,
        data_creator=data_creator,
        scheduler_creator=scheduler_creator,
        loss_creator=nn.MSELoss,
    )
    trainer = TorchTrainer(
        training_operator_cls=operator,
        num_workers=2,
        use_gpu=False,
        config={"lr": 0.3, BATCH_SIZE: 32},
        backend="gloo",
        scheduler_step_freq="epoch",
    )
    for _ in range(6):
        stats = trainer.train()
    print(trainer.validate())
    model = trainer.get_model()
    print("trained weight: %.2f, bias: %.2f" % (model.weight.item(), model.bias.item()))
    trainer.shutdown()
    print("success!")
    """
)


@pytest.mark.timeout(150)
def test_raysgd_1x_style_script_runs(tmp_path):
    script = tmp_path / "train_example.py"
    script.write_text(LEGACY_SCRIPT)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "success!" in done.stdout
    assert "trained weight: 2.00, bias: 5.00" in done.stdout


def test_pytorch_trainer_accepts_0_8_arguments(ray_local, caplog):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from raysgd import BATCH_SIZE, PyTorchTrainer

    def data_creator(config):
        x = torch.randn(40, 1)
        return DataLoader(TensorDataset(x, x), batch_size=config[BATCH_SIZE])

    trainer = PyTorchTrainer(
        model_creator=lambda config: nn.Linear(1, 1),
        data_creator=data_creator,
        optimizer_creator=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        loss_creator=nn.MSELoss,
        num_replicas=2,
        batch_size=20,
    )
    try:
        assert trainer.num_workers == 2 and trainer.config[BATCH_SIZE] == 20
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [10, 10]
        with caplog.at_level("INFO", logger="raysgd"):
            assert trainer.train(checkpoint="auto")["num_samples"] == 40
        # Without a checkpoint_dir, "auto" wrote into a temporary folder, which it named...
        (scratch,) = [r.args[0] for r in caplog.records if "checkpoint='auto'" in r.getMessage()]
        assert os.path.isfile(os.path.join(scratch, "raysgd_checkpoint.pt"))
    finally:
        trainer.shutdown()
    assert not os.path.exists(scratch)  # ...and that shutdown() removed: nothing left in /tmp
    with pytest.raises(ValueError, match="num_replicas"):
        PyTorchTrainer(num_replicas=2, num_workers=2)


def test_metric_keys_of_ray_util_sgd_utils():
    """RaySGD's own tests index results with `NUM_SAMPLES` and `BATCH_COUNT` from
    `ray.util.sgd.utils`: the same names, values and meaning here."""
    import raysgd_operator
    from raysgd.utils import BATCH_COUNT, NUM_SAMPLES, AverageMeterCollection

    assert (NUM_SAMPLES, BATCH_COUNT) == ("num_samples", "batch_count")
    assert (NUM_SAMPLES, BATCH_COUNT) == (raysgd_operator.NUM_SAMPLES, raysgd_operator.BATCH_COUNT)
    meters = AverageMeterCollection()
    meters.update({"loss": 1.0}, n=4)
    meters.update({"loss": 4.0}, n=2)
    summary = meters.summary()
    assert summary[NUM_SAMPLES] == 6 and summary[BATCH_COUNT] == 2 and summary["loss"] == 2.0
    reduced = raysgd_operator.reduce_worker_results([summary, {**summary, BATCH_COUNT: 4}])
    assert reduced[NUM_SAMPLES] == 12 and reduced[BATCH_COUNT] == 3
