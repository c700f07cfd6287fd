"""raysgd_base.Registry: names, registration, lookup order, real entry points, building."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from raysgd_base import Registry, accepted_keywords, call_with_accepted

pytestmark = pytest.mark.timeout(30)

GROUP = "raysgd_base.testwidget"


class Widget:
    def __init__(self, size: int = 1) -> None:
        self.size = size


class Other(Widget):
    pass


def make_registry() -> Registry:
    return Registry("widget", GROUP, {"plain": Widget}, instance_type=Widget)


def install_plugin(site: Path, module: str, entry_points: str, source: str = "") -> None:
    """Lay out a distribution as pip installs it: the module and its *.dist-info."""
    (site / f"{module}.py").write_text(
        textwrap.dedent(
            source
            or """
            from test_registry_widgets import IMPORTS, Widget

            IMPORTS.append(__name__)

            class PluginWidget(Widget):
                pass

            READY = PluginWidget(size=9)
            NOT_A_FACTORY = 7
            """
        )
    )
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path that importlib.metadata scans like site-packages; the plugins
    import `Widget` from a module of their own name (this test module may load under another)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    widgets = type(sys)("test_registry_widgets")
    widgets.Widget = Widget  # type: ignore[attr-defined]
    widgets.IMPORTS = []  # type: ignore[attr-defined]  # each plugin module appends its name
    monkeypatch.setitem(sys.modules, "test_registry_widgets", widgets)
    return tmp_path


def test_names_are_case_insensitive_and_sorted() -> None:
    registry = make_registry()
    registry.register("  Fancy ", Other)
    assert registry.lookup("FANCY") is Other and registry.lookup("plain") is Widget
    assert registry.names() == ["fancy", "plain"] == registry.registered()
    assert "Fancy" in registry and "nope" not in registry and 3 not in registry


def test_registering_a_taken_name_needs_overwrite() -> None:
    registry = make_registry()
    with pytest.raises(ValueError, match=r"a widget named 'plain' is already registered"):
        registry.register("PLAIN", Other)
    registry.register("plain", Other, overwrite=True)
    assert registry.lookup("plain") is Other


def test_bad_names_and_factories() -> None:
    registry = make_registry()
    with pytest.raises(TypeError, match="name must be a str"):
        registry.register(3, Widget)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        registry.register("  ", Widget)
    with pytest.raises(TypeError, match="factory must be a widget class or a callable"):
        registry.register("x", "Widget")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        registry.lookup("")


def test_an_unknown_name_lists_the_available_ones() -> None:
    registry = make_registry()
    registry.register("fancy", Other)
    with pytest.raises(ValueError) as info:
        registry.lookup("Nope")
    assert str(info.value) == "unknown widget 'nope'; choose one of ['fancy', 'plain']"


def test_copies_are_independent() -> None:
    registry = make_registry()
    twin = registry.copy()
    twin.register("fancy", Other)
    assert "fancy" in twin and "fancy" not in registry
    assert (twin.kind, twin.group, twin.instance_type) == ("widget", GROUP, Widget)


def test_entry_points_are_listed_without_importing_and_loaded_once(site: Path) -> None:
    install_plugin(site, "rb_plugin_ok", f"[{GROUP}]\nPlug = rb_plugin_ok:PluginWidget\n")
    registry = make_registry()
    assert registry.names() == ["plain", "plug"]
    assert "plug" in registry
    assert "rb_plugin_ok" not in sys.modules  # listing and asking import nothing
    factory = registry.lookup("PLUG")
    assert factory.__name__ == "PluginWidget" and issubclass(factory, Widget)
    assert registry.lookup("plug") is factory
    assert sys.modules["test_registry_widgets"].IMPORTS == ["rb_plugin_ok"]  # imported once
    sys.modules.pop("rb_plugin_ok")


def test_registrations_win_over_entry_points(site: Path) -> None:
    install_plugin(site, "rb_plugin_shadow", f"[{GROUP}]\nplain = rb_plugin_shadow:PluginWidget\n")
    registry = make_registry()
    assert registry.names() == ["plain"]
    assert registry.lookup("plain") is Widget
    assert "rb_plugin_shadow" not in sys.modules


def test_an_uninstalled_plugin_is_gone_even_after_loading(site: Path) -> None:
    install_plugin(site, "rb_plugin_gone", f"[{GROUP}]\ngone = rb_plugin_gone:PluginWidget\n")
    registry = make_registry()
    registry.lookup("gone")
    sys.modules.pop("rb_plugin_gone")
    sys.path.remove(str(site))  # monkeypatch restores the whole sys.path afterwards
    with pytest.raises(ValueError, match="unknown widget 'gone'"):
        registry.lookup("gone")


def test_ready_instances_and_broken_entry_points(site: Path) -> None:
    install_plugin(
        site,
        "rb_plugin_mixed",
        f"[{GROUP}]\n"
        "ready = rb_plugin_mixed:READY\n"
        "seven = rb_plugin_mixed:NOT_A_FACTORY\n"
        "broken = rb_no_such_module_xyz:Thing\n",
    )
    registry = make_registry()
    assert registry.lookup("ready").size == 9
    sys.modules.pop("rb_plugin_mixed")
    with pytest.raises(TypeError, match=r"entry point 'seven' in group .*must name a widget"):
        registry.lookup("seven")
    with pytest.raises(ImportError, match=r"widget 'broken' \(entry point 'rb_no_such_module_xyz"):
        registry.lookup("broken")
    # Without instance_type a ready instance that is not callable is refused too.
    with pytest.raises(TypeError, match="'ready'"):
        Registry("widget", GROUP).lookup("ready")


def test_call_with_accepted_passes_what_the_signature_takes() -> None:
    offered = {"size": 4, "device": "cpu"}
    assert call_with_accepted(Widget, offered).size == 4
    assert isinstance(call_with_accepted(lambda: "bare", offered), str)
    assert call_with_accepted(lambda **kw: kw, offered) == offered
    assert call_with_accepted(dict, offered) == {}  # no readable signature: nothing is passed
    assert accepted_keywords(Widget) == ("size",)
    assert accepted_keywords(lambda a, *, b, **kw: None) == ("a", "b", "**kwargs")
    assert accepted_keywords(dict) is None
