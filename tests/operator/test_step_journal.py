"""The step journal: a worker interrupted inside a batch is brought back to its last finished step
(optimizers of a GAN stepped before the interruption, running statistics a forward pass moved), or
says it cannot be (one optimizer stepped: its state belongs to no step)."""

from __future__ import annotations

import torch
from torch import nn

from raysgd_operator._internal.step_journal import StepJournal


def _snapshot(*modules: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> list:
    tensors = [t.detach().clone() for m in modules for t in m.state_dict().values()]
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_torn_gan_step_is_rolled_back_to_the_last_finished_step() -> None:
    torch.manual_seed(0)
    disc, gen = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(2, 4)
    d_opt, g_opt = torch.optim.Adam(disc.parameters()), torch.optim.Adam(gen.parameters())
    journal = StepJournal([d_opt, g_opt], [disc, gen])

    def step(optimizer: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    # One finished batch, so that both optimizers hold state.
    step(d_opt, disc, torch.randn(8, 4))
    step(g_opt, gen, torch.randn(8, 2))
    journal.commit()
    finished = _snapshot(disc, gen, optimizers=(d_opt, g_opt))

    # The next batch steps the discriminator, then a peer dies before the generator's step.
    step(d_opt, disc, torch.randn(8, 4))
    assert journal.dirty and not _equal(_snapshot(disc, gen, optimizers=(d_opt, g_opt)), finished)
    assert journal.rollback() is True  # clean again: a source a restore may use
    assert _equal(_snapshot(disc, gen, optimizers=(d_opt, g_opt)), finished)
    assert not journal.dirty


def test_one_stepped_optimizer_is_not_clean_and_statistics_go_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    journal = StepJournal([opt], [model])
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    journal.commit()
    finished = _snapshot(model)

    # Interrupted in the all-reduce after the forward pass: no optimizer stepped, but the
    # running statistics already saw the batch. Rolled back, the worker is its last step.
    model(torch.randn(8, 3) + 5.0)
    assert not _equal(_snapshot(model), finished)
    assert journal.rollback() is True and _equal(_snapshot(model), finished)

    # Its only optimizer stepped, then the batch was interrupted: nothing to roll back to, so
    # the worker says it is not clean (never the source of a restore).
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    assert journal.rollback() is False
