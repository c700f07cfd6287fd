"""What every install smoke shares. A smoke runs in a clean environment of one package (its own
script folder first on the path, so this module is found): it exercises the package, then prints
one line `SMOKE-RESULT {json}` that the test reads."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import sys
from importlib import metadata
from typing import Any


def distributions() -> list[str]:
    """The names of the distributions installed in this environment (normalised)."""
    return sorted(
        {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in metadata.distributions()}
    )


def import_every_module(package: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Import the package and every module in it (a module-level import of something that is not
    installed fails here); the names imported."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if info.name.startswith(skip):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def report(package: str, **values: Any) -> None:
    """Print the smoke's result: `values`, where the package was imported from, what is installed
    and which version of torch (None: not installed)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    values.update(
        module_file=importlib.import_module(package).__file__,
        prefix=sys.prefix,
        distributions=distributions(),
        torch=torch_version,
    )
    print("SMOKE-RESULT " + json.dumps(values, default=str), flush=True)
