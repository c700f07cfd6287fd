"""The package dependency arrows ARCHITECTURE.md draws, checked on the source (every import
statement, lazy ones inside functions included), so that a wrong-way import fails here at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
SIBLINGS = {
    "raysgd",
    "raysgd_core",
    "raysgd_amp",
    "raysgd_fault",
    "raysgd_operator",
    "raysgd_tune",
    "raysgd_examples",
}

# package -> (raysgd packages it may import, whether it may import Ray)
ALLOWED = {
    "raysgd_core": (set(), True),
    "raysgd_amp": (set(), False),
    "raysgd_fault": (set(), False),
    "raysgd_operator": ({"raysgd_amp"}, False),
    "raysgd_tune": ({"raysgd_core"}, True),
    "raysgd": (
        {"raysgd_core", "raysgd_amp", "raysgd_fault", "raysgd_operator", "raysgd_tune"},
        True,
    ),
}


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
        if bad:
            wrong[str(source.relative_to(PACKAGES))] = sorted(bad)
    assert not wrong, wrong


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
