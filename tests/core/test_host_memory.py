"""Workers keep the memory a step frees for the next step (glibc malloc thresholds)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from raysgd_core import WorkerGroup
from raysgd_core._internal import host_memory
from raysgd_core._internal.host_memory import keep_freed_memory

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"),
]


#: Minor page faults per training step of a small CNN (batch 64, 32x32 images), one thread: the
#: quietest of four windows of three steps, with glibc's defaults and then with the thresholds
#: set, printed by a fresh interpreter.
_STEPS = """
import resource
import torch
from torch import nn
from raysgd_core._internal.host_memory import keep_freed_memory
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
    nn.Flatten(), nn.Linear(32 * 32 * 32, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
def step():
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
def faults_per_step():
    for _ in range(3):  # the first steps map the memory for good
        step()
    windows = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            step()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
    return min(windows)
default = faults_per_step()
assert keep_freed_memory()
print(default, faults_per_step())
"""


def test_kept_memory_is_not_faulted_back_in_at_every_step():
    # A fresh interpreter's main thread, the call a worker makes as it starts: a Ray worker's
    # own threads fault pages of their own at random, which a whole-process count cannot tell
    # apart from the step's.
    done = subprocess.run(
        [sys.executable, "-c", _STEPS], capture_output=True, text=True, timeout=60, check=True
    )
    default, kept = (int(n) for n in done.stdout.split()[-2:])
    # Measured: 0 against 1,300 to 9,300 per step (the activations faulted back in each time).
    assert kept * 3 < default, (kept, default)


def test_workers_start_with_the_thresholds_unless_told_not_to(ray_local):
    def settings() -> bool:
        return host_memory.thresholds_set()

    with WorkerGroup(1) as kept, WorkerGroup(1, keep_freed_memory=False) as default:
        assert kept.execute(settings) == [True]
        assert default.execute(settings) == [False]


@pytest.mark.parametrize(
    ("name", "value"),
    [("MALLOC_TRIM_THRESHOLD_", "1048576"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")],
)
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False
