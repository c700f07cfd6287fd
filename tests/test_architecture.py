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
    """Every new worker of a replicated run (at start and on each recovery) imports the trainer's
    worker functions, its kind of state and the operator package; torch.distributed.checkpoint
    costs most of a second to import and only sharded runs and sharded checkpoints use it, so it
    must stay out of that path."""
    import subprocess
    import sys

    code = (
        "import sys, raysgd._internal.worker.calls, raysgd._internal.state.replicated, "
        "raysgd_operator; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _module_files() -> dict[str, Path]:
    """Every module of every package: dotted name -> file (a package is its `__init__.py`)."""
    modules = {}
    for source in PACKAGES.glob("*/src/*/**/*.py"):
        parts = source.relative_to(PACKAGES).parts  # <dir>/src/<package>/.../<file>.py
        name = list(parts[2:])
        name[-1] = name[-1].removesuffix(".py")
        if name[-1] == "__init__":
            name.pop()
        modules[".".join(name)] = source
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imports(name: str, source: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for each import in `source`, relative ones resolved."""
    tree = ast.parse(source.read_text(), str(source))
    skipped = _type_checking_only(tree)
    package = name if source.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in modules else (base, [alias.name]))
    return [(module, names) for module, names in found if module in modules]


def test_no_import_circle_between_modules() -> None:
    """No module imports itself through others, between two files of one package included.

    Every import statement counts, lazy ones inside functions too (a circle that only a lazy
    import keeps working is still two files that cannot be understood apart); imports under
    `if TYPE_CHECKING:` do not (they never run). `from pkg import name` is an edge to the module
    `pkg.name` when that is a module; else to the module `pkg/__init__.py` took `name` from when
    it re-exports it (so that a submodule using its package's public name is not a circle through
    the `__init__` that imports it), else to `pkg` itself.
    """
    modules = _module_files()
    raw = {name: _imports(name, source, modules) for name, source in modules.items()}
    # Where each package's __init__ takes the names it re-exports from.
    exported_from: dict[str, dict[str, str]] = {}
    for name, source in modules.items():
        if source.name == "__init__.py":
            exported_from[name] = {
                taken: module for module, names in raw[name] for taken in names if module != name
            }
    edges: dict[str, set[str]] = {}
    for name, found in raw.items():
        targets = set()
        for module, names in found:
            if not names:
                targets.add(module)
            for taken in names:
                targets.add(exported_from.get(module, {}).get(taken, module))
        edges[name] = targets - {name}

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# Inside the meta package's `_internal`: which folders (and top-level modules) each may import.
# The driver calls down into the workers' functions; the kinds of state (`state`: each with its
# driver's and its workers' half) sit between them, used by the driver, using the workers'
# machinery; the messages both sides exchange are in `protocol`; storage is shared; the worker
# side never reaches up into the kinds or the driver's.
INTERNAL_ALLOWED = {
    "driver": {"driver", "protocol", "state", "storage", "worker"},
    "state": {"state", "protocol", "storage", "worker"},
    "worker": {"worker", "protocol", "storage"},
    "storage": {"storage"},
    "protocol": {"storage"},
    "legacy": {"legacy", "driver", "protocol", "storage", "worker"},
}


def test_the_meta_packages_internal_folders_import_in_one_direction() -> None:
    root = PACKAGES / "raysgd" / "src" / "raysgd" / "_internal"
    wrong = {}
    for source in root.rglob("*.py"):
        part = source.relative_to(root).parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        allowed = INTERNAL_ALLOWED[part]
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "raysgd._internal."
            ):
                target = node.module.split(".")[2]
                if target not in allowed:
                    wrong.setdefault(str(source.relative_to(root)), []).append(node.module)
    assert not wrong, wrong


#: The calls that change the worker group's membership (`raysgd_core.WorkerGroup`).
GROUP_CHANGES = {"recover", "retire", "start_spares", "replace_spares_on", "await_spares"}


def test_only_the_run_controller_changes_the_group() -> None:
    """Every resize, spare started or replaced and worker retired goes through the run controller
    and its parts (the resizes, the growth, the moves), which enter its phases through it: a
    change's phase, its events and its losses are kept together."""
    root = PACKAGES / "raysgd" / "src" / "raysgd"
    driver = root / "_internal" / "driver"
    controller = {driver / f"{name}.py" for name in ("controller", "resize", "growth", "drains")}
    elsewhere, calls = {}, set()
    for source in root.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if source in controller:
                    calls.add(node.func.attr)
                elif node.func.attr in GROUP_CHANGES:
                    elsewhere.setdefault(str(source.relative_to(root)), []).append(node.lineno)
    assert not elsewhere, elsewhere
    # The check sees the controller's own calls, so it is not looking at nothing.
    assert calls >= GROUP_CHANGES


#: What tells the kinds of state or their checkpoint formats apart: the strategy's flag, the
#: format's names for them, and the tests of a checkpoint's shape.
KIND_QUESTIONS = {"sharded", "WHOLE", "SHARDED", "is_folder", "gathered_files", "read_sharded"}


def test_only_the_kinds_of_state_ask_which_kind_or_format() -> None:
    """Each kind of state (`_internal/state/`) owns both its halves and its checkpoint format; the
    driver, the workers' machinery and the trainer ask none of them which it is (the format's
    own module, `storage/format.py`, names the formats)."""
    root = PACKAGES / "raysgd" / "src" / "raysgd"
    internal = root / "_internal"
    sources = [root / "trainer.py", *(internal / "driver").glob("*.py")]
    sources += [*(internal / "worker").glob("*.py"), internal / "protocol.py"]
    asked = {}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else None
            )
            if name in KIND_QUESTIONS:
                asked.setdefault(str(source.relative_to(root)), []).append((name, node.lineno))
    assert not asked, asked
    # The check sees the kinds' own questions, so it is not looking at nothing.
    pick = (internal / "state" / "pick.py").read_text()
    assert "options.sharded" in pick and "is_folder" in pick


def test_every_checkpoint_the_run_writes_or_loads_goes_through_checkpoints() -> None:
    """`save()`, `load()`, `load_state_dict()`, "auto", a notice's checkpoint and `resume=True`
    all go through `Checkpoints` (`driver/checkpoints.py`), which finishes the periodic
    upload in flight first: nothing else asks the training state to write or load one."""
    root = PACKAGES / "raysgd" / "src" / "raysgd"
    schedule = root / "_internal" / "driver" / "checkpoints.py"
    calls = {"save", "load", "load_state_dict"}
    elsewhere, seen = {}, 0
    for source in [root / "trainer.py", *(root / "_internal" / "driver").glob("*.py")]:
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in calls
                and "_state" in ast.unparse(node.func.value)
            ):
                continue
            if source == schedule:
                seen += 1
            else:
                elsewhere.setdefault(str(source.relative_to(root)), []).append(node.lineno)
    assert not elsewhere, elsewhere
    assert seen >= 3  # the check sees Checkpoints' own calls
