"""Fixtures for raysgd-amp: the Apex stand-in and a site directory holding a real entry point."""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PLUGIN_DIST = "raysgd_amp_testplugin-0.1.dist-info"


def _forget(prefix: str) -> dict[str, object]:
    """Remove `prefix` and its submodules from sys.modules; return what was there."""
    gone = {k: v for k, v in sys.modules.items() if k == prefix or k.startswith(prefix + ".")}
    for key in gone:
        del sys.modules[key]
    return gone


@pytest.fixture
def apex_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Make `import apex` find the stand-in in tests/amp/apex_standin (NVIDIA Apex can't be installed).

    Yields the stand-in `apex.amp` module; the real `sys.modules` entries come back afterwards.
    """
    saved = _forget("apex")
    monkeypatch.syspath_prepend(str(HERE / "apex_standin"))
    amp = importlib.import_module("apex.amp")
    yield amp
    _forget("apex")
    sys.modules.update(saved)


@pytest.fixture
def no_apex() -> Iterator[None]:
    """Make `import apex` fail as it does where Apex is not installed."""
    saved = _forget("apex")
    sys.modules["apex"] = None  # type: ignore[assignment]  # None here: `import apex` raises
    yield
    _forget("apex")
    sys.modules.update(saved)


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out like site-packages with one installed distribution whose
    `entry_points.txt` declares `static_scale` in group `raysgd.amp`."""
    site = tmp_path_factory.mktemp("site")
    shutil.copy(HERE / "plugin_src" / "raysgd_amp_testplugin.py", site)
    dist = site / PLUGIN_DIST
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: raysgd-amp-testplugin\nVersion: 0.1\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(
        "[raysgd.amp]\nstatic_scale = raysgd_amp_testplugin:StaticScalePrecision\n",
        encoding="utf-8",
    )
    return site


@pytest.fixture
def installed_plugin(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put `plugin_site` on sys.path so importlib.metadata finds the plugin's distribution."""
    monkeypatch.syspath_prepend(str(plugin_site))
    importlib.invalidate_caches()
    yield plugin_site
    sys.modules.pop("raysgd_amp_testplugin", None)
