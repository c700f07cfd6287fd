"""Which modules travel to the workers by value: decided by whether a worker can import them by name
from the same file, never by where the file lies."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from raysgd_core import WorkerGroup, shipped_by_value

pytestmark = pytest.mark.timeout(120)

_TRAIN_MODULE = '''
import torch
import torch.distributed as dist


def train_steps(steps: int) -> tuple[float, float]:
    """A few DDP steps of a linear regression; returns (first loss, last loss)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    t = torch.tensor([losses[-1]])
    dist.all_reduce(t)
    return losses[0], t.item() / dist.get_world_size()
'''


def _write_module(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_ray_torch_and_raysgd_are_never_shipped():
    for name in ("ray", "ray._private.worker", "torch", "torch.nn.functional", "raysgd_core.group"):
        importlib.import_module(name)
        assert shipped_by_value(name) is False, name
    assert shipped_by_value("__main__") is False  # cloudpickle ships it by value already
    assert shipped_by_value("json") is False  # stdlib
    assert shipped_by_value("not_imported_anywhere_xyz") is False


def test_module_from_a_folder_added_at_run_time_is_shipped_and_trains(
    ray_local, tmp_path, monkeypatch
):
    """The folder is on the driver's sys.path only: the workers cannot import the module, so its
    code goes by value, and the function from it trains on two ranks."""
    name = f"user_ship_{uuid.uuid4().hex[:8]}"
    _write_module(tmp_path / "runtime_libs", name, _TRAIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "runtime_libs"))
    module = importlib.import_module(name)
    try:
        assert shipped_by_value(name) is True
        with WorkerGroup(2) as group:
            results = group.execute(module.train_steps, 30)
        (first0, last0), (first1, last1) = results
        assert first0 == pytest.approx(first1)  # same seed, same data on both ranks
        assert last0 == pytest.approx(last1)
        assert last0 < first0 / 10  # it learned
    finally:
        sys.modules.pop(name, None)


def test_module_loaded_under_a_name_it_cannot_be_imported_by_is_shipped(tmp_path):
    path = _write_module(tmp_path, "plain_file", "VALUE = 3\n")
    name = f"user_alias_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    try:
        assert shipped_by_value(name) is True
    finally:
        sys.modules.pop(name, None)


def test_package_on_pythonpath_outside_site_packages_goes_by_reference(tmp_path):
    """A package installed outside site-packages but on PYTHONPATH (a --target install, a shared
    filesystem) is importable by name on every worker: it must not be shipped by value. A module of
    a folder added only at run time is, and Ray's own modules never are."""
    pkg = tmp_path / "target_install" / "shared_lib_pkg"
    _write_module(pkg, "__init__", "")
    _write_module(pkg, "layers", "def double(x):\n    return 2 * x\n")
    _write_module(tmp_path / "late", "late_mod", "X = 1\n")
    code = textwrap.dedent(
        f"""
        import sys
        import ray.util
        import shared_lib_pkg.layers
        sys.path.insert(0, {str(tmp_path / "late")!r})
        import late_mod
        from raysgd_core import shipped_by_value
        print([shipped_by_value(n) for n in
               ("shared_lib_pkg", "shared_lib_pkg.layers", "late_mod", "ray.util")])
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "target_install")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[False, False, True, False]"
