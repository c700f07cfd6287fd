"""Each published package, installed alone into a clean environment with only what it declares,
does its job there (`installs.py` says how the environments are made and cached).

The rest of the suite runs in one environment holding every package and all their extras, where a
dependency that a package uses but does not declare is always present. Here each smoke runs in
its package's own environment, in a process of its own (`smokes/smoke_<folder>.py`), and prints
what it measured; the tests check the numbers, what was installed, and that the code came from
that environment (a wheel, not this checkout).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.packaging.installs import Installs, published_packages

# A cold cache downloads Ray, torch's dependencies and the examples' libraries first.
pytestmark = pytest.mark.timeout(600)

SMOKES = Path(__file__).resolve().parent / "smokes"
PACKAGES = published_packages()
#: The environments in the order the tests use them: those without Ray first (their smokes take
#: seconds while the larger environments are made).
ORDER = ["base", "fault", "amp", "operator", "core", "tune", "raysgd", "examples"]
VENV_TIMEOUT_S = 540
SMOKE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def installs(request: pytest.FixtureRequest) -> Iterator[Installs]:
    """The run's environments, all made in the background from the module's first test on, those
    of the selected tests only."""
    module = request.module.__name__
    selected = {item.name for item in request.session.items if item.module.__name__ == module}
    wanted = [f for f in ORDER if f"test_{f}_installs_alone" in selected]
    installs = Installs(PACKAGES)
    installs.start(wanted)
    yield installs
    installs.close()


def run_smoke(installs: Installs, folder: str) -> dict[str, Any]:
    """Run smokes/smoke_<folder>.py in the package's environment (in a folder of its own, so
    nothing of this checkout is on its path); its SMOKE-RESULT, checked to come from there."""
    venv = installs.venv(folder, timeout_s=VENV_TIMEOUT_S)
    workdir = venv.parent / f"{folder}-cwd"
    workdir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), str(SMOKES / f"smoke_{folder}.py")],
        cwd=workdir,
        env=installs.smoke_env(venv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a hung smoke is stopped with all it started (Ray's processes)
    )
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the {folder} smoke did not finish in {SMOKE_TIMEOUT_S} s:\n{output[-6000:]}")
    finally:
        installs.seconds[f"smoke {folder}"] = time.monotonic() - start
    lines = [line for line in output.splitlines() if line.startswith("SMOKE-RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"the {folder} smoke exited {proc.returncode} in a clean install of "
        f"{PACKAGES[folder].name}:\n{output[-8000:]}"
    )
    result = json.loads(lines[-1].removeprefix("SMOKE-RESULT "))
    # The package ran from the environment's site-packages: installed from a wheel, not editable.
    assert Path(result["prefix"]).resolve() == venv.resolve()
    assert Path(result["module_file"]).resolve().is_relative_to(venv.resolve() / "lib"), result
    assert PACKAGES[folder].name in result["distributions"]
    installs.discard(folder)
    return result


def siblings(result: dict[str, Any]) -> set[str]:
    return {d for d in result["distributions"] if d.startswith("raysgd")}


def suite_torch() -> str:
    from importlib import metadata

    return metadata.version("torch")


def test_every_published_package_has_a_smoke() -> None:
    assert sorted(PACKAGES) == sorted(ORDER)
    for folder in ORDER:
        assert (SMOKES / f"smoke_{folder}.py").is_file(), folder
        assert f"test_{folder}_installs_alone" in globals(), folder


def test_base_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "base")

    # No dependencies at all: the environment holds raysgd-base and nothing else.
    assert result["distributions"] == ["raysgd-base"]
    assert result["fancy"] == 30 and result["plain"] == 4
    assert result["names"][:2] == ["fancy", "plain"]
    assert result["unknown"].startswith("unknown widget 'missing'; choose one of ['fancy', 'plain'")
    assert result["too_small"] == "num_workers must be a positive int (>= 1), got 0"
    assert result["wrong_type"] == ["WrongTypeError", True, True]


def test_fault_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "fault")

    # Pure decisions: neither torch nor Ray is installed.
    assert result["distributions"] == ["raysgd-base", "raysgd-fault"]
    assert result["torch"] is None
    action, workers, _, reason = result["decisions"]["default"]
    assert (action, workers) == ("RETRY", 3)  # min(4 wanted, 2 alive + 1 fitting)
    assert "1 failure(s)" in reason and "max_retries=3" in reason
    assert result["decisions"]["never"][0] == "GIVE_UP"
    assert result["over_budget"] == "GIVE_UP"  # 4 failures > max_retries=3
    assert result["unknown"].startswith("unknown failure policy 'nope'")


def test_amp_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "amp")

    assert siblings(result) == {"raysgd-base", "raysgd-amp"}
    assert "ray" not in result["distributions"]
    assert result["torch"] == suite_torch()
    trained = result["trained"]
    assert (trained["False"]["name"], trained["False"]["dtype"]) == ("full", "torch.float32")
    assert trained["False"]["autocast_dtype"] == "torch.float32"
    # use_fp16=True on a machine without CUDA: bf16 autocast, no loss scaling.
    for label in ("True", "bf16"):
        assert (trained[label]["name"], trained[label]["dtype"]) == ("bf16", "torch.bfloat16")
        assert trained[label]["autocast_dtype"] == "torch.bfloat16"
        assert trained[label]["steps"] == 30
    fp16 = trained["fp16-cpu"]
    assert (fp16["name"], fp16["autocast_dtype"]) == ("fp16", "torch.float16")
    assert fp16["state"], "fp16 keeps its loss scaler's state"
    assert 0 < fp16["steps"] <= 30  # a step with overflowing gradients is skipped
    for label, run in trained.items():
        assert run["last_loss"] < 0.5 * run["first_loss"], (label, run)
    is_import_error, message = result["apex"]
    assert is_import_error and "NVIDIA Apex" in message
    assert result["unknown"].startswith(
        "use_fp16 must be False, True, a Precision instance, or one"
    )


def test_operator_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "operator")

    # The training loop of one process needs no Ray and no other raysgd block than amp.
    assert siblings(result) == {"raysgd-base", "raysgd-amp", "raysgd-operator"}
    assert "ray" not in result["distributions"]
    assert result["torch"] == suite_torch()
    first, last = result["first"], result["last"]
    assert (first["epoch"], first["batch_count"], first["num_samples"]) == (1, 8, 256)
    assert (last["epoch"], last["num_samples"]) == (20, 256)
    assert last["train_loss"] < 0.01 * first["train_loss"]
    assert result["weight"] == pytest.approx(2.0, abs=0.1)
    assert result["bias"] == pytest.approx(5.0, abs=0.1)
    assert result["validation"]["num_samples"] == 256
    assert result["validation"]["val_loss"] < 0.01
    # The saved state, loaded into a new runner, validates to the same numbers.
    assert result["reloaded"]["val_loss"] == pytest.approx(result["validation"]["val_loss"])
    assert result["created_batches"] == 4
    assert result["created"][-1] < result["created"][0]


def test_core_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "core")

    assert siblings(result) == {"raysgd-base", "raysgd-core"}
    assert result["torch"] == suite_torch()
    # An embedding framework may have no NumPy (Ray does not install it): the group forms,
    # fails and re-forms without it.
    assert "numpy" not in result["distributions"]
    assert result["first"] == [3.0, 3.0]
    assert result["died"] == [1]
    assert result["path"] == "keep-healthy"
    assert result["kept"] == {"0": 0} and result["started"] == [1]
    assert result["second"] == [3.0, 3.0] and result["world_size"] == 2
    assert result["survivor_kept_its_process"] and result["replacement_is_new"]


def test_tune_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "tune")

    # Tune's adapters drive a worker pool of their own: no trainer, no training loop.
    assert siblings(result) == {"raysgd-base", "raysgd-core", "raysgd-tune"}
    assert result["torch"] == suite_torch()
    (trial,) = result["trials"]
    assert trial["scale"] == 10.0
    assert trial["sum"] == 30.0  # (rank 0 + 1) + (rank 1 + 1), times the trial's scale
    assert trial["world_size"] == 2 and trial["distributed"] is True
    assert trial["iterations"] == 2 and trial["checkpoint_step"] == "1"
    assert result["outside_a_trial"] is False


def test_raysgd_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "raysgd")

    # `pip install raysgd`: the trainer and its blocks, no extra.
    assert siblings(result) == {
        "raysgd",
        "raysgd-base",
        "raysgd-core",
        "raysgd-amp",
        "raysgd-operator",
        "raysgd-fault",
    }
    assert result["torch"] == suite_torch()
    first, last = result["first"], result["last"]
    assert (first["epoch"], first["num_samples"], last["epoch"]) == (1, 512, 4)
    assert last["train_loss"] < 0.1 * first["train_loss"]
    assert result["weight"] == pytest.approx(2.0, abs=0.2)
    assert result["bias"] == pytest.approx(5.0, abs=0.2)
    assert result["validation"]["num_samples"] == 512
    assert result["reloaded"]["val_loss"] == pytest.approx(result["validation"]["val_loss"])
    assert result["workers"] == 2
    # The Tune names need the extra, and say so.
    assert result["tune_names"] == [
        "raysgd.torch.BaseTorchTrainable needs raysgd-tune: pip install 'raysgd[tune]'",
        "PyTorchTrainable needs raysgd-tune: pip install 'raysgd[tune]'",
    ]


def test_examples_installs_alone(installs: Installs) -> None:
    result = run_smoke(installs, "examples")

    assert {"raysgd", "raysgd-tune", "raysgd-examples"} <= siblings(result)
    assert result["torch"] == suite_torch()
    assert "raysgd_examples.demo" in result["imported"]
    assert any(name.startswith("raysgd_examples.bench.") for name in result["imported"])
    # The digits: 1437 training and 360 validation images; two epochs of the CNN learn them.
    first, last = result["epochs"]
    assert (first["num_samples"], first["batch_count"]) == (1437, 23)
    assert last["train_loss"] < first["train_loss"]
    assert result["validation"]["num_samples"] == 360
    assert result["validation"]["val_accuracy"] > 0.8
