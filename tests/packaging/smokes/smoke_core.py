"""raysgd-core alone (what a framework that embeds the worker pool installs: torch and Ray): a
group of two forms, all-reduces, loses a worker inside a collective and re-forms."""

import os
import time

import ray
import torch
import torch.distributed as dist
from _smoke import import_every_module, report

from raysgd_core import WorkerDiedError, WorkerGroup, get_context, local_ray_options


def all_reduce_rank_plus_one() -> float:
    t = torch.tensor([float(get_context().world_rank + 1)])
    dist.all_reduce(t)
    return t.item()


def rank_1_exits_in_a_collective() -> float:
    if get_context().world_rank == 1:
        time.sleep(0.5)  # rank 0 is in the all-reduce by now
        os._exit(1)
    return all_reduce_rank_plus_one()


def pid() -> int:
    return os.getpid()


ray.init(address="local", num_cpus=4, **local_ray_options())
# A loaded machine may start Ray's workers slowly: this smoke is about what is installed.
with WorkerGroup(num_workers=2, backend="gloo", start_timeout_s=120) as group:
    first = group.execute(all_reduce_rank_plus_one)
    before = group.execute(pid)
    try:
        group.execute(rank_1_exits_in_a_collective)
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
