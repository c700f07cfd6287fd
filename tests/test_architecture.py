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
