"""`StateIO`: what one worker's run saves and loads.

A state describes the start of the accumulation window in progress (`RunPosition.window`): the
models and optimizers as they are inside the window (they change only when it ends), and the
rest as it was at its start. Whole (`state_dict`, for strategies where every worker holds the
whole model), in parts (`sharded_parts`, `save_sharded`, `load_sharded`: each worker its own
part), and a rank's own slot (`rank_slot`: what its peers do not hold the same).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from raysgd_operator._internal.rng import set_rng_state
from raysgd_operator._internal.stream import PassSeed
from raysgd_operator._internal.tensors import cpu_copy, host_like
from raysgd_operator.components import Components
from raysgd_operator.operator import TrainingOperator
from raysgd_operator.position import RunPosition

__all__ = ["StateIO"]


def _dcp() -> Any:
    # Imported on first use: torch.distributed.checkpoint takes most of a second to import, paid by
    # every new worker (start, recovery), although only sharded runs and checkpoints need it.
    from raysgd_operator._internal import sharded

    return sharded


class StateIO:
    """Saves and loads one worker's training state: its components' (models, optimizers,
    schedulers, precision backend), its operator's and its `position`'s. The state dict's keys:
    ``epoch``, ``operator``, ``models``, ``optimizers``, ``schedulers``, ``precision``,
    ``position``, ``epoch_rows``, ``step`` and ``global_step``, all plain tensors and containers
    (``torch.load(weights_only=True)`` reads them)."""

    def __init__(
        self, components: Components, operator: TrainingOperator, position: RunPosition
    ) -> None:
        self._parts, self._operator, self.position = components, operator, position

    def small_state(self) -> dict[str, Any]:
        """The part of the state that is neither a model's nor an optimizer's, as of the window
        start (the same on every worker but ``rng``, this worker's generators: every rank's are
        in `rank_slot`). Plain and small; inside a window it changes only where the window
        start is marked again (`RunPosition.add_window_start_hook`)."""
        parts = self._parts
        return {
            **self.position.position_state(),
            "operator": cpu_copy(self._operator.state_dict()),
            "schedulers": [cpu_copy(s.state_dict()) for s in parts.schedulers],
            "precision": cpu_copy(parts.precision.state_dict()),
            "rng": self.position.window.rank.rng,
        }

    # -- whole ---------------------------------------------------------------------------------
    def state_dict(
        self, *, live: bool = False, into: Optional[dict[str, Any]] = None
    ) -> dict[str, Any]:
        """A CPU snapshot of everything needed to continue training exactly from the start of the
        accumulation window in progress (`RunPosition.window_step`: this step at a window start).
        Inside a window the models and optimizers are those of its start; the batches since are
        done again by whoever loads it, so that no part of a window's gradient is lost.

        With `live`, the model and optimizer tensors are the worker's own, on its device, not
        copies (to send them to another worker without a copy; training must not run meanwhile).
        With `into`, an earlier snapshot that nothing reads any more, the model and optimizer
        tensors are copied into its tensors (a periodic checkpoint's host copy, reused).
        Not available with a sharded strategy (no worker holds the whole model): use
        `save_sharded`.
        """
        parts = self._parts
        models, optimizers = parts.strategy.whole_state(parts.models, parts.optimizers)
        if not live:
            earlier = into or {}
            models = cpu_copy(models, earlier.get("models"))
            optimizers = cpu_copy(optimizers, earlier.get("optimizers"))
        return {**self.small_state(), "models": models, "optimizers": optimizers}

    @staticmethod
    def host_buffers(live: Mapping[str, Any]) -> dict[str, Any]:
        """Host memory for a later `state_dict(into=...)`, shaped like `live` (a
        ``state_dict(live=True)`` taken on the training thread), with every page already mapped:
        the first copy into it then costs what later ones do. Its values mean nothing until that
        copy. Reads only shapes and dtypes, so it can run in a thread beside the training loop."""
        return {"models": host_like(live["models"]), "optimizers": host_like(live["optimizers"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the next train call redoes the saved epoch from its position."""
        parts = self._parts
        for key, have in (
            ("models", parts.models),
            ("optimizers", parts.optimizers),
            ("schedulers", parts.schedulers),
        ):
            if len(state.get(key, [])) != len(have):
                raise ValueError(
                    f"state has {len(state.get(key, []))} {key} but this operator registered {len(have)}"
                )
        parts.strategy.load_whole_state(
            parts.models, parts.optimizers, state["models"], state["optimizers"]
        )
        self._load_progress(state)

    def _load_progress(self, state: dict[str, Any]) -> None:
        parts = self._parts
        schedulers = parts.schedulers
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        if len(state.get("schedulers", [])) != len(schedulers):
            raise ValueError(
                f"state has {len(state.get('schedulers', []))} schedulers but this operator "
                f"registered {len(schedulers)}"
            )
        for sched, sd in zip(schedulers, state["schedulers"]):
            sched.load_state_dict(sd)
        if state.get("precision") is not None:
            parts.precision.load_state_dict(state["precision"])
        self._operator.load_state_dict(state.get("operator"))
        self.position.restore(state)

    def take_over(self, old: StateIO) -> None:
        """Become `old` (the state of a runner this worker had to build again after a resize):
        its state, its own per-rank state, its place and the call it was in, with the metrics
        it recorded."""
        self.load_state_dict(old.state_dict(live=True))
        mine, theirs = self.position, old.position
        mine.call, mine.meters, mine.trained_to = theirs.call, theirs.meters, theirs.trained_to
        mine.epoch_ended = theirs.epoch_ended
        self.load_rank_slot(old.rank_slot())

    # -- in parts ------------------------------------------------------------------------------
    def sharded_parts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this worker's part of the model and optimizer tensors, in the form
        `torch.distributed.checkpoint` saves; the rest of the state: plain, small, the same on
        every worker). Training must not run until the tensors are saved or copied."""
        parts = self._parts
        tensors, others = _dcp().tensor_state(parts.models, parts.optimizers)
        return tensors, {
            **self.small_state(),
            "tensor_others": others,
            "strategy": parts.strategy.name,
        }

    def save_sharded(self, directory: str) -> dict[str, Any]:
        """Write this worker's part of the models and optimizers under `directory` in
        `torch.distributed.checkpoint` format (a collective: every worker calls it at once) and
        return the rest of the state (plain, small, the same on every worker)."""
        tensors, state = self.sharded_parts()
        _dcp().save_files(tensors, directory)
        return state

    def load_sharded(self, source: Any, state: dict[str, Any]) -> None:
        """Load a checkpoint directory written by `save_sharded` (with any number of workers), or
        a state kept in memory (a `sharded_memory.reader`), resharded to this group, plus the
        `state` that came with it. A collective, for any strategy."""
        _dcp().load_files(
            self._parts.models,
            self._parts.optimizers,
            source,
            dict(state.get("tensor_others") or {}),
        )
        self._load_progress(state)

    def needed_parts(self, metadata: bytes) -> set[Any]:
        """The parts of a sharded state with `metadata` that loading it here reads: a checkpoint
        folder's data files, or the ranks whose kept chunks it reads (empty: all of them)."""
        parts = self._parts
        return _dcp().needed_parts(parts.models, parts.optimizers, metadata)

    # -- a rank's own --------------------------------------------------------------------------
    def rank_slot(self) -> dict[str, Any]:
        """What this worker holds of the window start that its peers do not hold the same: the
        operator's per-rank state (`TrainingOperator.rank_state_dict`, None without one), the
        random generators and the loader's seed of the epoch; plain, on the CPU."""
        return self.position.window.rank.to_plain()

    def rank_slot_before(self) -> Optional[tuple[int, dict[str, Any]]]:
        """(its step, this rank's slot) of the window start before the one in progress, plain,
        on the CPU (see `rank_slot`); None when none is kept (before the first window ended,
        and after a restore or a load)."""
        before = self.position.window_before
        return None if before is None else (before.step, before.rank.to_plain())

    def upcoming_rank_slot(self) -> dict[str, Any]:
        """This rank's slot as it is now (see `rank_slot`), plain, on the CPU: from a
        before-step hook, that of the window start this batch ends at (`step` + 1)."""
        position = self.position
        return position.rank_slot_now(in_flight=1 if position.in_batch else 0).to_plain()

    def load_rank_slot(self, slot: Optional[Mapping[str, Any]]) -> None:
        """Take `slot` (a `rank_slot` of the rank whose place this worker takes) as this worker's:
        None when no such slot exists (a rank the saved run did not have, a lost worker's whose
        holders are gone too): the operator then starts its per-rank state afresh and the
        generators stay as they are."""
        slot = slot or {}
        position = self.position
        if position.rank_state:
            self._operator.load_rank_state_dict(slot.get("state"))
        if slot.get("rng") is not None:
            set_rng_state(slot["rng"])
        position.take_pass_seed(PassSeed.from_plain(slot.get("pass_seed")))
        position.slot_counted = slot.get("counted")
        position.count_on()
        position.window = position.mark_window_start()
