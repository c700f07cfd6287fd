"""The abort of a real NCCL group: a collective after it raises, and NCCL's watchdog leaves the
process alive (the environment raysgd sets for NCCL groups). One rank on one GPU, in a fresh
process; skipped without CUDA. What needs several GPUs (a peer blocked in a collective with a
rank that died) is not covered here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

_CHECK = """
import time
import torch
import torch.distributed as dist
from raysgd_core._internal import process_group as pg

pg.select_device(0)
store = pg.make_master_store("127.0.0.1", 1, 30.0)
port = int(store.port)
connections = pg.form_process_group(
    backend="nccl", host="127.0.0.1", port=port, rank=0, world_size=1, timeout_s=60.0,
    formation_timeout_s=30.0, master_store=store, store_endpoint=pg.store_endpoint("127.0.0.1", port),
)
print("env", pg.apply_nccl_env())
t = torch.ones(4, device="cuda:0")
dist.all_reduce(t)
torch.cuda.synchronize()
print("shut", connections.abort())
try:
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("after: returned")
except Exception as exc:
    print("after:", type(exc).__name__, str(exc)[:200])
time.sleep(8)  # the watchdog's turn to end the process, if it were going to
print("alive", pg.destroy_process_group())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an NCCL group needs a CUDA GPU")
@pytest.mark.timeout(120)
def test_an_aborted_nccl_group_raises_and_the_process_lives() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'TORCH_NCCL_ASYNC_ERROR_HANDLING': '2'" in out.stdout
    assert "shut 2" in out.stdout  # the rendezvous store's connection and the communicator
    assert "after: DistBackendError NCCL communicator was aborted" in out.stdout, out.stdout
    assert "alive True" in out.stdout
