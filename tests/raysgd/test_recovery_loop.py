"""The run controller's recovery decisions, driven through a fake worker group (no Ray, no
processes): its attempts' losses, the policies' answers, grows, joins, repairs and moves.

The stand-ins (`tests/_support/fakes.py`) implement the controller's narrow views; scripted
attempts raise the errors a real group raises. Real losses are tested end to end in
`test_recovery_trainer.py`; here every path of the state machine is walked in milliseconds. Whole
`train()` calls through the controller (their routes and double faults): `test_controller.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

import pytest
from tests._support.fakes import FakeCluster, FakeGroup, FakeState, Script, died

from raysgd._internal.driver.controller import RunController
from raysgd._internal.driver.goodput import GoodputMeter
from raysgd._internal.driver.phases import Phase
from raysgd._internal.state.plan import RestoreOutcome
from raysgd_core import RecoveryReport, WorkerDiedError, WorkerError
from raysgd_fault import (
    Action,
    Decision,
    DefaultPolicy,
    ElasticPolicy,
    FailurePolicy,
    FailureStatus,
    FixedSize,
    GrowWhenRoom,
    ScalingDecision,
    ScalingStatus,
)


def make_loop(
    group: FakeGroup,
    num_workers: int,
    policy: Optional[FailurePolicy] = None,
    *,
    nodes_alive: bool = True,
) -> tuple[RunController, list[RecoveryReport], list[float]]:
    state = FakeState()
    sleeps: list[float] = []
    loop = RunController(
        group=group,  # type: ignore[arg-type]
        num_workers=num_workers,
        state=state,
        policy=policy or DefaultPolicy(base_wait_s=0.5),
        sleep=sleeps.append,
        # A lost worker's slot is free again at once when its node lives on (a killed process).
        cluster=FakeCluster(nodes_alive),
    )
    loop.fake_state = state  # type: ignore[attr-defined]
    return loop, state.restored, sleeps


def actions(loop: RunController) -> list[str]:
    return [e.action for e in loop.events if e.kind == "decision"]


def test_retry_replaces_the_lost_worker_and_redoes_the_attempt() -> None:
    group = FakeGroup(size=2, room=2)
    loop, restored, _ = make_loop(group, 2)
    attempt = Script(lambda: died(group, [1]))
    assert loop.run_attempts(attempt, max_retries=3) == "done"
    assert attempt.calls == 2 and group.recover_calls == [2] and group.world_size == 2
    assert [r.started for r in restored] == [[1]]  # the restore callback saw the new worker
    assert loop.failures == 1 and loop.phase is Phase.SUCCEEDED
    assert [e.kind for e in loop.events] == ["failure", "decision", "resize", "recovered"]
    phases = loop.events[2].phases  # the group's own phases, plus the restore's
    assert phases["start_s"] == 0.25 and phases["form_s"] == 0.125 and phases["restore_s"] >= 0


def test_observers_see_every_event_as_it_is_recorded_and_a_broken_one_stops_nothing() -> None:
    group = FakeGroup(size=2, room=2)
    loop, _, _ = make_loop(group, 2)
    loop.fake_state._restore = lambda report: RestoreOutcome("rank 0 at step 7", 7, 1)  # type: ignore[attr-defined]
    meter, seen = GoodputMeter(), []

    def broken(event: Any) -> None:
        raise RuntimeError("an observer's bug")

    for observer in (broken, seen.append, meter.take):
        loop.log.subscribe(observer)
    assert loop.run_attempts(Script(lambda: died(group, [1])), max_retries=3) == "done"
    assert [e.kind for e in seen] == ["failure", "decision", "resize", "recovered"]
    meter.end_call(step_s=2.0)
    report = meter.report(failures=1)
    # The resize's group phases count as starting workers; its redone step at the call's pace.
    assert report["lost_s"]["start"] == pytest.approx(0.375)
    assert report["steps_redone"] == 1 and report["lost_s"]["redone"] == 2.0


def test_the_step_in_flight_is_lost_time_once_and_finished_steps_lost_are_redone_time() -> None:
    group = FakeGroup(size=2, room=2)
    loop, _, _ = make_loop(group, 2)
    meter = GoodputMeter()
    loop.log.subscribe(meter.take)
    # The survivors last finished a step 3 s before the loss was seen; 3 steps are redone: the
    # one in flight and two finished ones (a snapshot older than the loss).
    finished_at = time.time() - 3.0
    loop.fake_state._restore = lambda report: RestoreOutcome(
        "snapshot at step 5", 5, 3, finished_at
    )  # type: ignore[attr-defined]
    assert loop.run_attempts(Script(lambda: died(group, [1])), max_retries=3) == "done"
    meter.end_call(step_s=2.0)
    report = meter.report(failures=1)
    assert report["steps_redone"] == 3
    assert report["lost_s"]["detection"] == pytest.approx(3.0, abs=0.5)
    assert report["lost_s"]["redone"] == 4.0  # the two finished steps, not the one in flight


def test_shrink_when_the_lost_worker_cannot_be_replaced() -> None:
    group = FakeGroup(size=3, room=2)  # the lost worker's slot is gone with its node
    loop, restored, _ = make_loop(group, 3, nodes_alive=False)
    assert loop.run_attempts(Script(lambda: died(group, [2])), max_retries=3) == "done"
    assert group.recover_calls == [2] and group.world_size == 2
    assert restored[0].world_size == 2


def test_wait_backs_off_until_room_appears() -> None:
    group = FakeGroup(size=2, room=0)  # every worker lost with its node, nothing fits for now
    loop, _, sleeps = make_loop(group, 2, nodes_alive=False)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            group.room = 2  # the cluster got its nodes back while we waited

    loop._sleep = sleep
    assert loop.run_attempts(Script(lambda: died(group, [0, 1])), max_retries=3) == "done"
    assert sleeps == [0.5, 1.0]  # exponential backoff from base_wait_s
    assert actions(loop) == ["wait", "wait", "retry"]
    assert group.recover_calls == [2] and group.world_size == 2


def test_gives_up_when_the_policy_says_the_budget_is_spent() -> None:
    group = FakeGroup(size=2, room=2)
    loop, _, _ = make_loop(group, 2)
    attempt = Script(*[lambda: died(group, [1])] * 5)
    with pytest.raises(RuntimeError, match="max_retries=1") as excinfo:
        loop.run_attempts(attempt, max_retries=1)
    assert isinstance(excinfo.value.__cause__, WorkerDiedError)
    assert str(excinfo.value).count("rank(s) [1] on node(s)") == 2  # every loss is named
    assert attempt.calls == 2 and loop.failures == 2 and loop.phase is Phase.GAVE_UP


def test_gives_up_after_fruitless_attempts() -> None:
    group = FakeGroup(size=2, room=0)
    loop, _, sleeps = make_loop(
        group, 2, DefaultPolicy(max_attempts=2, base_wait_s=0.5), nodes_alive=False
    )
    with pytest.raises(RuntimeError, match="2 attempt"):
        loop.run_attempts(Script(lambda: died(group, [0, 1])), max_retries=3)
    assert sleeps == [0.5, 1.0] and actions(loop) == ["wait", "wait", "give_up"]


def test_restart_that_starts_nobody_counts_as_a_fruitless_attempt() -> None:
    group = FakeGroup(size=1, room=0)
    loop, _, _ = make_loop(group, 1, nodes_alive=False)
    # The estimate says one fits, but the start fails for want of room: RETRY finds nobody.
    group.estimate_fitting = lambda: 1  # type: ignore[method-assign]
    seen: list[int] = []
    policy = loop.policies.failure

    class Recording(FailurePolicy):
        def decide(self, status: FailureStatus) -> Decision:
            seen.append(status.attempt)
            if status.attempt == 2:
                group.room = 1
            return policy.decide(status)

    loop.policies.failure = Recording()
    assert loop.run_attempts(Script(lambda: died(group, [0])), max_retries=3) == "done"
    assert seen == [0, 1, 2] and group.recover_calls == [1, 1, 1]


def test_a_failed_restart_is_one_more_loss_and_is_retried() -> None:
    group = FakeGroup(size=2, room=2)
    group.recover_errors = [WorkerDiedError("new worker died", [1], ["node"])]
    loop, restored, _ = make_loop(group, 2)
    assert loop.run_attempts(Script(lambda: died(group, [1])), max_retries=3) == "done"
    assert loop.failures == 2 and len(restored) == 1
    assert [e.kind for e in loop.events].count("restart_failed") == 1


def test_a_worker_the_resize_finds_gone_is_one_more_loss_recorded_before_the_resize() -> None:
    # Rank 2 went after rank 1's loss was seen and before the group's recovery pinged it: the
    # one resize replaces both, and rank 2's loss is counted, in the order the losses came.
    group = FakeGroup(size=3, room=3)
    group.found_next = {2: "node-b"}
    loop, restored, _ = make_loop(group, 3)
    meter = GoodputMeter()
    loop.log.subscribe(meter.take)
    finished_at = time.time() - 2.0
    loop.fake_state._restore = lambda report: RestoreOutcome("rank 0", 4, 1, finished_at)  # type: ignore[attr-defined]
    assert loop.run_attempts(Script(lambda: died(group, [1])), max_retries=3) == "done"
    assert loop.failures == 2 and group.recover_calls == [3] and len(restored) == 1
    assert restored[0].started == [1, 2] and group.world_size == 3
    kinds = [e.kind for e in loop.events]
    assert kinds == ["failure", "decision", "restart_failed", "resize", "recovered"]
    found = loop.events[2]
    assert found.ranks == (2,) and found.nodes == ("node-b",)
    assert found.error.startswith("WorkerDiedError") and found.num_workers_after == 1
    # The detection is measured from the first loss, once, by the resize that followed both.
    assert meter.report(failures=2)["lost_s"]["detection"] == pytest.approx(2.0, abs=0.5)
    # While the group is repaired after a user error, such a loss is logged, not counted.
    group.found_next, group.needs_recovery = {0: "node-a"}, True
    loop.repair(WorkerError("boom", 1, "node", "Traceback ..."))
    assert loop.failures == 2 and loop.events[-2].kind == "restart_failed"
    assert "not counted" in loop.events[-2].message


def test_the_policy_alone_owns_the_budget() -> None:
    class Stubborn(FailurePolicy):
        def decide(self, status: FailureStatus) -> Decision:
            return Decision(Action.RETRY, num_workers=status.workers_wanted, reason="again")

    group = FakeGroup(size=2, room=2)
    loop, _, _ = make_loop(group, 2, Stubborn())
    # max_retries=0, yet the loop retries as long as its policy says so.
    attempt = Script(*[lambda: died(group, [1])] * 4)
    assert loop.run_attempts(attempt, max_retries=0) == "done"
    assert attempt.calls == 5 and loop.failures == 4


def test_user_error_is_not_retried_and_the_group_is_repaired() -> None:
    group = FakeGroup(size=2, room=2)
    loop, restored, _ = make_loop(group, 2)

    def raise_user_error() -> WorkerError:
        group.needs_recovery = True  # the raising rank left its process group
        return WorkerError("boom", 1, "node", "Traceback ...")

    attempt = Script(raise_user_error)
    with pytest.raises(WorkerError, match="boom"):
        loop.run_attempts(attempt, max_retries=3)
    assert attempt.calls == 1 and loop.failures == 0
    assert group.recover_calls == [2] and len(restored) == 1  # repaired at the same size
    assert [e.kind for e in loop.events] == ["user_error", "resize"]


def test_a_group_left_broken_is_reformed_before_the_attempt() -> None:
    group = FakeGroup(size=2, room=2)
    group.needs_recovery = True
    loop, restored, _ = make_loop(group, 2)
    attempt = Script()
    assert loop.run_attempts(attempt, max_retries=3) == "done"
    assert group.recover_calls == [2] and len(restored) == 1 and attempt.calls == 1


def test_repair_after_a_call_other_than_train_goes_through_the_loop() -> None:
    # What the trainer does when validate(), save(), ... fail: the same resize, restore seam,
    # timeout and log as train(); a user error is not counted, a lost worker is.
    group = FakeGroup(size=2, room=2)
    loop, restored, _ = make_loop(group, 2)
    group.needs_recovery = True  # the raising rank left its process group
    assert loop.repair(WorkerError("boom", 1, "node", "Traceback ...")) is True
    assert loop.failures == 0 and group.recover_calls == [2] and len(restored) == 1
    assert [e.kind for e in loop.events] == ["user_error", "resize"]

    lost = died(group, [1])
    assert loop.repair(lost) is True
    assert loop.failures == 1 and loop.failures_this_call == 1
    assert group.recover_calls == [2, 2] and group.world_size == 2 and len(restored) == 2
    assert [e.kind for e in loop.events][2:] == ["failure", "resize"]
    assert "repair after a failed call" in loop.events[-1].message

    # A repair that cannot re-form the group leaves it to the next run(), which starts there.
    group.needs_recovery = True
    group.recover_errors.append(died(group, [0]))
    assert loop.repair() is False and loop.phase is Phase.FAILED
    assert loop.failures == 2  # the worker lost while re-forming is a loss too
    assert loop.run_attempts(Script(), max_retries=3) == "done" and group.world_size == 2
    assert loop.repair() is True  # nothing to do on a healthy group
    assert group.recover_calls == [2, 2, 2, 2]


def test_grow_back_is_sized_by_the_scaling_policy_not_the_failure_policy() -> None:
    group = FakeGroup(size=1, room=3)
    seen: list[Any] = []

    class Recording(DefaultPolicy):
        def decide(self, status: FailureStatus) -> Decision:
            seen.append(status)
            return super().decide(status)

    class RecordingScaling(GrowWhenRoom):
        def decide(self, status: ScalingStatus) -> ScalingDecision:
            seen.append(status)
            return super().decide(status)

    loop, restored, _ = make_loop(group, 3, Recording())
    loop.policies.scaling = RecordingScaling()
    assert loop.growth.maybe_grow() is True
    assert group.recover_calls == [3] and group.world_size == 3 and len(restored) == 1
    assert seen == [ScalingStatus("grow", workers_wanted=3, workers_running=1, workers_fitting=2)]
    assert loop.growth.maybe_grow() is False  # at the requested size: nothing asked
    assert len(seen) == 1 and loop.failures == 0
    assert "scaling 'grow' (grow: wanted 3, running 1, fitting 2)" in loop.events[-2].message


def raise_(error: BaseException) -> None:
    raise error


def test_survivors_train_on_while_their_replacement_starts_then_it_joins() -> None:
    group = FakeGroup(size=2, room=2)
    loop, restored, _ = make_loop(group, 2, ElasticPolicy())
    attempt = Script(lambda: died(group, [1]))
    assert loop.run_attempts(attempt, max_retries=3) == "done"
    # The survivor went on alone at once; its replacement starts as a spare beside it.
    assert group.recover_calls == [1] and group.world_size == 1 and attempt.calls == 2
    assert group.spares_starting == 1 and loop.growth.joining() == [("ref",)]
    assert "1 more starting in the background" in loop.events[1].message
    assert loop.growth.join_spares() is False  # still starting: nothing joins, nothing is asked
    assert loop.growth.maybe_grow() is False and group.recover_calls == [1]  # nor started twice
    group.spares_starting, group.spares_up = 0, 1
    # A worker lost while the boundary's state is made restorable: counted, nothing joins (the
    # next run() recovers the group first).
    loop.fake_state._hand_over = lambda leaving: raise_(died(group, [0]))
    assert loop.growth.join_spares() is False
    assert loop.failures == 2 and group.recover_calls == [1] and group.needs_recovery
    group.needs_recovery, group.dead = False, 0
    prepared: list[int] = []
    loop.fake_state._hand_over = lambda leaving: prepared.append(group.world_size)
    # Up: it joins at this step boundary, the state of the boundary made restorable first.
    assert loop.growth.join_spares() is True
    assert prepared == [1]
    assert group.recover_calls == [1, 2] and group.world_size == 2 and len(restored) == 2
    assert loop.growth.joining() == [] and loop.failures == 2
    assert [e.kind for e in loop.events][-2:] == ["decision", "resize"]
    assert "resized (grow) 1 -> 2" in loop.events[-1].message
    # A scaling policy that keeps the size is asked once per call: the workers stop looking.
    group.world_size, group.spares_up = 1, 1
    loop.policies.scaling = FixedSize()
    assert loop.growth.join_spares() is False and loop.growth.joining() == []
    # A new call looks again.
    assert loop.growth.maybe_grow() is False and loop.growth.joining() == [("ref",)]
    loop.policies.scaling, group.world_size, group.spares_up = GrowWhenRoom(), 2, 0
    # A spare that is up when a worker is lost joins at once; nothing more is started.
    attempt = Script(lambda: died(group, [0]))
    group.spares_up = 1
    assert loop.run_attempts(attempt, max_retries=3) == "done"
    assert group.recover_calls[-1] == 2 and group.world_size == 2 and group.spares_starting == 0


def test_grow_that_starts_nobody_backs_off() -> None:
    group = FakeGroup(size=1, room=1)
    group.estimate_fitting = lambda: 1  # type: ignore[method-assign]  # a promise not kept
    loop, _, _ = make_loop(group, 2)
    assert loop.growth.maybe_grow() is False
    assert group.recover_calls == [2]
    assert loop.growth.maybe_grow() is False  # within the backoff: not even tried
    assert group.recover_calls == [2]
    assert "not trying again" in loop.events[-1].message


def test_a_move_off_a_draining_node_is_no_failure_and_reports_what_was_redone() -> None:
    group = FakeGroup(size=2, room=3)
    steps = iter([0, 2, 0])  # what the restores find: nothing redone, then two steps
    handed: list[str] = []
    state = FakeState(
        lambda report: RestoreOutcome("rank 0 at step 7", 7, next(steps)),
        lambda leaving: handed.append("x"),
    )
    loop = RunController(
        group=group,  # type: ignore[arg-type]
        num_workers=2,
        state=state,
        policy=DefaultPolicy(base_wait_s=0.5),
        sleep=lambda s: None,
        cluster=FakeCluster(nodes_alive=False),
    )
    assert loop.moves.move_off([1], {"drained": None})
    assert handed == ["x"] and group.recover_calls == [2] and group.world_size == 2
    assert loop.failures == 0
    assert group.spare_waits == [10.0]  # spares still starting are waited for, within bounds
    (move,) = [e for e in loop.events if e.kind == "preemption"]
    assert move.steps_redone == 0 and "no deadline" in move.message
    resize = next(e for e in loop.events if e.kind == "resize")
    assert resize.report is not None and resize.report.steps_redone == 0

    # Every worker on the draining node: replacements join first, and the state is made
    # restorable before they do (and again before the leaving workers go).
    handed.clear()
    assert loop.moves.move_off([0, 1], {"drained": None})
    assert handed == ["x", "x"] and group.recover_calls == [2, 4, 2]
    move = [e for e in loop.events if e.kind == "preemption"][-1]
    assert move.steps_redone == 2 and "2 step(s) redone" in move.message


def test_a_node_lost_during_a_move_is_a_preemption_recovered_by_the_next_run() -> None:
    group = FakeGroup(size=2, room=3)
    loop, restored, _ = make_loop(group, 2)
    state = loop.fake_state  # type: ignore[attr-defined]

    def hand_over(leaving: Sequence[int]) -> None:  # the node went before the deadline
        raise died(group, [1])

    state._hand_over = hand_over
    moved = loop.moves.move_off([1], {"node": 1e12})
    assert moved is False and group.needs_recovery
    assert loop.failures == 1
    (lost,) = [e for e in loop.events if e.kind == "restart_failed"]
    assert lost.preempted and lost.ranks == (1,)
    assert "failed: a worker was lost" in loop.events[-1].message
    assert loop.run_attempts(Script(), max_retries=3) == "done"
    assert group.world_size == 2 and len(restored) == 1
