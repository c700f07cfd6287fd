"""Whole `train()` calls through the run controller, on stand-ins (no Ray, no processes): the
routes a call takes (a loss, a drain, spares joining, a checkpoint asked for) and the double faults
on them (a loss while the state is restored, while workers move off a draining node, while the
checkpoint is written), each pinned by the events it records, in order, and the sizes it leaves.

Each test gives the group a script: what each attempt of the call does (a worker dies, the workers
stop at a step boundary for a drain or a spare, or the call's work is done).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

import pytest
from tests._support.fakes import FakeCluster, FakeGroup, FakeState, died

from raysgd._internal.driver.controller import CallSpec, RunController
from raysgd._internal.driver.goodput import GoodputMeter
from raysgd._internal.driver.phases import Phase, Transition
from raysgd._internal.protocol import DRAIN, SPARE, TrainAnswer
from raysgd._internal.state.plan import RestoreOutcome
from raysgd_core import WorkerDiedError
from raysgd_fault import DefaultPolicy, ElasticPolicy, FailurePolicy, NeverRetryPolicy

#: What one attempt does: raise (a callable returning the error), stop at a step boundary (DRAIN,
#: SPARE, or a callable returning one after changing the stand-ins), or finish (None).
Outcome = Union[None, str, Callable[[], Any]]


class Worker(NamedTuple):
    rank: int
    node_id: str
    is_local: bool = False


class TrainGroup(FakeGroup):
    """A `FakeGroup` whose workers answer train attempts as scripted; rank r lives on node-r."""

    def __init__(self, size: int, room: int, script: Sequence[Outcome]) -> None:
        super().__init__(size, room)
        self.script = list(script)
        self.attempts: list[tuple[int, Any]] = []  # (call id, what the workers watched)
        self.replaced: list[list[str]] = []

    @property
    def workers(self) -> list[Worker]:
        return [Worker(rank, f"node-{rank}") for rank in range(self.world_size)]

    def replace_spares_on(self, nodes: Any) -> None:
        self.replaced.append(list(nodes))

    def execute(self, fn: Any, *args: Any) -> list[TrainAnswer]:
        call_id, watch = args[3], args[4]
        self.attempts.append((call_id, watch))
        outcome = self.script.pop(0) if self.script else None
        if callable(outcome):
            outcome = outcome()
        if isinstance(outcome, BaseException):
            raise outcome
        answer = TrainAnswer({"loss": 1.0}, 8, None, outcome, epochs=1, step_s=0.5)
        return [answer] * self.world_size


class TrainState(FakeState):
    """A `FakeState` that also takes the end of a call."""

    def __init__(self, restore: Any = None, hand_over: Any = None) -> None:
        super().__init__(restore, hand_over)
        self.trained: list[tuple[int, int]] = []

    def after_train(self, step: int, epochs: int) -> None:
        self.trained.append((step, epochs))


class Checkpoints:
    """`checkpoint_dir`'s stand-in: what `train(checkpoint=...)` writes, failing as scripted."""

    def __init__(self, *errors: Callable[[], BaseException]) -> None:
        self.errors = list(errors)
        self.written: list[str] = []

    def before_call(self, path: str) -> str:
        if self.errors:
            raise self.errors.pop(0)()
        self.written.append(path)
        return path

    def plan(self) -> None:
        return None


class DrainingCluster(FakeCluster):
    """Several nodes, of which `drains` are being drained."""

    def __init__(self) -> None:
        super().__init__(nodes_alive=True)
        self.drains: dict[str, Optional[float]] = {}

    def draining(self) -> dict[str, Optional[float]]:
        return dict(self.drains)

    def multi_node(self) -> bool:
        return True


def controller(
    group: TrainGroup,
    *,
    policy: Optional[FailurePolicy] = None,
    state: Optional[TrainState] = None,
    cluster: Optional[FakeCluster] = None,
    checkpoints: Optional[Checkpoints] = None,
) -> tuple[RunController, list[Transition]]:
    seen: list[Transition] = []
    run = RunController(
        group=group,  # type: ignore[arg-type]
        num_workers=2,
        state=state or TrainState(),
        policy=policy or DefaultPolicy(base_wait_s=0.5),
        checkpoints=checkpoints,  # type: ignore[arg-type]
        cluster=cluster or FakeCluster(),
        sleep=lambda s: None,
    )
    run.subscribe(seen.append)
    return run, seen


def kinds(run: RunController) -> list[str]:
    return [e.kind for e in run.events]


def call(**given: Any) -> CallSpec:
    return CallSpec(
        **{"num_steps": None, "profile": False, "info": None, "max_retries": 3, **given}
    )


def test_a_call_that_loses_a_worker_goes_on_under_the_same_call_id() -> None:
    group = TrainGroup(2, room=2, script=[])
    group.script = [lambda: died(group, [1]), None]
    state = TrainState()
    run, seen = controller(group, state=state)
    answers = run.run(call())
    assert len(answers) == 2 and state.trained == [(8, 1)]
    assert [a[0] for a in group.attempts] == [1, 1]  # the redo continues call 1
    assert kinds(run) == ["failure", "decision", "resize", "recovered"]
    assert run.phase is Phase.IDLE and run.failures == 1
    route = [t.after for t in seen]
    assert route == [
        Phase.GROWING,
        Phase.RUNNING,
        Phase.FAILED,
        Phase.RESTARTING,
        Phase.RUNNING,
        Phase.SUCCEEDED,
        Phase.IDLE,
    ]
    assert seen[-1].step_s == 0.5  # what goodput charges the redone steps at
    run.run(call())
    assert group.attempts[-1][0] == 2 and run.failures == 1


def test_a_call_stopped_for_a_drain_moves_off_the_node_and_goes_on() -> None:
    cluster = DrainingCluster()
    group = TrainGroup(2, room=3, script=[])

    def drain() -> str:
        cluster.drains = {"node-1": None}
        return DRAIN

    group.script = [drain, None]
    run, seen = controller(group, cluster=cluster)
    run.run(call())
    assert group.attempts[0][1].nodes == frozenset({"node-0", "node-1"})  # both watched
    assert kinds(run) == ["decision", "resize", "preemption"]
    assert "moved rank(s) [1] off draining node(s)" in run.events[-1].message
    assert run.failures == 0 and group.world_size == 2 and len(group.attempts) == 2
    assert Phase.MOVING in [t.after for t in seen]


def test_spares_up_inside_a_call_join_it_at_a_step_boundary() -> None:
    group = TrainGroup(2, room=2, script=[])

    def spare_up() -> str:
        group.spares_starting, group.spares_up = 0, 1
        return SPARE

    group.script = [lambda: died(group, [1]), spare_up, None]
    run, seen = controller(group, policy=ElasticPolicy())
    run.run(call())
    assert kinds(run) == ["failure", "decision", "resize", "recovered", "decision", "resize"]
    assert "resized (grow) 1 -> 2" in run.events[-1].message
    assert group.attempts[1][1].joining == (("ref",),)  # the smaller group watched the spare
    assert group.world_size == 2 and [t.after for t in seen].count(Phase.JOINING) == 1


def test_a_worker_lost_while_the_state_is_restored_is_one_more_loss() -> None:
    group = TrainGroup(2, room=2, script=[])
    group.script = [lambda: died(group, [1]), None]
    restores = iter([lambda: died(group, [0]), None])

    def restore(report: Any) -> Any:
        fault = next(restores)
        if fault is not None:
            raise fault()
        return RestoreOutcome("rank 0 at step 4", 4, 0)

    run, _ = controller(group, state=TrainState(restore))
    run.run(call())
    assert kinds(run) == [
        "failure",
        "decision",
        "restart_failed",
        "decision",
        "resize",
        "recovered",
    ]
    assert run.failures == 2 and run.events[2].ranks == (0,) and group.world_size == 2


def test_a_worker_lost_while_moving_off_a_draining_node_is_recovered_in_the_same_call() -> None:
    cluster = DrainingCluster()
    group = TrainGroup(2, room=3, script=[])

    def drain() -> str:
        cluster.drains = {"node-1": 1e12}
        # The node goes before the deadline, while the group re-forms without its worker.
        group.recover_errors.append(WorkerDiedError("node reclaimed", [1], ["node-1"]))
        return DRAIN

    group.script = [drain, None]
    run, _ = controller(group, cluster=cluster)
    run.run(call())
    assert kinds(run) == [
        "decision",
        "restart_failed",
        "preemption",
        "decision",
        "resize",
    ]
    lost = run.events[1]
    assert lost.preempted and lost.ranks == (1,)  # a loss on a node being left: a preemption
    assert "failed: a worker was lost" in run.events[2].message
    assert run.failures == 1 and group.world_size == 2 and not group.needs_recovery
    cluster.drains = {}
    run.run(call())  # the node is not watched again
    assert "node-1" not in group.attempts[-1][1].nodes


def test_a_worker_lost_while_the_asked_checkpoint_is_written_repairs_and_writes_it_again() -> None:
    group = TrainGroup(2, room=2, script=[])
    checkpoints = Checkpoints(lambda: died(group, [1]))
    run, seen = controller(group, checkpoints=checkpoints)
    run.run(call(checkpoint="auto"))
    assert checkpoints.written == ["auto"] and run.failures == 1
    assert kinds(run) == ["failure", "resize"]
    assert "repair after a failed call" in run.events[-1].message
    assert [t.after for t in seen][:4] == [
        Phase.GROWING,
        Phase.CHECKPOINTING,
        Phase.REPAIRING,
        Phase.SUCCEEDED,
    ]
    assert [t.checkpoint_s > 0 for t in seen].count(True) == 1


def test_a_policy_that_never_retries_gives_up_naming_the_loss() -> None:
    group = TrainGroup(2, room=2, script=[])
    group.script = [lambda: died(group, [1])]
    run, _ = controller(group, policy=NeverRetryPolicy())
    with pytest.raises(RuntimeError, match="rank"):
        run.run(call())
    assert run.phase is Phase.GAVE_UP and kinds(run) == ["failure", "decision"]


def test_goodput_charges_the_backoff_that_was_waited_and_no_grow_put_off() -> None:
    group = TrainGroup(2, room=0, script=[])  # every worker lost with its node
    group.script = [lambda: died(group, [0, 1]), None]
    run, _ = controller(group, cluster=FakeCluster(nodes_alive=False))
    meter = GoodputMeter()
    run.log.subscribe(meter.take)
    run.subscribe(meter.on_transition)
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the room comes back during the backoff
        slept.append(seconds)
        group.room = 2
        time.sleep(0.05)

    run._sleep = sleep
    run.run(call())
    waits = [e for e in run.events if e.kind == "decision" and e.action == "wait"]
    assert len(waits) == 1 and waits[0].duration_s == slept[0] == 0.5
    waited = meter.report(failures=1)["lost_s"]["waiting"]
    assert 0.05 <= waited < 0.5  # what the wait took, not what the policy said
    # A grow that starts nobody puts the next grows off; that is no wait of the call's.
    group.world_size, group.room = 1, 1
    group.estimate_fitting = lambda: 1  # type: ignore[method-assign]  # room that is not real
    run.run(call())
    put_off = [e for e in run.events if e.kind == "decision" and e.action == "wait"][-1]
    assert "not trying again for 30 s" in put_off.message
    assert meter.report(failures=1)["lost_s"]["waiting"] == waited


def test_the_losses_of_a_call_count_against_one_budget_across_its_joins_and_moves() -> None:
    group = TrainGroup(2, room=2, script=[])

    def spare_up() -> str:
        group.spares_starting, group.spares_up = 0, 1
        return SPARE

    # Lost, a replacement joins at a step boundary, lost again: two losses in one call.
    group.script = [lambda: died(group, [1]), spare_up, lambda: died(group, [1]), None]
    run, _ = controller(group, policy=ElasticPolicy())
    with pytest.raises(
        RuntimeError, match=re.escape("2 failure(s) in this train() call exceed max_retries=1")
    ):
        run.run(call(max_retries=1))
    assert kinds(run)[-2:] == ["failure", "decision"] and run.phase is Phase.GAVE_UP
    # The next call has a budget of its own.
    group.script = [lambda: died(group, [1]), None]
    run.run(call(max_retries=1))
    assert run.failures == 3 and run.failures_this_call == 1


def test_the_phase_graph_allows_the_paths_a_run_takes_and_no_other() -> None:
    from raysgd._internal.driver.phases import legal

    runs = [
        [Phase.IDLE, Phase.GROWING, Phase.RUNNING, Phase.SUCCEEDED, Phase.IDLE],
        [Phase.IDLE, Phase.RUNNING, Phase.FAILED, Phase.WAITING, Phase.FAILED, Phase.RESTARTING],
        [Phase.RESTARTING, Phase.RUNNING, Phase.JOINING, Phase.RUNNING, Phase.MOVING],
        [Phase.MOVING, Phase.RUNNING, Phase.REPAIRING, Phase.FAILED, Phase.GAVE_UP],
        [Phase.GAVE_UP, Phase.GROWING, Phase.CHECKPOINTING, Phase.RUNNING],
        [Phase.SUCCEEDED, Phase.REPAIRING, Phase.SUCCEEDED],
    ]
    for run in runs:
        assert all(legal(a, b) for a, b in zip(run, run[1:])), run
    for before, after in [
        (Phase.IDLE, Phase.RESTARTING),  # a restart follows a decision, never a rest
        (Phase.WAITING, Phase.RUNNING),  # a backoff goes back to the policy first
        (Phase.RUNNING, Phase.IDLE),  # a call ends in SUCCEEDED or a failure
        (Phase.JOINING, Phase.SUCCEEDED),
        (Phase.RESTARTING, Phase.SUCCEEDED),
    ]:
        assert not legal(before, after), (before, after)


def test_a_grow_that_started_nobody_is_put_off_for_longer_each_time_up_to_a_bound() -> None:
    from raysgd._internal.driver.decide import grow_backoff

    waits, wait = [], 0.0
    for _ in range(7):
        wait = grow_backoff(wait)
        waits.append(wait)
    assert waits == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0]


def test_room_and_fruitless_attempts_as_the_failure_policy_is_told_them() -> None:
    from raysgd._internal.driver.decide import count_fruitless, fitting

    # No estimate (the cluster did not answer): the workers wanted, so that a recovery is tried.
    assert fitting(None, 4) == 4 and fitting(2, 4) == 2 and fitting(-1, 4) == 0
    # A wait, or a restart that started and lost nobody, came to nothing; one that lost a
    # worker is that loss (counted as one), one that started workers is progress.
    assert count_fruitless(1, started=False, lost=False) == 2
    assert count_fruitless(1, started=False, lost=True) == 1
    assert count_fruitless(1, started=True, lost=False) == 1
