"""How long a TorchTrainer waits for its workers to be placed and started (RaySGD's
`SGD_PLACEMENT_GROUP_TIMEOUT_S`, default 100 s)."""

from __future__ import annotations

import pytest

from raysgd._internal.driver.arguments import DEFAULT_START_TIMEOUT_S, start_timeout
from raysgd_core import WorkerGroup


def test_default_is_raysgds_100_s_not_the_pools_30_s(monkeypatch):
    # Tune trials start several workers at once, each importing torch: on a busy machine that takes
    # longer than WorkerGroup's own 30 s default, and a trial then died with "Only 0 of 2 worker
    # actors started" although its placement group held every CPU it needed.
    monkeypatch.delenv("SGD_PLACEMENT_GROUP_TIMEOUT_S", raising=False)

    assert start_timeout() == {"start_timeout_s": 100.0}
    assert DEFAULT_START_TIMEOUT_S > WorkerGroup(1).start_timeout_s


def test_environment_variable_wins(monkeypatch):
    monkeypatch.setenv("SGD_PLACEMENT_GROUP_TIMEOUT_S", "7.5")

    assert start_timeout() == {"start_timeout_s": 7.5}
    assert WorkerGroup(1, **start_timeout()).start_timeout_s == 7.5


def test_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("SGD_PLACEMENT_GROUP_TIMEOUT_S", "soon")

    with pytest.raises(ValueError, match="SGD_PLACEMENT_GROUP_TIMEOUT_S must be seconds"):
        start_timeout()
