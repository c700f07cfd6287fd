"""Choosing a policy by name, by instance, by registration, and through a real entry point."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import raysgd_fault.registry as registry
from raysgd_fault import (
    Action,
    DefaultPolicy,
    ElasticPolicy,
    FailurePolicy,
    FailureStatus,
    NeverRetryPolicy,
    available_policies,
    get_policy,
    register_policy,
)


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registrations (and cached entry points) must not leak from one test into the next.
    monkeypatch.setattr(registry, "_registry", registry._registry.copy())


class HalfPolicy(FailurePolicy):
    """Always retries with half the wanted workers (a stand-in third-party policy)."""

    name = "half"

    def decide(self, status: FailureStatus):  # type: ignore[no-untyped-def]
        from raysgd_fault import Decision

        n = max(1, status.workers_wanted // 2)
        return Decision(Action.RETRY, num_workers=n, reason="half")


def test_builtin_names() -> None:
    assert isinstance(get_policy(), DefaultPolicy)
    assert isinstance(get_policy(None), DefaultPolicy)
    assert type(get_policy("default")) is DefaultPolicy
    assert isinstance(get_policy("  Never "), NeverRetryPolicy)
    elastic = get_policy("elastic", min_workers=3, max_attempts=4)
    assert isinstance(elastic, ElasticPolicy)
    assert elastic.min_workers(FailureStatus(0, 0, 4)) == 3 and elastic.max_attempts == 4
    assert {"default", "elastic", "never"} <= set(available_policies())


def test_instance_is_returned_as_is() -> None:
    policy = ElasticPolicy(min_workers=2)
    assert get_policy(policy) is policy
    with pytest.raises(TypeError, match="instance"):
        get_policy(policy, min_workers=3)


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown failure policy 'nope'") as info:
        get_policy("nope")
    assert "default" in str(info.value) and "elastic" in str(info.value)
    assert "never" in str(info.value)


def test_bad_types() -> None:
    with pytest.raises(TypeError, match="policy"):
        get_policy(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        get_policy("")
    with pytest.raises(TypeError, match="max_wait"):
        get_policy("default", max_wait=3)  # unknown kwarg reaches the factory


def test_register_policy() -> None:
    register_policy("half", HalfPolicy)
    assert isinstance(get_policy("HALF"), HalfPolicy)
    assert "half" in available_policies()
    with pytest.raises(ValueError, match="already registered"):
        register_policy("half", HalfPolicy)
    register_policy("half", lambda: NeverRetryPolicy(), overwrite=True)
    assert isinstance(get_policy("half"), NeverRetryPolicy)
    with pytest.raises(TypeError, match="factory"):
        register_policy("x", 42)  # type: ignore[arg-type]


def test_factory_must_return_a_policy() -> None:
    register_policy("broken", lambda: object())
    with pytest.raises(TypeError, match="not a FailurePolicy"):
        get_policy("broken")


def _install_plugin(root: Path, module: str, entry_points: str) -> None:
    """Lay out a minimal installed distribution: a module and its *.dist-info."""
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from raysgd_fault import Action, Decision, FailurePolicy

            class PluginPolicy(FailurePolicy):
                name = "plugin"

                def __init__(self, workers=1):
                    self.workers = workers

                def decide(self, status):
                    return Decision(Action.RETRY, num_workers=self.workers, reason="plugin says so")

            NOT_A_FACTORY = 7
            """
        )
    )
    info = root / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_entry_point_policy_is_found_and_loaded_lazily(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_plugin(
        tmp_path,
        "raysgd_fault_plugin_ok",
        "[raysgd.fault]\nplugin = raysgd_fault_plugin_ok:PluginPolicy\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "raysgd_fault_plugin_ok", raising=False)
    assert "plugin" in available_policies()
    assert "raysgd_fault_plugin_ok" not in sys.modules  # listing names imports nothing
    policy = get_policy("plugin", workers=3)
    assert type(policy).__name__ == "PluginPolicy"
    decision = policy.decide(FailureStatus(failures=1, max_retries=1, workers_wanted=4))
    assert (decision.action, decision.num_workers) == (Action.RETRY, 3)


def test_entry_point_that_is_not_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_plugin(
        tmp_path,
        "raysgd_fault_plugin_bad",
        "[raysgd.fault]\nbadplugin = raysgd_fault_plugin_bad:NOT_A_FACTORY\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="badplugin"):
        get_policy("badplugin")
