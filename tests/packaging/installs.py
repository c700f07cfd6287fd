"""Clean installs of each published package, for the install smokes (`test_install_smoke.py`).

Each package is built into a wheel from its folder (never editable) and installed into a virtual
environment of its own that holds nothing but the package and what its `pyproject.toml` declares,
resolved by uv from PyPI: a missing dependency shows up there as it would for a user, where the
test suite's own environment (every package and all their extras) hides it.

Two things are pinned in every environment, by constraints only (a constraint adds no package):
torch, to the release the suite runs on and the file pip takes for it (a CPU build on this
project's machines: an unpinned torch would be a multi-GB CUDA build), and the raysgd packages, to
the wheels built from this checkout (a sibling that a package does not declare is not installed).

Cost: uv's cache keeps every download and unpacked wheel, and an environment is made of hard links
into it (about a second each, torch and Ray included), so the environments are made anew on every
run and never go stale; only the first run on a machine downloads (Ray, torch's dependencies,
the examples' libraries). The cache lives in `RAYSGD_INSTALL_SMOKE_CACHE`, else
`$XDG_CACHE_HOME/raysgd-install-smoke` (`~/.cache/...`); the environments of a run live beside it
(hard links need one file system) and are removed when the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGES = REPO / "packages"

#: Variables of the test process that must not reach a smoke: they would point it at the suite's
#: environment, its Ray cluster or other Python code.
_SCRUBBED = (
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "RAY_ADDRESS",
    "CONDA_PREFIX",
)


@dataclass(frozen=True)
class Package:
    """A published package of the monorepo."""

    folder: str  # packages/<folder>
    name: str  # its distribution name
    dependencies: tuple[str, ...]

    @property
    def path(self) -> Path:
        return PACKAGES / self.folder


def published_packages() -> dict[str, Package]:
    """Every package under packages/, by folder name."""
    found = {}
    for project_file in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(project_file.read_text())["project"]
        folder = project_file.parent.name
        found[folder] = Package(folder, project["name"], tuple(project.get("dependencies", [])))
    return found


def cache_root() -> Path:
    configured = os.environ.get("RAYSGD_INSTALL_SMOKE_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raysgd-install-smoke"


def uv_binary() -> str:
    """uv: the test environment's own (hatch.toml lists it), else the one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise RuntimeError("uv is needed for the install smokes: pip install uv") from None
        return found


def torch_requirement() -> str:
    """A direct requirement for the torch the suite runs on (`torch @ <url>`): the file pip takes
    for that release here (pip knows where this machine keeps its wheels; uv does not look
    there), remembered in the cache for as long as it exists."""
    version = metadata.version("torch").split("+")[0]
    remembered = cache_root() / f"torch-{version}.json"
    try:
        url = json.loads(remembered.read_text())["url"]
        parsed = urlparse(url)
        if parsed.scheme != "file" or Path(unquote(parsed.path)).is_file():
            return f"torch @ {url}"
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
             "--quiet", "--report", str(report), f"torch=={version}"],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        (chosen,) = json.loads(report.read_text())["install"]
    url = chosen["download_info"]["url"]
    remembered.parent.mkdir(parents=True, exist_ok=True)
    remembered.write_text(json.dumps({"url": url}))
    return f"torch @ {url}"


class Installs:
    """One run's wheels and environments (made in the background, asked for by package)."""

    def __init__(self, packages: dict[str, Package]) -> None:
        self.packages = packages
        self.root = cache_root()
        (self.root / "runs").mkdir(parents=True, exist_ok=True)
        _sweep_runs(self.root / "runs")
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.root / "runs"))
        self.uv = uv_binary()
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in _SCRUBBED},
            "UV_CACHE_DIR": str(self.root / "uv"),
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_PROGRESS": "1",
        }
        self.seconds: dict[str, float] = {}  # what each step took, for the report
        # Two at a time: the downloads overlap (uv also downloads in parallel within one install),
        # the machine has two cores and the suite's other test process wants one.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="install-smoke")
        self._wheels: Future[dict[str, Path]] = self._pool.submit(self._build_wheels)
        self._venvs: dict[str, Future[Path]] = {}

    def start(self, folders: list[str]) -> None:
        """Start making the environments of `folders`, in this order."""
        for folder in folders:
            self.venv_future(folder)

    def venv_future(self, folder: str) -> Future[Path]:
        if folder not in self._venvs:
            self._venvs[folder] = self._pool.submit(self._make_venv, self.packages[folder])
        return self._venvs[folder]

    def venv(self, folder: str, timeout_s: float) -> Path:
        """The environment of packages/<folder>, once made: the folder of the venv."""
        return self.venv_future(folder).result(timeout=timeout_s)

    def discard(self, folder: str) -> None:
        """Remove the environment of `folder` in the background (its smoke is done)."""
        future = self._venvs.get(folder)
        if future is not None and future.done() and future.exception() is None:
            self._pool.submit(shutil.rmtree, future.result(), ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        start = time.monotonic()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.seconds["clean-up"] = time.monotonic() - start
        # What each step took (wheels, each environment, each smoke), for whoever wonders.
        timings = {k: round(v, 2) for k, v in self.seconds.items()}
        (self.root / "last-run-seconds.json").write_text(json.dumps(timings, indent=1) + "\n")

    def _uv(self, *args: str, timeout_s: float = 600) -> None:
        done = subprocess.run(
            [self.uv, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def _build_wheels(self) -> dict[str, Path]:
        start = time.monotonic()
        out = self.run_dir / "wheels"
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(
                lambda p: self._uv("build", "--wheel", "--quiet", "--out-dir", str(out), str(p.path)),
                self.packages.values(),
            ))  # fmt: skip
        wheels = {}
        for package in self.packages.values():
            stem = package.name.replace("-", "_")
            (wheel,) = out.glob(f"{stem}-*.whl")
            wheels[package.name] = wheel
        # torch from the file the suite's pip takes; every sibling from this checkout's wheel.
        lines = [torch_requirement(), *(f"{name} @ {w.as_uri()}" for name, w in wheels.items())]
        (self.run_dir / "constraints.txt").write_text("\n".join(lines) + "\n")
        self.seconds["wheels"] = time.monotonic() - start
        return wheels

    def _make_venv(self, package: Package) -> Path:
        wheels = self._wheels.result()
        start = time.monotonic()
        venv = self.run_dir / "venvs" / package.folder
        python = getattr(sys, "_base_executable", None) or sys.executable
        self._uv("venv", "--quiet", "--python", python, str(venv))
        self._uv(
            "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
            "--constraint", str(self.run_dir / "constraints.txt"), str(wheels[package.name]),
        )  # fmt: skip
        self.seconds[package.folder] = time.monotonic() - start
        return venv

    def smoke_env(self, venv: Path) -> dict[str, str]:
        """The environment variables of a smoke run in `venv`: as a user's shell with it active."""
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        # uv installs no bytecode, so the first process to import torch and Ray in a new
        # environment compiles them (seconds of CPU). Each smoke starts several (its driver,
        # Ray's own, the workers): with bytecode writes allowed they compile once per
        # environment, not once per process, and Ray's start stays within its own timeouts on
        # a loaded machine.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(
            VIRTUAL_ENV=str(venv),
            PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            PYTHONNOUSERSITE="1",
            PYTHONUNBUFFERED="1",
            RAY_USAGE_STATS_ENABLED="0",
        )
        return env


def _sweep_runs(runs: Path) -> None:
    """Remove the folders of runs whose process is gone (a run killed before its clean-up)."""
    for run in runs.iterdir():
        pid = run.name.split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(run, ignore_errors=True)
        except PermissionError:
            pass
