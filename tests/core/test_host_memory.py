"""Workers keep the memory a step frees for the next step (glibc malloc thresholds)."""

from __future__ import annotations

import platform
import resource

import pytest

from raysgd_core import WorkerGroup
from raysgd_core._internal.host_memory import keep_freed_memory

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"),
]


def _page_faults_per_step() -> int:
    """Minor page faults per training step of a small CNN (batch 64, 32x32 images), one thread."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 32 * 32, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(3):  # the first steps map the memory for good
        step()
    # The count is the whole process's: Ray's own threads fault pages now and then too. The
    # quietest of a few windows is the steps' own.
    windows = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            step()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
    return min(windows)


def test_a_worker_does_not_fault_its_step_memory_back_in(ray_local):
    with WorkerGroup(1) as kept, WorkerGroup(1, keep_freed_memory=False) as default:
        faults_kept = kept.execute(_page_faults_per_step)[0]
        faults_default = default.execute(_page_faults_per_step)[0]
    # Measured: about 1,000 against 9,300 per step (the activations faulted back in each time).
    assert faults_kept * 3 < faults_default, (faults_kept, faults_default)


@pytest.mark.parametrize(
    ("name", "value"),
    [("MALLOC_TRIM_THRESHOLD_", "1048576"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")],
)
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False
