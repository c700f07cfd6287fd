"""raysgd-core alone (what a framework that embeds the worker pool installs: torch and Ray): a
group of two forms, all-reduces, loses a worker inside a collective and re-forms."""

import os
import tempfile
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from _smoke import import_every_module, report

from raysgd_core import WorkerDiedError, WorkerGroup, get_context, local_ray_options


def all_reduce_rank_plus_one(folder: str = "") -> float:
    """With `folder`, the rank marks there that it is entering the all-reduce."""
    t = torch.tensor([float(get_context().world_rank + 1)])
    if folder:
        Path(folder, f"entering-{get_context().world_rank}").touch()  # its existence is all
    dist.all_reduce(t)
    return t.item()


def rank_1_exits_in_a_collective(folder: str) -> float:
    if get_context().world_rank == 1:
        entered, deadline = Path(folder, "entering-0"), time.monotonic() + 120
        while not entered.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        # From its mark rank 0 runs a line into the all-reduce, which no marker can observe:
        # a second is ample on a loaded machine.
        time.sleep(1.0)
        os._exit(1)
    return all_reduce_rank_plus_one(folder)


def pid() -> int:
    return os.getpid()


ray.init(address="local", num_cpus=4, **local_ray_options())
# A loaded machine may start Ray's workers slowly: this smoke is about what is installed.
with WorkerGroup(num_workers=2, backend="gloo", start_timeout_s=120) as group:
    first = group.execute(all_reduce_rank_plus_one)
    before = group.execute(pid)
    with tempfile.TemporaryDirectory(prefix="smoke-core-") as marks:
        try:
            group.execute(rank_1_exits_in_a_collective, marks)
            died = None
        except WorkerDiedError as error:
            died = error.ranks
    recovery = group.recover(2, timeout_s=120)
    second = group.execute(all_reduce_rank_plus_one)
    after = group.execute(pid)
    world_size = group.world_size
ray.shutdown()

report(
    "raysgd_core",
    imported=import_every_module("raysgd_core"),
    first=first,
    died=died,
    path=recovery.path,
    kept={str(old): new for old, new in recovery.kept.items()},
    started=recovery.started,
    second=second,
    world_size=world_size,
    survivor_kept_its_process=after[0] == before[0],
    replacement_is_new=after[1] not in before,
)
