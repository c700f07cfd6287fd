"""Failures are typed, never hang, and leave nothing behind; recover() re-forms the group."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
from tests._support.markers import entering, wait_for_peers

from raysgd_core import (
    ResourcesUnavailableError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    get_context,
)

pytestmark = pytest.mark.timeout(120)


class BadValueError(ValueError):
    """A user exception type from the test module (shipped by value, comes back as __cause__)."""


def _rank_and_pid() -> tuple[int, int]:
    return get_context().world_rank, os.getpid()


def _all_reduce_sum(folder: str = "") -> float:
    """The sum of rank + 1 over the group; with `folder`, marks `entering` there first."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(get_context().world_rank + 1)])
    if folder:
        entering(folder)
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_others_all_reduce(folder: str) -> float:
    if get_context().world_rank == 1:
        wait_for_peers(folder)  # the others are inside the all_reduce
        raise BadValueError("bad value on rank 1")
    return _all_reduce_sum(folder)


def _rank_exits_others_all_reduce(victim: int, folder: str) -> float:
    if get_context().world_rank == victim:
        wait_for_peers(folder)
        os._exit(1)
    return _all_reduce_sum(folder)


def test_too_few_resources_fails_fast_and_leaves_nothing(ray_local, wait_no_leftovers):
    group = WorkerGroup(6, start_timeout_s=2.0)
    with pytest.raises(ResourcesUnavailableError) as info:
        group.start()
    message = str(info.value)
    assert "6 workers x {CPU: 1}" in message and "CPU: 4" in message
    assert isinstance(info.value, TimeoutError)
    assert wait_no_leftovers() == ([], [])


def _rank_terminated_others_all_reduce(victim: int, folder: str) -> float:
    if get_context().world_rank == victim:
        wait_for_peers(folder)
        # What a node shutting down does to its workers: Ray's handler turns SIGTERM into a
        # SystemExit raised inside the running call.
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    return _all_reduce_sum(folder)


def _own_actor():
    return ray.get_runtime_context().current_actor


@contextmanager
def _phase(name: str) -> Iterator[None]:
    """Name the phase of a long test in whatever fails inside it (an assertion, an error that
    did not come, a timeout); Python 3.11+ prints the note under the error."""
    try:
        yield
    except BaseException as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"in phase: {name}")
        raise


@pytest.mark.timeout(240)
def test_one_group_through_a_user_error_and_each_way_to_lose_a_worker(
    ray_local, wait_no_leftovers, tmp_path
):
    # One group of 3 goes through every phase in turn, each re-forming it for the next: a
    # worker process costs seconds to start, a phase on the running group a fraction of that.
    group = WorkerGroup(3).start()
    try:
        with _phase("a user error carries its traceback, rank and cause; recover keeps all"):
            with pytest.raises(WorkerError) as info:
                group.execute(_rank1_raises_others_all_reduce, str(tmp_path / "raises"))
            error = info.value
            assert error.rank == 1
            assert "bad value on rank 1" in str(error)
            assert "_rank1_raises_others_all_reduce" in error.remote_traceback
            assert isinstance(error.__cause__, ValueError)
            assert type(error.__cause__).__name__ == "BadValueError"
            assert group.needs_recovery
            with pytest.raises(RuntimeError, match="recover"):
                group.execute(_all_reduce_sum)
            pids = [w.pid for w in group.workers]
            # Every worker is still alive: recovery keeps them all and re-forms the group.
            report = group.recover(3, timeout_s=30)
            assert report.path == "keep-healthy"
            assert report.kept == {0: 0, 1: 1, 2: 2} and report.started == []
            assert [w.pid for w in group.workers] == pids
            assert group.execute(_all_reduce_sum) == [6.0, 6.0, 6.0]

        with _phase("a killed actor gives WorkerDiedError; recover(3) replaces it"):
            before = group.execute(_rank_and_pid)
            victim = group.execute_single(1, _own_actor)
            ray.kill(victim)
            with pytest.raises(WorkerDiedError) as died:
                group.execute(_all_reduce_sum)
            assert died.value.ranks == [1]
            assert died.value.nodes == [group.workers[1].node_id]
            assert "rank 1" in str(died.value)
            report = group.recover(3, timeout_s=60)
            assert report.path == "keep-healthy"
            assert report.kept == {0: 0, 2: 1}
            assert report.started == [2] and report.world_size == 3
            assert report.found_lost == {}  # the error above reported it
            after = group.execute(_rank_and_pid)
            assert [pid for _, pid in after[:2]] == [before[0][1], before[2][1]]
            assert after[2][1] not in {pid for _, pid in before}
            assert group.execute(_all_reduce_sum) == [6.0, 6.0, 6.0]

        with _phase("a worker lost with no call to report it is found by recover"):
            # The second of a burst, gone before the recovery for the first: the recovery finds
            # it, replaces it and says so.
            node = group.workers[0].node_id
            os.kill(group.workers[0].pid, signal.SIGKILL)
            report = group.recover(3, timeout_s=60)
            assert report.lost == [0] and report.found_lost == {0: node}
            assert report.kept == {1: 0, 2: 1} and report.started == [2]
            assert group.execute(_all_reduce_sum) == [6.0, 6.0, 6.0]

        with _phase("an exit inside a collective gives WorkerDiedError; recover(2) shrinks"):
            with pytest.raises(WorkerDiedError) as died:
                group.execute(_rank_exits_others_all_reduce, 2, str(tmp_path / "exit"))
            assert died.value.ranks == [2]
            # Shrink: recover to what is left without starting anybody.
            report = group.recover(2, timeout_s=30)
            assert report.world_size == 2 and report.started == []
            assert group.execute(_all_reduce_sum) == [3.0, 3.0]

        with _phase("a SIGTERM inside a collective gives WorkerDiedError"):
            # A worker terminated mid-call is lost too, not a user error (SystemExit ends the
            # actor).
            with pytest.raises(WorkerDiedError) as died:
                group.execute(_rank_terminated_others_all_reduce, 1, str(tmp_path / "term"))
            assert died.value.ranks == [1]
    finally:
        group.shutdown()
    assert wait_no_leftovers() == ([], [])


def _wait_for_spare(group: WorkerGroup, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    while not group.spares and time.monotonic() < deadline:
        time.sleep(0.1)
    return group.spares


def _imported_tabnanny() -> bool:
    return "tabnanny" in sys.modules


def test_a_spare_replaces_a_lost_worker_and_another_spare_starts(
    ray_local, wait_no_leftovers, tmp_path
):
    # A module no worker imports by itself; a missing one is only logged by the spare.
    imports = ("tabnanny", "no_such_module_for_raysgd")
    group = WorkerGroup(2, spare_workers=1, spare_imports=imports).start()
    try:
        (spare,) = _wait_for_spare(group)
        # The spare holds a worker's resources (2 workers + 1 spare of the 4 CPUs).
        assert ray.available_resources().get("CPU", 0.0) == 1.0
        assert spare.pid not in {w.pid for w in group.workers}
        with pytest.raises(WorkerDiedError):
            group.execute(_rank_exits_others_all_reduce, 1, str(tmp_path))
        report = group.recover(2, timeout_s=60)
        assert report.path == "keep-healthy" and report.started == [1]
        # The spare became rank 1: no process was started after the loss.
        assert [pid for _, pid in group.execute(_rank_and_pid)][1] == spare.pid
        # It imported its `spare_imports` while it waited; the kept rank 0 never did.
        assert group.execute(_imported_tabnanny) == [False, True]
        assert group.execute(_all_reduce_sum) == [3.0, 3.0]
        (next_spare,) = _wait_for_spare(group)
        assert next_spare.pid not in {spare.pid, *(w.pid for w in group.workers)}
    finally:
        group.shutdown()
    assert wait_no_leftovers() == ([], [])


def _rank1_raises_rank0_hangs() -> None:
    if get_context().world_rank == 0:
        time.sleep(600)  # stuck outside any collective: only killing it ends this
    raise BadValueError("rank 1 failed")


def _bound_then_rank1_stops(bound_s: float) -> float:
    from raysgd_core import set_collective_timeout

    set_collective_timeout(bound_s)
    if get_context().world_rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent: alive, connections open, never answers
    return _all_reduce_sum()


def _rank1_stops_after_its_part(folder: str) -> int:
    """Rank 1 stops once rank 0 has returned (`entering`): no collective waits for it, only the
    driver for its result."""
    if get_context().world_rank == 1:
        wait_for_peers(folder, [0])  # and a moment: rank 0's result is on its way
        os.kill(os.getpid(), signal.SIGSTOP)
    entering(folder)
    return get_context().world_rank


def _rank1_stops_rank0_waits_unbounded() -> float:
    """Rank 1 stops; rank 0 waits for it in an all-reduce bounded by the group's own timeout
    (30 minutes by default): only the driver's probes can let it out."""
    if get_context().world_rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return _all_reduce_sum()


def test_a_stuck_peer_is_killed_after_grace_and_a_silent_one_is_lost(ray_local, tmp_path):
    # The probes' bound is above the collectives' 2 s below: the first silent peer is found from
    # its peer's bounded wait; the last two phases have nothing but the probes.
    with WorkerGroup(2, liveness_timeout_s=4.0) as group:
        with _phase("a peer stuck after a user error is killed after the grace and replaced"):
            stuck_pid = group.workers[0].pid
            with pytest.raises(WorkerError) as info:
                group.execute(_rank1_raises_rank0_hangs)
            assert info.value.rank == 1 and info.value.lost_ranks == [0]
            report = group.recover(2, timeout_s=60)
            assert report.kept == {1: 0} and report.started == [1] and report.lost == [0]
            assert report.found_lost == {}  # killed for being stuck: the error named it
            assert stuck_pid not in [w.pid for w in group.workers]
            assert group.execute(_all_reduce_sum) == [3.0, 3.0]

        with _phase("a silent peer is lost and its waiting peer kept"):
            # The grace (5 s, above the 2 s bound) starts at a call's first failure, here the
            # waiting rank's bounded collective: the waiting rank is never killed for waiting,
            # and the silent one is found from that bounded wait, not from the grace.
            pids = [w.pid for w in group.workers]
            with pytest.raises(WorkerDiedError) as died:
                group.execute(_bound_then_rank1_stops, 2.0)
            # Named silent (the grace would have called it stuck), and lost alone.
            assert died.value.ranks == [1] and died.value.silent == [1]
            assert "stopped answering" in str(died.value)
            report = group.recover(2, timeout_s=60)
            assert report.kept == {0: 0} and report.started == [1] and report.lost == [1]
            assert group.workers[0].pid == pids[0]
            assert pids[1] not in [w.pid for w in group.workers]
            # The new group's collectives wait for the group's own timeout again.
            assert group.execute(_all_reduce_sum) == [3.0, 3.0]

        for name, fn, args in [
            ("stopped after its peer returned", _rank1_stops_after_its_part, (str(tmp_path),)),
            (
                "stopped with its peer in an unbounded all-reduce",
                _rank1_stops_rank0_waits_unbounded,
                (),
            ),
        ]:
            with _phase(f"a worker {name} is found by the driver's probes"):
                pids = [w.pid for w in group.workers]
                with pytest.raises(WorkerDiedError) as died:
                    group.execute(fn, *args)
                assert died.value.ranks == [1] and died.value.silent == [1]
                assert "stopped answering" in str(died.value)
                report = group.recover(2, timeout_s=60)
                # Rank 0 was let out of its wait and kept, with its process.
                assert report.kept == {0: 0} and report.lost == [1]
                assert group.workers[0].pid == pids[0]
                assert group.execute(_all_reduce_sum) == [3.0, 3.0]
                for marker in tmp_path.iterdir():
                    marker.unlink()
