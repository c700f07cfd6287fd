"""Who restores whom after a resize: the clean worker furthest along is the source; torn workers,
workers behind it and replacements receive its state; the steps redone are those started and
lost."""

from __future__ import annotations

from typing import Any

from raysgd._internal.protocol import Holding, RestorePlan, SlotCopy
from raysgd._internal.state.replicated import plan_from_peers
from raysgd_operator import Progress


def plan_restore(progress: list[Any]) -> RestorePlan:
    return plan_from_peers([Holding(p) for p in progress])


def _p(step: int, *, clean: bool = True, in_batch: bool = False) -> Progress:
    return Progress(step=step, epoch=1, clean=clean, in_batch=in_batch)


def test_the_clean_survivor_furthest_along_is_the_source() -> None:
    # Rank 0 finished 40 steps and was inside the 41st; rank 1 finished only 39 (it was slower
    # to commit); rank 2 is a replacement.
    plan = plan_restore([_p(40, in_batch=True), _p(39, in_batch=True), None])
    assert (plan.source, plan.step) == (0, 40)
    assert plan.receivers == (1, 2)
    assert plan.steps_redone == 1  # only the step in flight


def test_a_torn_worker_is_never_the_source_even_when_furthest() -> None:
    # Rank 1 stepped one of its two optimizers in step 41 and could not roll back.
    plan = plan_restore([_p(40, in_batch=True), _p(40, clean=False, in_batch=True)])
    assert (plan.source, plan.step, plan.receivers) == (0, 40, (1,))
    assert plan.steps_redone == 1


def test_ties_go_to_the_lowest_rank_and_nothing_is_redone_between_steps() -> None:
    plan = plan_restore([None, _p(12), _p(12)])
    assert (plan.source, plan.receivers, plan.steps_redone) == (1, (0,), 0)


def test_without_a_clean_worker_there_is_no_source() -> None:
    plan = plan_restore([None, _p(7, clean=False, in_batch=True)])
    assert plan.source is None and plan.receivers == (0, 1)


def _held(step: int, call_id: int, parts: dict, rows: int = 0, loop_s: float = 0.0) -> Any:
    from raysgd._internal.protocol import HeldSnapshot
    from raysgd_operator import CallRecord

    call = CallRecord(
        call_id=call_id, num_steps=None, start_step=4, steps=step - 4, rows=rows, loop_s=loop_s
    )
    return HeldSnapshot(step, 2, b"meta", {"epoch": 1}, call, parts)


def _meters(batches: int) -> Any:
    from raysgd_operator import AverageMeterCollection

    meters = AverageMeterCollection()
    for _ in range(batches):
        meters.update({"loss": 1.0}, n=8)
    return meters


def test_the_newest_snapshot_whose_every_part_survived_is_restored() -> None:
    from raysgd._internal.state.sharded import plan_from_snapshots
    from raysgd_operator import CallRecord

    call = CallRecord(call_id=2, num_steps=None, start_step=4, steps=3, rows=48, loop_s=3.0)
    survivor = Progress(step=7, epoch=2, clean=True, in_batch=True, call=call)
    # Rank 0 holds its own part and rank 1's of the snapshots at steps 5 and 6; step 6 lacks
    # rank 1's part (its swap was cut short), so step 5 is the newest complete one.
    held = [
        _held(5, 2, {0: _meters(1), 1: _meters(1)}, rows=16, loop_s=1.0),
        _held(6, 2, {0: _meters(2)}, rows=32, loop_s=2.0),
    ]
    plan = plan_from_snapshots([Holding(survivor, tuple(held)), Holding(None)], world_size=2)
    assert plan.found and plan.step == 5 and plan.call is not None
    assert plan.call.call_id == call.call_id and plan.call.start_step == call.start_step
    # The call's rows, and its loop time, are those up to the snapshot: the redone steps are
    # not counted twice.
    assert plan.call.rows == 16 and plan.call.loop_s == 1.0
    assert plan.steps_redone == 3  # 6 and 7 finished, 8 in flight: all redone from 5
    assert plan.snapshot is not None and plan.snapshot.holders == {0: 0, 1: 0}
    assert [m.summary()["num_samples"] for m in plan.snapshot.meters] == [8, 8]


def test_a_snapshot_of_the_call_before_brings_no_metrics_into_this_one() -> None:
    from raysgd._internal.state.sharded import plan_from_snapshots
    from raysgd_operator import CallRecord

    # Taken at the last step of call 1, which is also the first step of call 2: call 1's
    # metrics must not be counted again in call 2.
    call = CallRecord(call_id=2, num_steps=None, start_step=4, steps=1, rows=16)
    survivor = Progress(step=5, epoch=2, clean=True, in_batch=False, call=call)
    held = _held(4, 1, {0: _meters(4), 1: _meters(4)}, rows=64, loop_s=4.0)
    plan = plan_from_snapshots([Holding(survivor, (held,)), Holding(None)], world_size=2)
    assert plan.step == 4 and plan.call is not None and plan.call.call_id == 2
    assert plan.call.rows == 0 and plan.call.loop_s == 0.0  # nor its rows and time
    assert plan.snapshot is not None and plan.snapshot.meters == [None, None]


def test_without_every_part_there_is_nothing_to_restore_from() -> None:
    from raysgd._internal.state.sharded import missing_parts, plan_from_snapshots

    held = _held(5, 2, {0: None})
    holdings = [Holding(_p(5), (held,)), Holding(None)]
    assert not plan_from_snapshots(holdings, world_size=2).found
    assert missing_parts(holdings) == [1]


def test_one_rule_picks_the_newest_step_every_part_of_which_a_live_worker_holds() -> None:
    from raysgd._internal.state.plan import newest_held_step

    # Ranks 0 and 1 each hold both parts of step 8 (their own and the peer's copy); rank 2 holds
    # one of three parts of step 10, which cannot be rebuilt. The lowest rank holds each part.
    offers = [(2, 10, 3, (0,)), (1, 8, 2, (1, 0)), (0, 8, 2, (0, 1))]
    assert newest_held_step(offers) == (8, {0: 0, 1: 0})
    assert newest_held_step([(1, 10, 3, (0, 2))]) is None
    # A whole state is one part: the newest clean step, ties to the lowest rank.
    assert newest_held_step([(2, 5, 1, (0,)), (1, 5, 1, (0,)), (0, 4, 1, (0,))]) == (5, {0: 1})


def test_each_rank_of_a_group_that_kept_its_size_gets_its_ranks_slot() -> None:
    # Four ranks trained in group 3; old rank 1 was lost. The re-formed group renumbers the
    # survivors (0, 2, 3 -> 0, 1, 2) and the replacement is rank 3; slots follow rank numbers.
    def survivor(old: int, step: int = 8, peer: tuple = ()) -> Holding:
        return Holding(_p(step), rank=(old, 3), peer_slots=tuple(SlotCopy(*c) for c in peer))

    holdings = [
        survivor(0, peer=((3, 3, 8),)),
        survivor(2, peer=((1, 3, 8),)),  # rank 2 keeps its ring predecessor's (rank 1's) slot
        survivor(3, peer=((2, 3, 8),)),
        Holding(None),
    ]
    plan = plan_from_peers(holdings, rank_sources=(0, 1, 2, 3))
    moves = {(m.rank, m.holder, m.receiver, m.replica) for m in plan.slot_moves}
    # New rank 1 (old 2) takes rank 1's slot from its own copy; new rank 2 (old 3) rank 2's
    # from old 2 (its own slot); the replacement rank 3's from old 3.
    assert moves == {(1, 1, 1, True), (2, 1, 2, False), (3, 2, 3, False)}
    assert plan.inexact == ()


def test_a_slot_no_live_worker_holds_makes_the_plan_say_it_is_not_exact() -> None:
    # Rank 1 and its ring successor (rank 2, which kept rank 1's slot) were lost together; a
    # survivor still at the window before (step 4) has no slot of step 8 to give either.
    holdings = [
        Holding(_p(8), rank=(0, 5), peer_slots=(SlotCopy(3, 5, 8),)),
        Holding(_p(4), rank=(3, 5), peer_slots=(SlotCopy(2, 5, 4),)),
        Holding(None),
        Holding(None),
    ]
    plan = plan_from_peers(holdings, rank_sources=(0, 1, 2, 3))
    assert plan.step == 8 and plan.source == 0
    assert len(plan.inexact) == 2
    assert "rank 1 at step 8" in plan.inexact[0] and "rank 2 at step 8" in plan.inexact[1]
    # Rank 3's slot of step 8 is rank 0's copy: moved, and rank 3's survivor (now rank 1)
    # receives the state (it was a window behind).
    assert [(m.rank, m.holder, m.receiver) for m in plan.slot_moves] == [(3, 0, 3)]
    assert 1 in plan.receivers


def test_survivors_a_window_apart_go_back_to_the_window_every_slot_is_held_of() -> None:
    # The last batch's gradient all-reduce of window 4-7 ended on rank 3 but failed on ranks 0
    # and 2 when rank 1 died: rank 3 stepped to 8 (and waits for rank 2's slot of step 8), the
    # others went back to 4. Step 8's model is held, but not ranks 0, 1 and 2's slots of it;
    # step 4's model and every slot of step 4 are: the group redoes the window from there.
    def at(step: int, old: int, predecessor: int, in_batch: bool) -> Holding:
        progress = Progress(
            step=step, epoch=0, clean=True, in_batch=in_batch, reached=8 if in_batch else step
        )
        return Holding(progress, rank=(old, 5), peer_slots=(SlotCopy(predecessor, 5, 4),))

    holdings = [at(4, 0, 3, True), Holding(None), at(4, 2, 1, True), at(8, 3, 2, False)]
    plan = plan_from_peers(holdings, rank_sources=(0, 1, 2, 3))
    assert (plan.step, plan.source, plan.steps_redone) == (4, 0, 4)
    assert plan.receivers == (1, 3) and plan.inexact == ()
    moves = {(m.rank, m.holder, m.receiver, m.replica) for m in plan.slot_moves}
    # The replacement takes rank 1's slot from rank 2's copy; rank 3, a window ahead, its own
    # slot of step 4 from rank 0's copy.
    assert moves == {(1, 2, 1, True), (3, 0, 3, True)}


def test_a_validation_inside_the_interrupted_window_is_named() -> None:
    progress = Progress(step=4, epoch=1, clean=True, in_batch=False, reached=6, interleaved=True)
    plan = plan_from_peers(
        [Holding(progress, rank=(0, 1), peer_slots=(SlotCopy(1, 1, 4),)), Holding(None)],
        rank_sources=(0, 1),
    )
    assert plan.steps_redone == 2
    assert any("validation" in reason for reason in plan.inexact)


def test_a_snapshot_without_a_ranks_slot_makes_the_sharded_plan_say_it_is_not_exact() -> None:
    from raysgd._internal.state.sharded import Sharded
    from raysgd._internal.worker.state import RANK_SLOTS

    survivor = Progress(step=6, epoch=1, clean=True, in_batch=True, reached=7)

    def holdings(state: dict, interleaved: bool = False) -> list[Holding]:
        held = _held(5, 2, {0: None, 1: None})
        held = type(held)(held.step, 2, held.metadata, state, held.call, held.parts)
        progress = Progress(**{**vars(survivor), "interleaved": interleaved})
        return [Holding(progress, (held,)), Holding(None)]

    slots = [{"rng": b"0"}, {"rng": b"1"}]
    kind = Sharded()
    exact = kind.plan(holdings({RANK_SLOTS: slots}), 2, (0, 1))
    assert exact.found and exact.step == 5 and exact.inexact == ()
    # Rank 1's slot is not in the snapshot (its gathering failed): its replacement cannot draw
    # what rank 1 would have.
    lost = kind.plan(holdings({RANK_SLOTS: [slots[0], None]}), 2, (0, 1))
    assert len(lost.inexact) == 1 and "rank 1 at step 5" in lost.inexact[0]
    assert len(kind.plan(holdings({}), 2, (0, 1)).inexact) == 2
    # A validation inside the interrupted window is named, as for a replicated state.
    redone = kind.plan(holdings({RANK_SLOTS: slots}, interleaved=True), 2, (0, 1))
    assert any("validation" in reason for reason in redone.inexact)


def test_going_back_past_a_validation_says_the_steps_redone_draw_without_it() -> None:
    from raysgd._internal.state.sharded import Sharded
    from raysgd._internal.worker.state import RANK_SLOTS

    # A validation ran at step 6 (a window start); the newest snapshot every part of which
    # survived is that of step 5: the steps from 5 are redone without the validation's draws.
    held = _held(5, 2, {0: None, 1: None})
    held = type(held)(5, 2, held.metadata, {RANK_SLOTS: [{}, {}]}, held.call, held.parts)

    def survivor(validated_at: int) -> list[Holding]:
        progress = Progress(step=6, epoch=1, clean=True, in_batch=True, validated_at=validated_at)
        return [Holding(progress, (held,)), Holding(None)]

    plan = Sharded().plan(survivor(6), 2, (0, 1))
    assert plan.step == 5 and len(plan.inexact) == 1 and "step 6" in plan.inexact[0]
    assert Sharded().plan(survivor(5), 2, (0, 1)).inexact == ()
    # A whole state goes on from the survivors' own window start, after the validation.
    whole = plan_from_peers(
        [Holding(Progress(step=6, epoch=1, clean=True, in_batch=True, validated_at=6))]
    )
    assert whole.step == 6 and whole.inexact == ()
