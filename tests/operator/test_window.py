"""Going back to the start of an accumulation window: after an interrupted batch (what a lost peer
does to a survivor) or through a state saved inside a window, one worker ends with the weights of
a run never interrupted, bit for bit, although every batch draws from torch's, Python's and
NumPy's generators and carries a per-rank state."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd_operator import NUM_SAMPLES, OperatorRunner, TrainingOperator


class Interrupted(RuntimeError):
    """Stands for the collective a lost peer breaks."""


class DrawingOperator(TrainingOperator):
    """A model with dropout whose every batch also draws from Python's and NumPy's generators
    and adds to a per-rank state; `config["fail_at"]` (a list) names the global steps at which a
    batch is interrupted once, after its backward pass."""

    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        random.seed(1)
        np.random.seed(2)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss(), schedulers=scheduler
        )
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(72, 6, generator=gen)  # 18 batches of 4: windows of 4 span epochs
        y = torch.randn(72, 2, generator=gen)
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
            validation_loader=DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4, shuffle=True),
        )
        self.carried = torch.zeros(2)
        self.fail_at = config.get("fail_at", [])

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        features, target = batch
        # Its own window size when given one (raysgd is not told it), else the trainer's.
        k = self.config.get("own_k") or self.accumulate_grad_batches
        if self.global_step % k == 0:
            self.optimizer.zero_grad()
        noise = random.random() + float(np.random.rand())
        output = self.model(features) + 0.01 * self.carried
        loss = self.criterion(output, target) * (1 + 0.01 * noise)
        (loss / k).backward()
        self.carried = 0.5 * self.carried + output.detach().mean(dim=0)
        if self.global_step in self.fail_at:
            self.fail_at.remove(self.global_step)
            raise Interrupted(f"interrupted at global step {self.global_step}")
        if (self.global_step + 1) % k == 0:
            self.optimizer_step()
        return {"train_loss": loss.detach(), NUM_SAMPLES: len(target)}

    def validate_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        features, target = batch  # a regression: no accuracy
        return {"val_loss": self.criterion(self.model(features), target), NUM_SAMPLES: len(target)}

    def rank_state_dict(self) -> Any:
        return {"carried": self.carried}

    def load_rank_state_dict(self, state: Any) -> None:
        self.carried = torch.zeros(2) if state is None else state["carried"].clone()


def _runner(**config: Any) -> OperatorRunner:
    # distributed: raysgd's own sampler, as every worker of a trainer has (one worker here).
    return OperatorRunner(
        DrawingOperator,
        config,
        accumulate_grad_batches=1 if config.get("own_k") else 4,
        scheduler_step_freq="epoch",
        distributed=True,
    )


def _weights(runner: OperatorRunner) -> list[torch.Tensor]:
    return [t.clone() for m in runner.get_models() for t in m.state_dict().values()]


def _equal(a: OperatorRunner, b: OperatorRunner) -> None:
    for x, y in zip(_weights(a), _weights(b)):
        assert torch.equal(x, y)
    assert torch.equal(a.operator.carried, b.operator.carried)
    assert a.operator.scheduler.last_epoch == b.operator.scheduler.last_epoch
    assert (a.position.step, a.operator.global_step, a.position.epoch) == (
        b.position.step,
        b.operator.global_step,
        b.position.epoch,
    )


def _train(runner: OperatorRunner, calls: list[int | None]) -> list[dict[str, Any]]:
    """Each call of `calls` (its num_steps), each interrupted call gone back over and continued
    (the same call id), as the trainer does after a recovery."""
    results = []
    for call_id, num_steps in enumerate(calls):
        while True:
            try:
                results.append(runner.train_epoch(num_steps=num_steps, call_id=call_id))
                break
            except Interrupted:
                runner.position.progress()
    return results


@pytest.mark.parametrize(
    ("calls", "fail_at", "own_k"),
    [
        ([None, None], [6], None),  # inside the window of steps 4-7
        ([None, None], [16, 19], None),  # a window across the epochs' boundary, twice
        ([6, 6, None, None], [7], None),  # the window began in the call before
        # A loop that accumulates over 4 batches without telling raysgd: its windows are
        # followed from its optimizer steps.
        ([None, None], [6, 19], 4),
    ],
)
def test_an_interrupted_window_is_done_again_whole(calls: list, fail_at: list, own_k: Any) -> None:
    clean = _runner(own_k=own_k)
    expected = _train(clean, calls)
    faulted = _runner(fail_at=list(fail_at), own_k=own_k)
    got = _train(faulted, calls)
    _equal(clean, faulted)
    # Each call counts every one of its batches once, whatever was done again.
    assert [r["batch_count"] for r in got] == [r["batch_count"] for r in expected]


def test_progress_goes_back_to_the_window_start_and_says_how_far_it_got() -> None:
    runner = _runner(fail_at=[6])
    with pytest.raises(Interrupted):
        runner.train_epoch()
    progress = runner.position.progress()
    assert (progress.step, progress.reached, progress.clean) == (4, 7, True)
    assert runner.position.step == 4 and runner.operator.global_step == 4
    assert all(p.grad is None for p in runner.operator.model.parameters())


def _reload(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_state_saved_inside_a_window_is_its_start_and_loading_it_redoes_the_window() -> None:
    clean = _runner()
    clean.train_epoch(num_steps=6)
    state = _reload({**clean.state.state_dict(), "slot": clean.state.rank_slot()})
    assert (state["step"], state["trained_to"]) == (4, 6)
    _train(clean, [6, None, None])

    loaded = _runner()
    loaded.state.load_state_dict(state)
    loaded.state.load_rank_slot(state["slot"])
    # The next call does steps 4 and 5 again (not its own), then six of its own, as the
    # uninterrupted run's second call did.
    first = loaded.train_epoch(num_steps=6)
    assert first["batch_count"] == 6 and loaded.position.step == 12
    _train(loaded, [None, None])
    _equal(clean, loaded)


def test_a_worker_a_window_ahead_of_the_source_goes_back_with_it_counting_each_batch_once() -> None:
    # The window's last all-reduce ended on this worker (it stepped to 8) but failed on its peer
    # (back at 4): the group goes on from the peer's state, place, call and this rank's slot of
    # step 4 (a ring peer's copy; the peer's own here, drawn from the same seeds). The window's
    # batches this worker recorded are recorded again, so it forgets them.
    clean = _runner()
    expected = clean.train_epoch(call_id=0)
    # One after the other: the runners of one process share the global generators, which each
    # seeds when it is built.
    ahead = _runner(fail_at=[8])
    with pytest.raises(Interrupted):
        ahead.train_epoch(call_id=0)
    ahead.position.progress()
    behind = _runner(fail_at=[7])
    with pytest.raises(Interrupted):
        behind.train_epoch(call_id=0)
    behind.position.progress()
    assert (ahead.position.step, behind.position.step) == (8, 4)
    ahead.state.load_state_dict(behind.state.state_dict())
    ahead.position.adopt(behind.position.position_state(), behind.position.call)
    ahead.state.load_rank_slot(behind.state.rank_slot())
    result = ahead.train_epoch(call_id=0)
    _equal(clean, ahead)
    assert result["num_samples"] == expected["num_samples"] == 72
    assert result["batch_count"] == expected["batch_count"] == 18


def _next_draw() -> float:
    """The next number torch's generator would give, without drawing it."""
    return float(torch.rand(1, generator=torch.Generator().set_state(torch.get_rng_state())))


def test_epoch_ends_belong_to_the_state_once_per_epoch_whatever_the_calls() -> None:
    # One epoch is 18 batches; windows of 4. The uninterrupted job: one call per epoch with a
    # validation after each. The other: calls of 5 batches (an epoch's end inside a call, and
    # calls ending inside an epoch), a validation where the first job had one, and a peer lost
    # at the end of a call, which the call is then asked to go on with.
    clean = _runner()
    for _ in range(2):
        clean.train_epoch()
        clean.validate()
    # "epoch" schedulers stepped once per epoch, not once per call.
    assert clean.operator.scheduler.last_epoch == 2

    split = _runner()
    steps = 0
    for call_id, num_steps in enumerate([5, 5, 5, 3, 5, 5, 5, 3]):
        split.train_epoch(num_steps=num_steps, call_id=call_id)
        steps += num_steps
        assert split.operator.scheduler.last_epoch == steps // 18
        if steps % 18 == 0:
            split.validate()
    _equal(clean, split)
    # The validation's draws (its loader's seed) are in the window start it ran at: a state
    # saved now, or a peer's copy of this rank's slot, holds them.
    assert _next_draw() == pytest.approx(
        float(torch.rand(1, generator=_generator_of(split.state.rank_slot())))
    )


def _generator_of(slot: dict[str, Any]) -> torch.Generator:
    from raysgd_operator._internal.rng import set_generator_state

    generator = torch.Generator()
    set_generator_state(generator, slot["rng"]["torch"])
    return generator


def test_a_call_asked_again_after_it_ended_trains_and_draws_nothing() -> None:
    # A peer lost once this worker was done with the call (its result on the way): the driver
    # asks for the same call again. Nothing is left of it: no batch, and no new pass (which
    # would draw its loader's seed from torch's generator).
    # Without accumulation: the epoch's end is a window's (a call that ended inside a window
    # goes back to the window's start and does its batches again).
    runner = _runner(own_k=1)
    first = runner.train_epoch(call_id=0)
    runner.position.progress()
    before = (_next_draw(), runner.position.step, runner.position.epoch)
    again = runner.train_epoch(call_id=0)
    assert (
        (_next_draw(), runner.position.step, runner.position.epoch) == before == (before[0], 18, 1)
    )
    assert again["batch_count"] == first["batch_count"] == 18
