"""Every package declares what it imports.

The install smokes (`test_install_smoke.py`) run each package in an environment of its own, but
only the code paths a smoke takes; an import in a function no smoke calls would still find its
library missing for a user only. So every import statement of a package's source (lazy ones inside
functions included) is checked here against its `pyproject.toml`: the distribution that provides
the module must be a dependency or an extra of the package itself, not merely something another
dependency happens to install (which may stop: Ray 2.60 no longer installs NumPy).
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

PACKAGES = Path(__file__).resolve().parents[2] / "packages"

#: Imports a package makes without declaring them, each guarded where it is made.
UNDECLARED = {
    # NVIDIA Apex is not on PyPI (the PyPI package `apex` is another project): use_fp16="apex"
    # imports it and raises ApexNotAvailableError, which says how to build it, when it is missing.
    ("amp", "apex"),
    # The GPU benchmark uses torchvision's ResNet-50 when it is installed, else a built-in copy.
    ("examples", "torchvision"),
    # The S3 side of the checkpoint benchmark runs moto's S3 server (a development tool, in
    # hatch.toml's environment), and boto3 with it.
    ("examples", "moto"),
    ("examples", "boto3"),
}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string."""
    return _normalise(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(folder: str) -> set[str]:
    project = tomllib.loads((PACKAGES / folder / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project.get("dependencies", [])}
    for extra in project.get("optional-dependencies", {}).values():
        names |= {_name(r) for r in extra}
    return names


def imported_roots(folder: str) -> dict[str, list[str]]:
    """Top-level modules the package's source imports (not its own, not the standard library),
    with the files that import each."""
    (source,) = (PACKAGES / folder / "src").iterdir()
    found: dict[str, list[str]] = {}
    for path in sorted(source.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root in sys.stdlib_module_names or root in ("__future__", source.name):
                    continue
                found.setdefault(root, []).append(str(path.relative_to(PACKAGES)))
    return found


@cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def providers(module: str) -> set[str]:
    """The distributions that provide a top-level module (raysgd's own by their naming rule)."""
    if module == "raysgd" or module.startswith("raysgd_"):
        return {_normalise(module)}
    return {_normalise(d) for d in _providers().get(module, [])}


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGES.glob("*/pyproject.toml")))
def test_every_import_is_declared(folder: str) -> None:
    names = declared(folder)
    missing = {}
    for module, files in sorted(imported_roots(folder).items()):
        if (folder, module) in UNDECLARED:
            continue
        dists = providers(module)
        assert dists, f"{module} (imported by {files[0]}) is not installed here: which is it?"
        if not dists & names:
            missing[module] = (sorted(dists), files[:3])
    assert not missing, (
        f"packages/{folder} imports what its pyproject.toml does not declare: {missing}"
    )


def test_the_undeclared_imports_are_still_made() -> None:
    # An entry of UNDECLARED that no source imports any more goes.
    for folder, module in UNDECLARED:
        assert module in imported_roots(folder), (folder, module)
