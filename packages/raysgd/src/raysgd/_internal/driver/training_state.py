"""The training state as the driver handles it: where it is, how it is restored, saved and loaded.

The state lives on the workers (what each holds is its kind's: `state.replicated`,
`state.sharded`). The driver keeps only what is small: the step the workers finished last, the
last checkpoint written or loaded, and, for a whole state up to `state_copy_limit_mb`, a bounded
copy (`DriverCopy`). After a resize it asks every worker what it holds, lets the kind of state
plan the restore, falls back on the copy or the last checkpoint when no worker holds a state, and
has the workers restore. Checkpoints are written and read by the workers themselves, in the
format of the kind that writes them (a whole state as one file, RaySGD's format; a sharded one as
a folder of parts with a manifest); each loads whatever the strategy and the number of workers,
read by the kind whose format it is (`state.pick`). All that differs between the two kinds is
the kind's (`state.kind.StateKind`); nothing here asks which it is.

Nothing here repairs or retries: the run controller calls `restore` inside a resize, and the
trainer guards every other call (see `guard.CallGuard.guarded`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Union

from raysgd._internal.driver.state_copy import DriverCopy
from raysgd._internal.driver.worker_calls import WorkerCalls
from raysgd._internal.protocol import LoadSource, RestorePlan, call_from_meta
from raysgd._internal.state.kind import StateKind
from raysgd._internal.state.pick import reader_at, reader_of_state
from raysgd._internal.state.plan import RestoreOutcome, StateLostError
from raysgd._internal.storage.catalog import state_to_load
from raysgd._internal.storage.location import Storage, as_storage
from raysgd._internal.worker import calls as worker
from raysgd_core import RecoveryReport, WorkerError

if TYPE_CHECKING:
    from raysgd._internal.driver.checkpoints import KnownCheckpoints

__all__ = ["TrainingState", "rank_sources"]

logger = logging.getLogger("raysgd")

PathLike = Union[str, "os.PathLike[str]"]


class TrainingState:
    """The driver's handling of the training state (see the module docstring).

    Args:
        workers: The trainer's workers.
        kind: The kind of state the strategy gives the workers (`state.pick.kind_for`).
        copy: The driver's bounded copy of the state (a limit of 0: none is kept; never where
            the kind keeps none, nor with ``use_local``, where losing every worker loses the
            driver).
        known: The checkpoints the run can go back to, which choose what a restore falls back
            on or goes back to (`checkpoints.KnownCheckpoints`).
        storage_options: fsspec options of the URLs given to `save`, `load` and checkpoints.

    Attributes:
        step: The step the workers finished last, as far as the driver knows.
    """

    def __init__(
        self,
        workers: WorkerCalls,
        *,
        kind: StateKind,
        copy: DriverCopy,
        known: KnownCheckpoints,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        self._workers = workers
        self._known = known
        self._kind = kind
        self._copy = copy
        self._copy_wanted = copy.enabled and kind.keeps_driver_copy and not workers.use_local
        self._storage_options = storage_options
        self.step = 0
        #: Epochs the workers finished (the one in progress not counted).
        self.epochs = 0

    @property
    def checkpoint_name(self) -> str:
        """Name of the `train(checkpoint="auto")` checkpoint inside `checkpoint_dir`."""
        return self._kind.checkpoint_name

    @property
    def copy_limit_bytes(self) -> int:
        """The largest state the workers offer the driver a copy of (0: no copy is kept)."""
        return self._copy.limit_bytes if self._copy_wanted else 0

    def location(self, path: Union[PathLike, Storage]) -> Storage:
        """`path` (a path or fsspec URL) as a location with the trainer's storage options."""
        if isinstance(path, Storage):
            return path
        return as_storage(path, self._storage_options)

    # ------------------------------------------------------------------------- the life cycle
    def started(self, first: Optional[tuple[Optional[bytes], int]]) -> None:
        """Every runner was just built; `first` is rank 0's answer to `worker.create_runner`."""
        if self._copy_wanted and first is not None:
            data, size = first
            self._copy.offer(data, size, step=0)
        self._kind.settle(self._workers)

    def after_train(self, step: int, epochs: int) -> None:
        """A `train()` call finished with the workers at `step`, `epochs` finished: refresh the
        driver's copy when it is due (asynchronously: see `DriverCopy`)."""
        self.step, self.epochs = step, epochs
        if self._copy_wanted and self._copy.due():
            self._copy.refresh(
                self._workers.group.execute_single_async(
                    0, worker.state_copy, self._copy.limit_bytes
                )
            )

    def restore(self, report: Optional[RecoveryReport] = None) -> RestoreOutcome:
        """After a resize (`report`: what the group did): bring every worker of the re-formed
        group to the newest state some worker holds (or, failing that, the copy or the last
        checkpoint), at the position and in the call it belongs to. `StateLostError` when there
        is none."""
        group = self._workers.group
        holdings = group.execute(worker.holding)
        sources = (
            rank_sources(report, group.world_size)
            if report is not None
            else tuple(range(group.world_size))
        )
        plan = self._kind.plan(holdings, group.world_size, sources)
        if not plan.found:
            plan = self._fall_back(plan, holdings)
        elif plan.inexact:
            plan = self._exact_instead(plan, group.world_size)
        resized = _resplit(report, group.world_size)
        if resized:
            plan = replace(plan, inexact=(*plan.inexact, resized))
        if plan.inexact:
            logger.warning(
                "the run goes on from step %d, but not exactly as it would have without the "
                "failure: %s",
                plan.step,
                "; ".join(plan.inexact),
            )
        group.execute(worker.restore, *self._workers.runner_args(), plan)
        self._kind.settle(self._workers)
        self.step = plan.step
        return RestoreOutcome(
            plan.description, plan.step, plan.steps_redone, plan.finished_at, plan.inexact
        )

    def _exact_instead(self, plan: RestorePlan, world_size: int) -> RestorePlan:
        """`plan` (from the survivors, inexact: every holder of some rank's slot was lost) or,
        when `checkpoint_dir` has one, the newest complete checkpoint written by a group of this
        size (it holds every rank's slot): going back further costs steps, never the result.
        The interrupted call goes on from the checkpoint, its count up to there kept when the
        checkpoint was taken inside it."""
        newest = self._known.exact_at(world_size)
        if newest is None:
            return plan
        call = plan.call
        saved = call_from_meta(newest.manifest.meta.get("call"))
        if call is not None and saved is not None and saved.same_call(call):
            call = saved
        what = f"checkpoint {newest.location.url} at step {newest.step}"
        logger.warning(
            "going back to %s, which holds every rank's state: the survivors do not (%s)",
            what,
            "; ".join(plan.inexact),
        )
        redone = max(0, plan.step - newest.step) + plan.steps_redone
        back = plan.falling_back(self._source(newest.state_location), newest.step, what, redone)
        # Nothing of the survivors' plan stays: every worker loads the checkpoint.
        return replace(
            back, call=call, inexact=(), source=None, receivers=(), snapshot=None, slot_moves=()
        )

    def _fall_back(self, plan: RestorePlan, holdings: Sequence[Any]) -> RestorePlan:
        """`plan` with the newest of the driver's copy and the last checkpoint; StateLostError
        when there is neither."""
        self._copy.wait()
        options: list[tuple[int, str, Any]] = []
        copy = self._copy.latest() if self._copy_wanted else None
        if copy is not None:
            data, step = copy
            options.append((step, f"the driver's copy at step {step}", data))
        options.extend(self._known.fallbacks())
        if not options:
            limit_mb = self._copy.limit_bytes / 2**20
            raise StateLostError(
                f"every worker holding the training state (at step {self.step} or later) was "
                "lost at once, and there is nothing to restore it from: the driver keeps a copy "
                f"only of whole states up to state_copy_limit_mb={limit_mb:g} MB (and not with "
                "use_local=True or a sharded strategy), and no checkpoint was written. Write one "
                "regularly (train(checkpoint='auto') or save(), or checkpoint_every), or raise "
                "state_copy_limit_mb."
            )
        step, what, held = max(options, key=lambda option: option[0])
        source = self._kind.copy_source(held) if isinstance(held, bytes) else self._source(held)
        # A lower bound: the steps the driver knows were finished since, plus the one in flight;
        # how far the interrupted call got died with its workers.
        redone = max(0, self.step - step) + 1
        logger.warning("%s", self._kind.fallback_warning(what, redone, holdings))
        return plan.falling_back(source, step, what, redone)

    # ------------------------------------------------------------------------- checkpoints
    def save(self, path: Union[PathLike, Storage]) -> str:
        """Write the state to `path` (a file for a whole state, a folder with a manifest for a
        sharded one); returns where it is (an absolute path for a local one)."""
        location = self.location(path)
        written = self._kind.save(self._workers, location, self.step)
        self._known.last = (location, self.step)
        return written

    def load(self, path: Union[PathLike, Storage]) -> None:
        """Load a checkpoint (a file; a checkpoint folder; a folder of checkpoint folders: the
        newest complete one) into every worker. What is not a checkpoint raises ValueError (one
        line, naming the file) and leaves the trainer as it was."""
        location = self.location(path)
        if not location.exists():
            raise FileNotFoundError(errno.ENOENT, "no checkpoint there", location.url)
        location, step = state_to_load(location)
        self._load(self._source(location))
        self._known.last = (location, self.step if step is None else step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict()` returned (of either kind) into every worker."""
        reader = reader_of_state(state)
        with reader.state_source(state, self._workers.all_on_this_node()) as (source, data):
            self._load(source)
        if self._copy_wanted and data is not None:
            size = len(data)
            self._copy.offer(data if size <= self._copy.limit_bytes else None, size, self.step)

    def _load(self, source: LoadSource) -> None:
        group = self._workers.group
        try:
            answers = group.execute(worker.load, source)
        except WorkerError as exc:
            if isinstance(exc.__cause__, ValueError):
                # A part the workers found bad (a sharded folder's data file cut short) is the
                # input's fault, as a bad file found here is: its one line, chained to the
                # workers' report.
                raise exc.__cause__ from exc
            raise
        refused = next((a.refused for a in answers if a.refused), None)
        if refused:
            raise ValueError(refused)
        # A copy of the state just replaced must not be restored after a loss (the copy that
        # `load_state_dict` offers, or the next refresh, is of the loaded state).
        self._copy.forget()
        self.step, self.epochs = int(answers[0].step), int(answers[0].epochs)
        self._known.loaded(self.step)
        self._kind.settle(self._workers)

    def _source(self, location: Storage) -> LoadSource:
        """What the workers load `location` from: the location itself when every worker can
        read it (an object store; the local disk of workers on this node), else its bytes through
        the object store."""
        reachable = not location.is_local or self._workers.all_on_this_node()
        return reader_at(location).source_at(location, reachable)

    def state_dict(self) -> dict[str, Any]:
        """The whole state in this process: a whole state's dict, or a sharded state's folder
        as bytes (`storage.format.gathered`), which `load_state_dict` takes back."""
        return self._kind.gather(self._workers, self.step)

    def finish_uploads(self) -> None:
        """Wait for the checkpoints the workers are writing in the background; a failed one is
        logged (the one before it stays the newest complete)."""
        for error in self._workers.group.execute(worker.finish_uploads):
            if error:
                logger.warning("%s", error)

    # ------------------------------------------------------------------------- moves
    def hand_over(self, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose (a preemption notice), or before
        spares join (`leaving` empty), with every worker at the same step boundary: make the
        state of this boundary restorable without the leaving workers. A whole state already is
        (the workers that stay hold it); a sharded one is snapshotted now and each leaving
        worker's part given to a worker that stays (`StateKind.hand_over`)."""
        self._kind.hand_over(self._workers, leaving)


def _resplit(report: Optional[RecoveryReport], world_size: int) -> str:
    """Why a group that changed its size goes on otherwise than it would have (empty: it kept
    its size): its rows are split anew."""
    if report is None:
        return ""
    before = len(report.kept) + len(report.lost)
    if before in (0, world_size):
        return ""
    return (
        f"the group goes on at {world_size} workers where it trained at {before}: the rows are "
        "split anew, so each rank's random draws and the state it carries from batch to batch "
        "(its rank_state_dict, an LSTM's hidden state) go with other rows and the gradients are "
        "summed in another order"
    )


def rank_sources(report: RecoveryReport, world_size: int) -> tuple[Optional[int], ...]:
    """Whose slot (per-rank state, generators) each rank of the re-formed group takes
    (`RestorePlan.rank_sources`). A group that kept its size goes on as it was: rank r takes
    rank r's, whichever worker now has that rank, so that each rank's rows of the epoch are read
    with the generators and per-rank state that went with them. Otherwise the rows are split
    anew: a kept worker takes its own old rank's, the new workers the lost ranks' in order (a
    grow's new workers, with none lost, none)."""
    if len(report.kept) + len(report.lost) == world_size:
        return tuple(range(world_size))
    sources: list[Optional[int]] = [None] * world_size
    for old, new in report.kept.items():
        sources[new] = old
    for new, old in zip(sorted(report.started), sorted(report.lost)):
        sources[new] = old
    return tuple(sources)
