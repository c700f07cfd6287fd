"""The package dependency arrows ARCHITECTURE.md draws, checked on the source (every import
statement, lazy ones inside functions included), so that a wrong-way import fails here at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
SIBLINGS = {
    "raysgd",
    "raysgd_base",
    "raysgd_core",
    "raysgd_amp",
    "raysgd_fault",
    "raysgd_operator",
    "raysgd_tune",
    "raysgd_examples",
}

# package -> (raysgd packages it may import, whether it may import Ray). Every package may import
# raysgd_base, the leaf they all share; it imports none of them.
ALLOWED = {
    "raysgd_base": (set(), False),
    "raysgd_core": ({"raysgd_base"}, True),
    "raysgd_amp": ({"raysgd_base"}, False),
    "raysgd_fault": ({"raysgd_base"}, False),
    "raysgd_operator": ({"raysgd_base", "raysgd_amp"}, False),
    "raysgd_tune": ({"raysgd_base", "raysgd_core"}, True),
    "raysgd": (
        {
            "raysgd_base",
            "raysgd_core",
            "raysgd_amp",
            "raysgd_fault",
            "raysgd_operator",
            "raysgd_tune",
        },
        True,
    ),
}
# Packages that must not import torch either (no third-party import at all).
NO_TORCH = {"raysgd_base"}


def _imported_roots(source: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    siblings, ray_ok = ALLOWED[package]
    sources = list(PACKAGES.glob(f"*/src/{package}/**/*.py"))
    assert sources, package
    wrong = {}
    for source in sources:
        roots = _imported_roots(source)
        bad = (roots & SIBLINGS) - siblings - {package}
        if not ray_ok:
            bad |= roots & {"ray"}
        if package in NO_TORCH:
            bad |= roots & {"torch"}
        if bad:
            wrong[str(source.relative_to(PACKAGES))] = sorted(bad)
    assert not wrong, wrong


def test_the_base_package_declares_no_dependency() -> None:
    """raysgd-base is the leaf every package imports: it must install alone, pulling nothing."""
    import tomllib

    project = tomllib.loads((PACKAGES / "base" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "raysgd-base" and project["dependencies"] == []


def test_every_user_of_the_base_package_declares_it() -> None:
    """A package importing raysgd_base lists `raysgd-base==<version>` (one shared version)."""
    import tomllib

    missing = []
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        sources = pyproject.parent.glob("src/*/**/*.py")
        if project["name"] != "raysgd-base" and any(
            "raysgd_base" in _imported_roots(source) for source in sources
        ):
            if f"raysgd-base=={project['version']}" not in project["dependencies"]:
                missing.append(project["name"])
    assert not missing


def test_a_worker_imports_no_checkpoint_machinery_until_it_needs_it() -> None:
    """Every new worker (at start and on each recovery) imports the trainer's worker functions and
    the operator package; torch.distributed.checkpoint costs most of a second to import and only
    sharded runs and sharded checkpoints use it, so it must stay out of that path."""
    import subprocess
    import sys

    code = (
        "import sys, raysgd._internal.worker, raysgd_operator; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
