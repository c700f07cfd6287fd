"""Whether a worker changed its optimizers in the batch it has not finished, and undoing that.

A worker interrupted in the middle of a batch (a peer died in a collective) may already have
stepped some of its optimizers: a GAN's discriminator but not yet its generator. Its state then
belongs to no step at all, so recovery must not copy it to anyone. The journal hooks every
registered optimizer (`Optimizer.register_step_pre_hook` / `register_step_post_hook`):

- a step marks the batch *dirty* until the batch is finished (`commit`);
- with several optimizers it also keeps, before an optimizer's first step in a batch, a copy of
  that optimizer's parameters and state on their device, so that `rollback` can bring an
  interrupted worker back to the last finished step. With one optimizer nothing is copied: its
  step is the last thing a batch does that a peer can interrupt, so a dirty worker is rare, and it
  is then simply not used as a source.

A forward pass in training mode also changes state: the running statistics of normalisation
layers (BatchNorm's mean, variance and batch count). A survivor interrupted after its forward pass
would otherwise go on from step k with statistics that already saw batch k + 1, and count that
batch twice when it is redone. The journal keeps a copy of those buffers as they were when the
last batch finished (a few numbers per channel, copied in place at every `commit`), and `rollback`
puts them back. Other buffers are left alone: a model that changes them in its forward pass is
restored with them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

__all__ = ["StepJournal"]

_ABSENT = object()


def _copy_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    return state


class StepJournal:
    """Tracks optimizer steps between batch boundaries (see the module docstring)."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        models: Sequence[torch.nn.Module] = (),
        before_step: Optional[Callable[[], None]] = None,
    ) -> None:
        """`before_step()`, when given, is called before every optimizer step, once the
        journal has taken what it keeps (see `OperatorRunner.add_before_step_hook`)."""
        self.optimizers = list(optimizers)
        self._before_step = before_step
        #: (buffer, its copy at the last finished batch) of every running statistic.
        self._statistics = [(buffer, buffer.detach().clone()) for buffer in _running_stats(models)]
        #: Copies are kept only when a batch may step several optimizers.
        self.keeps_copies = len(self.optimizers) > 1
        self.dirty = False
        # optimizer index -> (parameter copies, per-parameter state copies)
        self._saved: dict[int, tuple[list[torch.Tensor], list[Any]]] = {}
        self._handles: list[Any] = []
        for index, optimizer in enumerate(self.optimizers):
            self._handles.append(optimizer.register_step_pre_hook(self._before(index)))
            self._handles.append(optimizer.register_step_post_hook(self._after))

    def _params(self, index: int) -> list[torch.Tensor]:
        return [p for group in self.optimizers[index].param_groups for p in group["params"]]

    def _before(self, index: int) -> Any:
        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._keep(index, optimizer)
            if self._before_step is not None:
                self._before_step()

        return hook

    def _keep(self, index: int, optimizer: Any) -> None:
        """Copy optimizer `index`'s parameters and state before its first step in the batch
        (only when a batch may step several optimizers)."""
        if not self.keeps_copies or index in self._saved:
            return
        params = self._params(index)
        with torch.no_grad():
            copies = [p.detach().clone() for p in params]
        states = [
            _copy_state(optimizer.state[p]) if p in optimizer.state else _ABSENT for p in params
        ]
        self._saved[index] = (copies, states)

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.dirty = True

    def commit(self) -> None:
        """The batch is finished: forget its copies and remember the running statistics."""
        self.dirty = False
        if self._saved:
            self._saved = {}
        if self._statistics:
            with torch.no_grad():
                for buffer, copy in self._statistics:
                    copy.copy_(buffer)

    def rollback(self) -> bool:
        """Undo the unfinished batch's optimizer steps where copies exist, and its forward
        passes' running statistics; True if the worker is now at its last finished step."""
        if self._statistics:
            with torch.no_grad():
                for buffer, copy in self._statistics:
                    buffer.copy_(copy)
        if not self.dirty:
            return True
        if not self.keeps_copies:
            return False
        with torch.no_grad():
            for index, (copies, states) in self._saved.items():
                optimizer = self.optimizers[index]
                for param, copy, state in zip(self._params(index), copies, states):
                    param.copy_(copy)
                    if state is _ABSENT:
                        optimizer.state.pop(param, None)
                    else:
                        optimizer.state[param] = state
        self.commit()
        return True

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _running_stats(models: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The running-statistics buffers of the normalisation layers in `models` that keep them."""
    found: dict[int, torch.Tensor] = {}
    for model in models:
        for module in model.modules():
            if not getattr(module, "track_running_stats", False):
                continue
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buffer = getattr(module, name, None)
                if isinstance(buffer, torch.Tensor):
                    found.setdefault(id(buffer), buffer)
    return list(found.values())
