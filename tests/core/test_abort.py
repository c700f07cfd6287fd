"""A failed rank releases every rank blocked in a collective, whatever the group's size.

With two workers the one survivor is the failed rank's neighbour and sees its connection close.
From three up, most survivors wait on ranks that are themselves waiting: only aborting the group
on every rank lets them out. Every test here holds a reference to the group on each worker, as a
DDP wrapper or FSDP's state does, so that destroying the group does not close its connections.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
from multiprocessing.synchronize import Barrier

import pytest
from tests._support.markers import entering, mark, wait_for, wait_for_peers

from raysgd_core import WorkerDiedError, WorkerError, WorkerGroup, get_context

pytestmark = pytest.mark.timeout(300)

# More workers than the shared cluster's CPUs would hold at one each. Six processes importing
# torch at once on two loaded cores have taken more than the default 30 s to come up.
_SIX = dict(num_cpus_per_worker=0.5, start_timeout_s=120)


class StepError(ValueError):
    """A user error raised by one rank (shipped by value)."""


def _hold_group_then_all_reduce(bound_s: float = 0.0, folder: str = "") -> float:
    """An all_reduce of ones; with `folder`, marks `entering` there first."""
    import torch
    import torch.distributed as dist

    from raysgd_core import set_collective_timeout

    get_context().store["held"] = dist.group.WORLD
    if bound_s:
        set_collective_timeout(bound_s)
    t = torch.ones(1)
    if folder:
        entering(folder)
    dist.all_reduce(t)
    return t.item()


def _rank_raises(victim: int, folder: str) -> float:
    if get_context().world_rank == victim:
        wait_for_peers(folder)  # the others are inside the all_reduce
        raise StepError("rank failed outside any collective")
    return _hold_group_then_all_reduce(folder=folder)


def _rank_exits(victim: int, folder: str) -> float:
    if get_context().world_rank == victim:
        wait_for_peers(folder)
        os._exit(1)
    return _hold_group_then_all_reduce(folder=folder)


def _rank_exits_before_a_subgroup(victim: int, folder: str) -> None:
    import torch.distributed as dist

    get_context().store["held"] = dist.group.WORLD
    if get_context().world_rank == victim:
        wait_for_peers(folder)  # the others are waiting for its address
        os._exit(1)
    entering(folder)
    # Every rank makes the subgroup (torch asks it); its members wait for each other's address.
    dist.new_group(ranks=[0, victim], timeout=datetime.timedelta(seconds=60))


def _rank_stops_others_staggered(victim: int, bound_s: float, step_s: float, folder: str) -> float:
    ctx = get_context()
    if ctx.world_rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent: alive, connections open, never answers
    # The ranks' bounds run out one after another, `step_s` apart: the last ones would still be
    # waiting when the first one gives up. They all enter the collective together (each waits
    # for the others' marks) rather than staggered by sleeps, so that every rank is surely
    # inside it when the first bound runs out however slow the machine.
    waiting = [r for r in range(ctx.world_size) if r != victim]
    mark(folder, f"ready-{ctx.world_rank}")
    wait_for(folder, [f"ready-{r}" for r in waiting])
    return _hold_group_then_all_reduce(bound_s + step_s * ctx.world_rank)


def _pids(group: WorkerGroup) -> list[int]:
    return [w.pid for w in group.workers]


def test_a_silent_rank_a_user_error_and_crashes_release_every_waiting_rank_keeping_survivors(
    ray_local, tmp_path
):
    # One group of six, shrinking by one rank per scenario: 6 (a silent rank), 5 (a user error,
    # then a crash), 4 (a crash before a subgroup). A grace far shorter than the collectives' and
    # the subgroup's timeouts: a rank still blocked after it would be killed as stuck. 10 s rather
    # than a few: six ranks on two loaded cores, and Ray reporting the crash, can take seconds (a
    # user error caps it at 5 s anyway, as a peer's timed-out collective does).
    with WorkerGroup(6, peer_grace_s=10, **_SIX) as group:
        pids = _pids(group)

        # A silent rank 2 of 6. The first rank to wait out its bound names the silent one; the
        # others are let go at once rather than each waiting out a bound of its own (the last
        # would be killed as silent too). Rank r's bound is 4 + 1.5 r s, from a common start:
        # rank 0's runs out first, when every rank is in the collective; without the abort,
        # ranks 4 and 5 would wait 6 s and 7.5 s longer, past the 5 s the others are given once
        # a peer timed out.
        with pytest.raises(WorkerDiedError) as died:
            group.execute(_rank_stops_others_staggered, 2, 4.0, 1.5, str(tmp_path / "silent"))
        assert died.value.ranks == [2] and died.value.silent == [2], "silent rank: who was lost"
        report = group.recover(5, timeout_s=60)
        assert report.kept == {0: 0, 1: 1, 3: 2, 4: 3, 5: 4}, "silent rank: who was kept"
        pids = pids[:2] + pids[3:]
        assert _pids(group) == pids, "silent rank: survivors' processes"

        # A user error on rank 3 of 5: every waiting rank is let go, none is lost.
        with pytest.raises(WorkerError) as info:
            group.execute(_rank_raises, 3, str(tmp_path / "raises"))
        assert info.value.rank == 3 and isinstance(info.value.__cause__, StepError), "user error"
        assert info.value.lost_ranks == [], "user error: a rank was lost"
        report = group.recover(5, timeout_s=60)
        assert report.kept == {r: r for r in range(5)} and report.started == [], "user error"
        assert _pids(group) == pids, "user error: survivors' processes"
        assert group.execute(_hold_group_then_all_reduce) == [5.0] * 5, "user error: group"

        # Rank 3 of 5 crashes: ranks 0 and 1, nobody's neighbour of it, are let go too.
        with pytest.raises(WorkerDiedError) as died:
            group.execute(_rank_exits, 3, str(tmp_path / "exits"))
        assert died.value.ranks == [3] and died.value.silent == [], "crash: who was lost"
        report = group.recover(4, timeout_s=60)
        # Every survivor kept: none was still blocked when the grace ran out.
        assert report.kept == {0: 0, 1: 1, 2: 2, 4: 3} and report.lost == [3], "crash: kept"
        assert _pids(group) == pids[:3] + pids[4:], "crash: survivors' processes"
        assert group.execute(_hold_group_then_all_reduce) == [4.0] * 4, "crash: group"

        # Rank 2 of 4 (not rank 0's neighbour) crashes before it joins a subgroup the others
        # are making: rank 0 waits for its address in the rendezvous store, not in a collective.
        # The abort lets it out too.
        with pytest.raises(WorkerDiedError) as died:
            group.execute(_rank_exits_before_a_subgroup, 2, str(tmp_path / "subgroup"))
        assert died.value.ranks == [2], "subgroup: who was lost"
        report = group.recover(3, timeout_s=60)
        assert report.kept == {0: 0, 1: 1, 3: 2} and report.lost == [2], "subgroup: kept"


# ---------------------------------------------------------------------- gloo's connections
def _form_and_abort(
    rank: int, world: int, port: int, out: multiprocessing.Queue, done: Barrier
) -> None:
    import torch.distributed as dist

    from raysgd_core._internal.abort import GroupConnections, listening_endpoints

    # As raysgd forms a group: the rendezvous store first, then what listens is noted.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    before = listening_endpoints()
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    connections = GroupConnections.gather("gloo", before)
    found = len(connections.connections())
    dist.barrier()
    # The abort ends the group: a collective after it raises at once.
    connections.abort()
    try:
        dist.barrier()
        released = False
    except RuntimeError:
        released = True
    out.put((rank, len(connections.peers), found, released))
    # Exit only once every rank has tried its collective after the abort: a peer's exit closes
    # its connections, which would release the others' collectives without their abort.
    done.wait(60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_connections_are_found_one_per_peer():
    # What abort.py relies on: one listener per rank and group, and one connection per pair of
    # ranks with one end on a listener. If torch's gloo changes that, this fails first.
    world, port = 3, _free_port()
    ctx = multiprocessing.get_context("spawn")
    out, done = ctx.Queue(), ctx.Barrier(world)
    procs = [
        ctx.Process(target=_form_and_abort, args=(r, world, port, out, done)) for r in range(world)
    ]
    for p in procs:
        p.start()
    found = sorted(out.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(30)
    # Each rank: the other ranks' listeners, its one connection to each of them, and a
    # collective after the abort raised.
    assert found == [(r, world - 1, world - 1, True) for r in range(world)]


def test_nccl_groups_keep_a_survivor_alive_unless_the_user_says_otherwise(monkeypatch) -> None:
    # What an NCCL group is built with (no GPU here: the environment it reads is what can be
    # checked). torch's defaults end a process whose collective timed out or whose heartbeat
    # stalled; a survivor must outlive an abort.
    from raysgd_core._internal.process_group import NCCL_ENV_DEFAULTS, apply_nccl_env

    for name in NCCL_ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert apply_nccl_env() == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
    }
    monkeypatch.setenv("TORCH_NCCL_ENABLE_MONITORING", "1")  # the user's choice wins
    assert apply_nccl_env()["TORCH_NCCL_ENABLE_MONITORING"] == "1"


def test_endpoints_travel_as_bytes_without_numpy() -> None:
    # The ranks tell each other their listeners in a tensor collective (an object collective
    # needs NumPy, which an install of raysgd-core alone lacks): IPv4, IPv6 and wildcard
    # addresses come back as the kernel's table shows them.
    from raysgd_core._internal.abort import Endpoint, _pack, _unpack

    endpoints = [
        Endpoint("127.0.0.1", 29500),
        Endpoint("0.0.0.0", 1),
        Endpoint("::", 65535),
        Endpoint("fe80::1", 40000),
        Endpoint("10.1.2.3", 443),
    ]
    packed = _pack(endpoints)
    assert len(packed) == 18 * len(endpoints)
    assert _unpack(packed) == endpoints
    assert _unpack(b"") == [] and _pack([]) == b""
