"""Every row once per epoch, from any row on, over any number of workers; and a call that a
failure interrupted goes on from its last finished step (the worker side of recovery)."""

from __future__ import annotations

import dataclasses
import io
import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raysgd_operator import OperatorRunner, TrainingOperator
from raysgd_operator._internal.epoch_plan import EpochSampler, step_sizes
from raysgd_operator._internal.loaders import rebuild_loader


def _sampler(n: int, p: int, r: int, b: int, **kwargs: Any) -> EpochSampler:
    return EpochSampler(range(n), num_replicas=p, rank=r, batch_size=b, **kwargs)


@pytest.mark.parametrize(
    ("remaining", "p", "b", "drop_last", "sizes"),
    [
        (64, 2, 8, False, [16] * 4),
        (70, 2, 8, False, [16] * 4 + [6]),  # a short last step that gives every worker a row
        (65, 2, 8, False, [16] * 3 + [17]),  # one row left: merged into the step before
        (66, 3, 8, False, [24, 24, 18]),
        (2, 3, 8, False, [2]),  # fewer rows than workers altogether
        (70, 2, 8, True, [16] * 4),
        (0, 2, 8, False, []),
    ],
)
def test_step_sizes(remaining: int, p: int, b: int, drop_last: bool, sizes: list[int]) -> None:
    assert step_sizes(remaining, p, b, drop_last=drop_last) == sizes


@pytest.mark.parametrize(
    ("n", "p", "b"), list(itertools.product((512, 513, 65, 7), (1, 2, 3), (4, 21)))
)
@pytest.mark.parametrize("pad", [True, False])
def test_every_row_once_with_equal_step_counts(n: int, p: int, b: int, pad: bool) -> None:
    ranks = [_sampler(n, p, r, b, shuffle=True, seed=3, pad=pad) for r in range(p)]
    for sampler in ranks:
        sampler.set_epoch(5)
    batches = [list(s.batches()) for s in ranks]
    rows = [row for per_rank in batches for batch in per_rank for row in batch]
    if n >= p or not pad:
        assert sorted(rows) == list(range(n))  # every row once: no padding, nothing dropped
    if n >= p:
        assert len({len(per_rank) for per_rank in batches}) == 1  # every worker takes each step
    assert [len(s) for s in ranks] == [sum(map(len, per_rank)) for per_rank in batches]


def test_full_steps_match_distributed_sampler() -> None:
    data = range(96)
    for r in range(3):
        ours = _sampler(96, 3, r, 8, shuffle=True)
        theirs = DistributedSampler(data, num_replicas=3, rank=r, shuffle=True, seed=0)
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs)


def test_another_group_takes_over_mid_epoch_without_repeating_or_skipping_a_row() -> None:
    n, b = 200, 8
    before = [_sampler(n, 2, r, b, shuffle=True) for r in range(2)]
    for s in before:
        s.set_epoch(1)
    steps_done = 5
    seen = [row for s in before for batch in list(s.batches())[:steps_done] for row in batch]
    start = sum(before[0].step_sizes()[:steps_done])
    after = [_sampler(n, 3, r, b, shuffle=True) for r in range(3)]
    for s in after:
        s.set_epoch(1)
        s.set_start(start)
    seen += [row for s in after for row in s]
    assert sorted(seen) == list(range(n))


def test_a_split_loader_reads_its_plan_and_looks_like_the_users_loader() -> None:
    # The DataLoader reads a batch sampler while answering `sampler`, `batch_size` and
    # `drop_last` as the user's loader did (set past DataLoader's guard in one place): should
    # torch start to read those three, the batches below would change.
    data = TensorDataset(torch.arange(13.0))
    user = DataLoader(data, batch_size=3, shuffle=False, drop_last=False)
    loader = rebuild_loader(user, world_size=2, rank=1, batch_size=3)
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.batch_size, loader.drop_last, loader.sampler.num_replicas) == (3, False, 2)
    batches = [batch[0].tolist() for batch in loader]
    # Steps of 6 rows, rank 1 takes every other row; the 1-row tail joins the last step.
    assert batches == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]
    assert len(loader) == 2
    sampler = loader.sampler
    sampler.set_start(6)
    assert [batch[0].tolist() for batch in loader] == [[7.0, 9.0, 11.0]]


class _Regression(TrainingOperator):
    """Adam on a fixed regression; rank/size come from the runner (no process group needed)."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(48, 3, generator=gen)
        y = x @ torch.tensor([[1.0], [2.0], [-1.0]])
        self.register(
            models=model,
            optimizers=torch.optim.Adam(model.parameters(), lr=0.05),
            criterion=nn.MSELoss(),
        )
        self.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
        self.fail_at = config.get("fail_at")

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if batch_info["global_step"] == self.fail_at:
            self.fail_at = None  # once
            raise ConnectionError("a peer went away")
        return super().train_batch(batch, batch_info)


def _weights(runner: OperatorRunner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in runner.get_models()[0].parameters()]


def test_an_interrupted_call_goes_on_from_its_last_finished_step() -> None:
    straight = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    first = straight.train_epoch(call_id=1)
    second = straight.train_epoch(num_steps=4, call_id=2)

    runner = OperatorRunner(_Regression, {"fail_at": 3}, world_size=2, distributed=True)
    with pytest.raises(ConnectionError):
        runner.train_epoch(call_id=1)
    progress = runner.position.progress()
    assert (progress.step, progress.clean, progress.in_batch) == (3, True, True)
    assert progress.call is not None and progress.call.steps == 3
    # What recovery does on a survivor: go on from the source's position (here: its own).
    runner.position.adopt(runner.position.position_state(), progress.call)
    again = runner.train_epoch(call_id=1)
    assert again["batch_count"] == first["batch_count"] == 6  # 48 rows, 2 workers, batches of 4
    assert again["num_samples"] == first["num_samples"]
    assert again["train_loss"] == pytest.approx(first["train_loss"], rel=1e-6)
    assert runner.train_epoch(num_steps=4, call_id=2)["train_loss"] == pytest.approx(
        second["train_loss"], rel=1e-6
    )
    for a, b in zip(_weights(straight), _weights(runner)):
        torch.testing.assert_close(a, b)


class _TwoOptimizers(TrainingOperator):
    """A GAN-shaped step: `d` steps, then `g`; the batch can fail between the two."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        d, g = nn.Linear(2, 1), nn.Linear(2, 2)
        self.register(
            models=(d, g),
            optimizers=(
                torch.optim.Adam(d.parameters(), lr=0.1),
                torch.optim.Adam(g.parameters(), lr=0.1),
            ),
        )
        self.register_data(train_loader=[torch.randn(4, 2) for _ in range(3)])
        self.fail_between = config.get("fail_between")

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        d, g = self.models
        opt_d, opt_g = self.optimizers
        opt_d.zero_grad()
        d(batch).pow(2).mean().backward()
        opt_d.step()
        if batch_info["global_step"] == self.fail_between:
            raise ConnectionError("a peer went away between the two steps")
        opt_g.zero_grad()
        d(g(batch)).mean().backward()
        opt_g.step()
        return {"num_samples": 4}


def test_a_batch_torn_between_two_optimizers_is_rolled_back_to_its_last_finished_step() -> None:
    clean = OperatorRunner(_TwoOptimizers, {})
    clean.train_epoch(num_steps=1)
    expected = [p.detach().clone() for m in clean.get_models() for p in m.parameters()]
    expected_state = clean.components.optimizers[0].state_dict()["state"]

    torn = OperatorRunner(_TwoOptimizers, {"fail_between": 1})
    with pytest.raises(ConnectionError):
        torn.train_epoch(num_steps=2)
    assert torn.position.journal.dirty  # d stepped in the unfinished batch, g did not
    progress = torn.position.progress()  # rolls d back
    assert progress.clean and progress.step == 1 and not torn.position.journal.dirty
    got = [p.detach().clone() for m in torn.get_models() for p in m.parameters()]
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
    rolled = torn.components.optimizers[0].state_dict()["state"]
    for key in expected_state:
        for name in expected_state[key]:
            torch.testing.assert_close(rolled[key][name], expected_state[key][name])


def test_one_optimizer_keeps_no_copies_and_a_torn_worker_says_so() -> None:
    class OneStepThenFail(_Regression):
        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            metrics = super().train_batch(batch, batch_info)
            if batch_info["global_step"] == 2:
                raise ConnectionError("failed after the step")
            return metrics

    runner = OperatorRunner(OneStepThenFail, {})
    assert not runner.position.journal.keeps_copies
    with pytest.raises(ConnectionError):
        runner.train_epoch()
    progress = runner.position.progress()
    assert (progress.step, progress.clean) == (2, False)  # never a source


class _Classifier(TrainingOperator):
    """A fixed random classifier validated on 512 rows (accuracy is meaningful)."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(512, 4, generator=gen)
        y = torch.randint(0, 3, (512,), generator=gen)
        self.register(
            models=model,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
        )
        self.register_data(validation_loader=DataLoader(TensorDataset(x, y), batch_size=64))


def test_validation_counts_every_row_once_whatever_the_worker_count() -> None:
    from raysgd_operator import reduce_worker_results

    def validate(p: int) -> dict[str, Any]:
        per_worker = [
            OperatorRunner(_Classifier, {}, world_rank=r, world_size=p).validate() for r in range(p)
        ]
        return reduce_worker_results(per_worker)

    one, three = validate(1), validate(3)
    assert one["num_samples"] == three["num_samples"] == 512  # no padded duplicate (513)
    assert three["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    assert three["val_accuracy"] == pytest.approx(one["val_accuracy"], rel=1e-12)


def test_a_call_stopped_at_a_step_boundary_goes_on_later_as_one_call() -> None:
    # What a preemption notice does: a step hook stops the call at a boundary; the same call id
    # then goes on, and the call's metrics and epoch are those of one uninterrupted call.
    straight = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    whole = straight.train_epoch(call_id=1)
    runner = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    runner.add_step_hook(lambda: runner.position.step == 3 and runner.request_stop())
    part = runner.train_epoch(call_id=1)
    assert runner.yielded and part["batch_count"] == 3
    assert runner.position.call is not None and not runner.position.call.finished
    rest = runner.train_epoch(call_id=1)
    assert not runner.yielded and runner.position.call.finished
    assert (rest["epoch"], rest["batch_count"], rest["num_samples"]) == (1, 6, 24)
    assert rest["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)


def test_a_call_restored_to_an_earlier_epoch_first_finishes_that_epoch() -> None:
    # A sharded restore may go back to a snapshot from before the call (here: step 4, in epoch 1,
    # while the call was the whole of epoch 2). The call then trains the rest of epoch 1 and all
    # of epoch 2, and its metrics count epoch 2's steps only.
    straight = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    straight.train_epoch(call_id=1)
    whole = straight.train_epoch(call_id=2)
    runner = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    runner.train_epoch(num_steps=4, call_id=1)
    snapshot = runner.state.state_dict()
    runner.train_epoch(call_id=3)  # the rest of epoch 1 (a later call of its own)
    stops = [8]  # once: stopped within epoch 2, the call in progress
    runner.add_step_hook(
        lambda: runner.position.step in stops and (stops.clear() or runner.request_stop())
    )
    runner.train_epoch(call_id=2)
    call = runner.position.call
    assert call is not None and not call.finished and call.start_step == 6
    runner.state.load_state_dict(snapshot)
    runner.position.adopt_snapshot(call, None)
    assert runner.position.call.steps == -2  # two steps from before the call to do again first
    rest = runner.train_epoch(call_id=2)
    assert runner.position.step == 12 and rest["epoch"] == 2
    assert (rest["batch_count"], rest["num_samples"]) == (6, 24)
    assert rest["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)
    for a, b in zip(_weights(straight), _weights(runner)):
        torch.testing.assert_close(a, b)


def test_a_new_runner_restored_from_a_snapshot_in_the_call_counts_its_rows_once() -> None:
    # A sharded restore builds a new runner and loads a snapshot taken inside the call (step 2),
    # while the survivors had gone on to step 4: the call's rows are those up to the snapshot
    # (what the restore plan hands over), then every step from there once.
    runner = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    stops = [2, 4]
    runner.add_step_hook(
        lambda: (
            runner.position.step in stops
            and (stops.remove(runner.position.step) or True)
            and runner.request_stop()
        )
    )
    runner.train_epoch(call_id=1)
    snapshot, at_snapshot = runner.state.state_dict(), runner.position.call
    runner.train_epoch(call_id=1)
    assert runner.position.step == 4 and at_snapshot is not None and at_snapshot.rows is not None
    restored = OperatorRunner(_Regression, {}, world_size=2, distributed=True)
    restored.state.load_state_dict(snapshot)
    restored.position.adopt_snapshot(
        dataclasses.replace(runner.position.call, rows=at_snapshot.rows), None
    )
    restored.train_epoch(call_id=1)
    assert restored.position.step == 6 and restored.position.call is not None
    # The epoch's rows for the whole group (6 steps of 2 x 4), none counted twice or missed.
    assert restored.position.call.rows == 48


class _RandomShift(torch.utils.data.Dataset):
    """Rows with a random shift drawn in the loader's worker process (a random transform)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + torch.rand(3), self.y[index]


class _Augmented(_Regression):
    """`_Regression` read through two loader worker processes that each draw a random shift."""

    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        x, y = self.train_loader.dataset.tensors
        self.register_data(
            train_loader=DataLoader(_RandomShift(x, y), batch_size=4, shuffle=True, num_workers=2)
        )


def test_a_pass_resumed_mid_epoch_draws_what_its_loader_processes_drew() -> None:
    # Two loader processes draw a random shift per row, batch after batch. The resumed pass
    # draws the batches before its place again in those processes (not trained on), so that
    # the batches after it are shifted as in the pass never interrupted.
    torch.manual_seed(7)
    straight = OperatorRunner(_Augmented, {}, world_size=2, distributed=True)
    straight.train_epoch(num_steps=2, call_id=1)
    whole = straight.train_epoch(call_id=2)
    torch.manual_seed(7)
    runner = OperatorRunner(_Augmented, {}, world_size=2, distributed=True)
    runner.train_epoch(num_steps=2, call_id=1)
    runner.train_epoch(num_steps=1, call_id=2)  # one batch past the window start of step 2...
    # Through a checkpoint's bytes: what a new worker reads.
    buffer = io.BytesIO()
    torch.save((runner.state.state_dict(), runner.state.rank_slot()), buffer)
    buffer.seek(0)
    state, slot = torch.load(buffer, weights_only=True)
    assert state["step"] == 3
    resumed = OperatorRunner(_Augmented, {}, world_size=2, distributed=True)
    resumed.state.load_state_dict(state)  # ... a new worker goes on from step 3
    resumed.state.load_rank_slot(slot)
    rest = resumed.train_epoch(call_id=3)
    assert rest["batch_count"] == whole["batch_count"] - 1 == 3
    for a, b in zip(_weights(straight), _weights(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_pass_resumed_at_another_size_then_again_draws_as_the_first_resume_did() -> None:
    # A state of 2 workers (8 rows a step) taken up by 3 (12 a step) skips to its row, 16: no
    # number of steps of 12 ends there, so its loader processes start at 16. Saved again one step
    # later and resumed at 3, the pass draws from 16 again, as one never saved again does.
    def at_two() -> tuple[dict[str, Any], Any]:
        torch.manual_seed(7)
        runner = OperatorRunner(_Augmented, {}, world_size=2, distributed=True)
        runner.train_epoch(num_steps=2, call_id=1)
        return runner.state.state_dict(), runner.state.rank_slot()

    def at_three(state: dict[str, Any], slot: Any) -> OperatorRunner:
        runner = OperatorRunner(_Augmented, {}, world_size=3, distributed=True)
        runner.state.load_state_dict(state)
        runner.state.load_rank_slot(slot)
        return runner

    straight = at_three(*at_two())
    straight.train_epoch(call_id=2)
    saved_again = at_three(*at_two())
    saved_again.train_epoch(num_steps=1, call_id=2)
    buffer = io.BytesIO()
    torch.save((saved_again.state.state_dict(), saved_again.state.rank_slot()), buffer)
    buffer.seek(0)
    resumed = at_three(*torch.load(buffer, weights_only=True))
    resumed.train_epoch(call_id=2)
    for a, b in zip(_weights(straight), _weights(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
