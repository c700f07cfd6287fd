"""Who restores whom after a resize: the clean worker furthest along is the source; torn workers,
workers behind it and replacements receive its state; the steps redone are those started and
lost."""

from __future__ import annotations

from raysgd._internal.restore_plan import plan_restore
from raysgd_operator import Progress


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
