"""Every trainer test also checks the run controller's phases: a transition outside its legal
graph (`driver.phases.LEGAL_NEXT`) is logged as an error, and fails the test that made it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _every_phase_transition_is_legal(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    illegal = [r.getMessage() for r in caplog.records if "which no path allows" in r.getMessage()]
    assert not illegal, illegal
