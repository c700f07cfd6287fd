"""Every example runs end to end, as a user would start it: `python -m raysgd_examples.<name>`.

Each one runs in its own subprocess, with `--smoke` so that it finishes in seconds. Most join the
test session's Ray cluster as a user joins a running one (`RAY_ADDRESS`, or `--address` where the
example takes it), which spares each the seconds of starting and stopping a cluster of its own; the
Tune examples start their own, sized for their trials, and run in the background meanwhile. The assertions check what the example
promises its reader: the demo's accuracy, the line's coefficients, the recovered failure, the files.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(240)

#: The Tune examples start Ray clusters of their own: they run one after the other in the
#: background while the other examples run in the tests, which leave this machine's cores idle
#: much of the time (process starts, a driver waiting for its workers). Each with its arguments
#: besides `--smoke`: one worker per trial where a trial's size is not what the test is about
#: (2-worker trials: tests/tune/test_trainable.py); tune_ddp's trials are a DDP group.
TUNE_EXAMPLES: dict[str, tuple[str, ...]] = {
    "tune_example": ("--num-workers", "1"),
    "tune_ddp": (),
    "pbt": ("--num-workers", "1"),
}


@pytest.fixture(scope="module")
def cluster(ray_local_module: None) -> str:
    """The address of the test session's Ray cluster, for the examples to join."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module", autouse=True)
def tune_outputs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[str]]]:
    """The `--smoke` output of each Tune example whose test this session selected, as a future;
    started with the module's first test (autouse)."""
    module = request.module.__name__
    selected = [item.name for item in request.session.items if item.module.__name__ == module]
    wanted = [n for n in TUNE_EXAMPLES if any(i.startswith(f"test_{n}_") for i in selected)]
    # They run beside this module's tests and the other test process (three Ray clusters on two
    # cores): a Tune example then takes up to three times as long as alone (a PBT smoke took
    # over 180 s in a full run), so the bound that stops a hung one is longer.
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield {
            name: pool.submit(run_example, name, "--smoke", *TUNE_EXAMPLES[name], timeout_s=360)
            for name in wanted
        }


def run_example(name: str, *args: str, address: str | None = None, timeout_s: float = 180) -> str:
    """Run `python -m raysgd_examples.<name> *args`; return its output, failing on a non-zero exit."""
    return run_python(["-m", f"raysgd_examples.{name}", *args], name, address, timeout_s)


def run_python(
    argv: list[str], name: str, address: str | None = None, timeout_s: float = 180
) -> str:
    """Run this interpreter with `argv`; return stdout and stderr together, failing on an error.

    With `address` the process joins that Ray cluster (`RAY_ADDRESS`), else it starts its own.
    Progress bars' carriage returns become line breaks, so that each printed row is a line.
    """
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    if address is not None:
        env["RAY_ADDRESS"] = address
    # A session of its own, so that a hung example can be stopped with everything it started.
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{name} did not finish in {timeout_s} s; output:\n{output[-4000:]}")
    output = output.replace("\r", "\n")
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}; output:\n{output[-6000:]}"
    return output


def number_after(label: str, output: str) -> float:
    """The last number printed right after `label` (e.g. "val_accuracy=")."""
    found = re.findall(re.escape(label) + r"\s*(-?[0-9.]+(?:e-?[0-9]+)?|nan)", output)
    assert found, f"{label!r} not in the output:\n{output[-4000:]}"
    return float(found[-1])


def assert_learned_line(output: str) -> None:
    """The example printed "learned y = a x + b" with a and b within 0.2 of y = 2x + 5."""
    match = re.search(r"learned y = (-?[0-9.]+) x \+ (-?[0-9.]+)", output)
    assert match, output[-4000:]
    assert float(match.group(1)) == pytest.approx(2.0, abs=0.2)
    assert float(match.group(2)) == pytest.approx(5.0, abs=0.2)


def test_demo_full_run_reaches_95_percent(tmp_path: Path, cluster: str) -> None:
    output = run_example("demo", "--out-dir", str(tmp_path), address=cluster)

    assert number_after("final validation accuracy:", output) >= 0.95
    # The table has a header and one row per epoch (10 by default).
    assert re.search(r"epoch\s+train_loss\s+val_loss\s+val_accuracy\s+samples/s", output)
    assert len(re.findall(r"^\s+10\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", output, re.M)) == 1
    # The checkpoint (a plain state dict, loadable without running code) and the TensorBoard
    # event file are where the demo says.
    assert str(tmp_path / "checkpoint.pt") in output
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 10
    assert len(state["models"]) == 1
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    # The model handed back by get_model() scores like the distributed validation did.
    assert number_after("scores", output) >= 0.95


def test_linear_learns_the_line(cluster: str) -> None:
    # One worker: the global batch and the steps are the same at any size; the 2-worker creator
    # style is tests/raysgd/test_trainer_training.py's.
    output = run_example("linear", "--smoke", "--num-workers", "1", address=cluster)

    assert_learned_line(output)


def test_ray_data_example_reads_every_row_each_epoch_and_learns_the_line(cluster: str) -> None:
    output = run_example("ray_data", "--smoke", "--address", cluster, address=cluster)

    # Each epoch is one pass over the Parquet file's 4096 rows, over both workers together.
    epochs = re.findall(r"^epoch (\d+): (\d+) rows, loss ([0-9.]+)", output, re.M)
    assert [(int(e), int(rows)) for e, rows, _ in epochs] == [(1, 4096), (2, 4096)], output[-4000:]
    assert float(epochs[1][2]) < float(epochs[0][2])
    assert_learned_line(output)


def test_fsdp_example_resumes_its_checkpoint_on_fewer_workers(cluster: str) -> None:
    output = run_example("fsdp", "--smoke", address=cluster)

    # The sharded checkpoint of 2 workers, loaded into 1, validates to the same numbers.
    metrics = [ast.literal_eval(line) for line in output.splitlines() if line.startswith("{")]
    resumed = [line for line in output.splitlines() if line.startswith("resumed: {")]
    assert metrics and len(resumed) == 1, output[-4000:]
    before, after = metrics[-1], ast.literal_eval(resumed[0].removeprefix("resumed: "))
    assert before["num_samples"] == after["num_samples"] > 0
    # bf16 compute over other batch shapes may round a near-tie the other way: one sample, not more.
    assert after["val_loss"] == pytest.approx(before["val_loss"], rel=1e-3)
    assert abs(after["val_accuracy"] - before["val_accuracy"]) <= 1 / before["num_samples"]


def test_transformer_lm_built_on_the_meta_device_holds_half_per_worker_and_learns(
    cluster: str,
) -> None:
    output = run_example("transformer_lm", "--smoke", address=cluster)

    # Each of the 2 workers holds half of every parameter: the whole model never existed there.
    assert "share of the parameters per worker: 0.50, 0.50" in output, output[-4000:]
    # Below a uniform guess over 128 characters (ln 128 = 4.85) after one epoch.
    assert number_after("train_loss=", output) < 4.5
    assert number_after("val_loss=", output) < 4.5
    assert "sample: 'def " in output


def test_lstm_lm_carries_each_workers_hidden_state_through_a_checkpoint(cluster: str) -> None:
    output = run_example("lstm_lm", "--smoke", address=cluster)

    assert "hidden state restored on every worker: True" in output, output[-4000:]
    assert "epoch 2 finished" in output
    assert number_after("train_loss=", output) < number_after("epoch 1: train_loss=", output)


def test_digits_trains_above_chance(cluster: str) -> None:
    output = run_example("digits", "--smoke", "--num-workers", "1", address=cluster)

    assert "epoch 2:" in output
    assert number_after("val_accuracy=", output) > 0.5


def test_dcgan_trains_two_models_and_draws_samples(tmp_path: Path, cluster: str) -> None:
    # --fp16: the custom loop's backward/step helpers under mixed precision (bf16 on CPU).
    output = run_example("dcgan", "--smoke", "--fp16", "--out-dir", str(tmp_path), address=cluster)

    assert "epoch 2:" in output
    for metric in ("loss_g=", "loss_d="):
        assert math.isfinite(number_after(metric, output))
    assert 0.0 <= number_after("D(real)=", output) <= 1.0
    assert (tmp_path / "dcgan_samples.png").stat().st_size > 0


def test_fault_demo_recovers_from_a_killed_worker(cluster: str) -> None:
    output = run_example("fault_demo", "--smoke", address=cluster)

    assert "rank 1" in output and "exiting at batch" in output
    assert number_after("failures survived:", output) == 1
    # Training went on with the full pool after the recovery, and still learned.
    assert "workers=2" in output
    assert number_after("val_accuracy=", output) > 0.5


def test_migrated_raysgd_script_runs_unchanged(cluster: str) -> None:
    output = run_example("migrate", "--smoke", "--num-workers", "1", "--address", cluster)

    assert "success!" in output
    assert number_after("trained weight:", output) == pytest.approx(2.0, abs=0.3)
    # The second trainer, loaded from the first one's checkpoint, validates to the same loss.
    val_losses = re.findall(r"'val_loss': ([0-9.e-]+)", output)
    assert "restored:" in output and len(val_losses) == 2
    assert float(val_losses[1]) == pytest.approx(float(val_losses[0]), rel=1e-5)


def test_migrate_only_changes_imports() -> None:
    # Located without being imported (importing it would pull in Ray and torch for nothing).
    source = Path(importlib.util.find_spec("raysgd_examples.migrate").origin).read_text()
    # The RaySGD 1.x imports are kept, commented, next to their replacements.
    for old, new in [
        ("from ray.util.sgd import TorchTrainer", "from raysgd import TorchTrainer"),
        (
            "from ray.util.sgd.torch import TrainingOperator",
            "from raysgd.torch import TrainingOperator",
        ),
        ("from ray.util.sgd.utils import BATCH_SIZE", "from raysgd.utils import BATCH_SIZE"),
    ]:
        assert f"#   {old}\n" in source
        assert f"\n{new}\n" in source
    assert "import ray.util.sgd" not in source


def test_tune_example_finds_a_best_config(tune_outputs: dict[str, Future[str]]) -> None:
    output = tune_outputs["tune_example"].result()

    assert len(re.findall(r"^trial: lr=", output, re.M)) == 2  # both points of the grid ran
    assert "best config:" in output
    assert 0.0 < number_after("val_accuracy=", output) <= 1.0


def test_tune_ddp_reports_and_checkpoints(tune_outputs: dict[str, Future[str]]) -> None:
    output = tune_outputs["tune_ddp"].result()

    assert 0.5 < number_after("mean_accuracy=", output) <= 1.0
    assert "checkpoint: Checkpoint(" in output


def test_pbt_runs_a_population(tune_outputs: dict[str, Future[str]]) -> None:
    output = tune_outputs["pbt"].result()

    # Synchronous PBT with two trials: at the perturbation point the worse one takes the better
    # one's trainer state (Tune logs the exploit), and both finish with results.
    assert "Cloning trial" in output
    assert len(re.findall(r"^trial: lr=", output, re.M)) == 2
    assert 0.0 < number_after("val_accuracy=", output) <= 1.0


def test_readme_example_runs(tmp_path: Path, cluster: str) -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    code = re.search(r"```python\n(.*?)```", readme.read_text(), re.S).group(1)
    checkpoint = tmp_path / "line.pt"
    script = tmp_path / "readme_example.py"
    script.write_text(code.replace('"/tmp/line.pt"', repr(str(checkpoint))))

    output = run_python([str(script)], "the README example", cluster)
    weight = re.search(r"tensor\(\[\[(-?[0-9.]+)\]\]", output)
    assert weight, output[-4000:]
    assert float(weight.group(1)) == pytest.approx(2.0, abs=0.2)
    assert checkpoint.stat().st_size > 0
