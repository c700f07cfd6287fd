"""Fixtures for the raysgd_operator tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The models here are tiny: one intra-op thread is fastest and does not fight other tests for
    the machine's cores. The previous setting is restored for whatever runs next."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
