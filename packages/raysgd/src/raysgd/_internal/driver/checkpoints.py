"""The trainer's checkpoints: every one a run writes or loads goes through `Checkpoints`, which
says when, where, and how a run goes on from them.

- `save(path)` writes the state to `path`, `load(path)` and `load_state_dict` load one; a
  checkpoint of `checkpoint_every` still uploading is finished first, so that the two never
  overlap (an upload of the state a load replaced, landing after it, would be taken for this
  run's newest checkpoint).
- `train(checkpoint="auto")` writes the state from before the call to `checkpoint_dir` (a file for
  a whole state, a folder for a sharded one, replaced each time); `train(checkpoint=path)` to
  `path`. Without a `checkpoint_dir`, "auto" makes a temporary folder, says where, and removes it
  at `shutdown()` (a state kept past the trainer needs a `checkpoint_dir`).
- `checkpoint_every=N` writes one every N steps inside the calls, asynchronously, each into a new
  folder under `checkpoint_dir` with its manifest last (`worker.periodic_checkpoints`), keeping the newest
  `keep_checkpoints` complete ones.
- `resume=True` loads, before the first call, the newest complete checkpoint in `checkpoint_dir`
  (the auto one included; never one that a load going back abandoned): the models, optimizers,
  schedulers, the precision backend's state, the random generators, the epoch, the step and the
  place in the epoch, so that the run goes on at the row after the checkpoint's step, on any
  number of workers.
- A preemption notice that rank 0 cannot move from (it runs in the driver's process) writes one at
  once, when there is a `checkpoint_dir`.
- Which checkpoint a run goes back to is chosen here alone (`KnownCheckpoints`, shared with the
  training state): what a restore falls back on when no worker holds the state, the one it goes
  back to for an exact result, what `resume=True` loads, and which a load going back abandons.

The writing itself is the workers', in the format of their kind of state: at once, with the
driver waiting (`TrainingState.save`: `save`, "auto", a notice), or in the background
(`worker.periodic_checkpoints`: `checkpoint_every`); the state does not pass through the driver.
Either way the manifest written last is the format's (`storage.format`), the names, the newest
and the pruning the catalog's (`storage.catalog`). `checkpoint_dir` may be a path or any fsspec URL (with `storage_options`); it
is checked before any worker starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Optional, Union

from raysgd._internal.protocol import CheckpointPlan
from raysgd._internal.storage.catalog import abandon, abandoned, newest_complete, reclaim
from raysgd._internal.storage.format import Checkpoint, checkpoint_position
from raysgd._internal.storage.location import Storage, as_storage
from raysgd_base import check_int

if TYPE_CHECKING:
    from raysgd._internal.driver.training_state import TrainingState

__all__ = ["Checkpoints", "KnownCheckpoints", "checkpoint_root"]

logger = logging.getLogger("raysgd")

PathLike = Union[str, "os.PathLike[str]"]


def checkpoint_root(
    directory: Optional[PathLike],
    storage_options: Optional[dict[str, Any]],
    *,
    checkpoint_every: int,
    keep_checkpoints: Optional[int],
    resume: bool,
) -> Optional[Storage]:
    """`checkpoint_dir` as a location, checked on the driver before any worker starts: the URL's
    client library is there (else an ImportError naming the extra), and the location can be
    listed and written with these credentials (else one line saying why)."""
    check_int("checkpoint_every", checkpoint_every, minimum=0)
    if keep_checkpoints is not None:
        check_int("keep_checkpoints", keep_checkpoints)
    if directory is None:
        for name, value in (("checkpoint_every", checkpoint_every), ("resume", resume)):
            if value:
                raise ValueError(f"{name} needs a checkpoint_dir (a path or an fsspec URL)")
        return None
    root = as_storage(directory, storage_options)
    root.check_access(write=True)
    return root


class KnownCheckpoints:
    """The checkpoints a run can go back to, and the one place that chooses among them: what a
    restore falls back on when no worker holds the state, the checkpoint a restore goes back to
    for an exact result, what `resume=True` loads, and which a load going back abandons.

    Args:
        root: `checkpoint_dir` as a location (the workers' periodic checkpoints and "auto"), or
            None.
        auto_name: The name of the "auto" checkpoint in it.

    Attributes:
        last: The last checkpoint written or loaded, and its step.
    """

    def __init__(self, root: Optional[Storage], auto_name: str) -> None:
        self.root = root
        self.auto_name = auto_name
        self.last: Optional[tuple[Storage, int]] = None

    def fallbacks(self) -> list[tuple[int, str, Storage]]:
        """What a restore may fall back on, as (step, what it is, where): the last checkpoint
        written or loaded when it is still there, and the newest complete one in `root`."""
        options = []
        if self.last is not None:
            location, step = self.last
            if location.parent().exists(location.name):
                options.append((step, f"checkpoint {location.url} at step {step}", location))
        newest = self._newest()
        if newest is not None:
            # The workers' own (`checkpoint_every`), written while the driver only waited.
            what = f"checkpoint {newest.location.url} at step {newest.step}"
            options.append((newest.step, what, newest.state_location))
        return options

    def exact_at(self, world_size: int) -> Optional[Checkpoint]:
        """The newest complete checkpoint in `root` when a group of `world_size` wrote it (so it
        holds every rank's slot of that size), else None."""
        newest = self._newest()
        if newest is None or newest.manifest.meta.get("world_size") != world_size:
            return None
        return newest

    def to_resume(self) -> Optional[tuple[tuple[int, int], Storage]]:
        """What `resume=True` loads: the newest of the newest complete checkpoint and the "auto"
        one (never one abandoned), with its (epoch, step)."""
        assert self.root is not None
        candidates: list[tuple[tuple[int, int], Storage]] = []
        newest = self._newest()
        if newest is not None:
            candidates.append(((newest.epoch, newest.step), newest.location))
        auto = self.root.join(self.auto_name)
        if auto.exists() and self.auto_name not in abandoned(self.root):
            candidates.append((checkpoint_position(auto), auto))
        return max(candidates, key=lambda c: c[0]) if candidates else None

    def loaded(self, step: int) -> None:
        """A load went to `step`: the checkpoints past it (the periodic ones, the "auto" one) are
        of the timeline it replaced, and no fall-back, `resume=True` or pruning may take them for
        this run's."""
        if self.root is not None:
            abandon(self.root, step, also=(self.auto_name,))

    def _newest(self) -> Optional[Checkpoint]:
        return newest_complete(self.root) if self.root is not None else None


class Checkpoints:
    """Where and when the trainer writes checkpoints (see the module docstring).

    Args:
        state: The training state, which writes and loads them.
        known: The checkpoints the run can go back to (the training state's too).
        every: `checkpoint_every` (0: only the checkpoints asked for).
        keep: `keep_checkpoints` (None: keep them all).
    """

    def __init__(
        self,
        state: TrainingState,
        known: KnownCheckpoints,
        *,
        every: int = 0,
        keep: Optional[int] = None,
    ) -> None:
        self._state = state
        self._known = known
        #: Where "auto" writes: `checkpoint_dir`, or a temporary folder made on first use.
        self.root = known.root
        self.every = every
        self.keep = keep
        self._scratch: Optional[str] = None  # the temporary folder "auto" made, if it made one

    def save(self, path: PathLike) -> str:
        """`TorchTrainer.save`: write the state to `path` once the upload in flight is done."""
        self.finish()
        return self._state.save(path)

    def load(self, path: PathLike) -> None:
        """`TorchTrainer.load`: load the checkpoint at `path` once the upload in flight is done
        (it would otherwise land after the load, a checkpoint of the state replaced)."""
        self.finish()
        self._state.load(path)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`TorchTrainer.load_state_dict`: as `load`, from a state in this process."""
        self.finish()
        self._state.load_state_dict(state)

    def before_call(self, checkpoint: PathLike) -> str:
        """`train(checkpoint=...)`: write the state now to `checkpoint` or, for "auto", into
        `checkpoint_dir`."""
        if checkpoint == "auto":
            return self._save_auto()
        return self._state.save(checkpoint)

    def plan(self) -> Optional[CheckpointPlan]:
        """What the next `train()` attempt checkpoints inside its steps; a new token per attempt,
        so that an attempt redone after a failure never writes into an interrupted one's folder."""
        if not self.every or self.root is None:
            return None
        return CheckpointPlan(self.root, self.every, self.keep, uuid.uuid4().hex)

    def finish(self) -> None:
        """Wait for the checkpoint uploads in flight (a clean exit never loses the last one)."""
        if self.every and self.root is not None:
            self._state.finish_uploads()

    def close(self) -> None:
        """Remove the temporary folder that "auto" made (none is made with a `checkpoint_dir`)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def at_notice(self) -> Optional[str]:
        """A checkpoint written now, when rank 0 cannot leave a draining node; None without a
        `checkpoint_dir`."""
        if self.root is None:
            return None
        return self._save_auto()

    def resume(self) -> Optional[str]:
        """Load the newest complete checkpoint of `checkpoint_dir` (the periodic ones and the
        auto one: `KnownCheckpoints.to_resume`); where it came from, or None (and a log line)
        when there is none."""
        found = self._known.to_resume()
        if found is None:
            logger.info("resume: no complete checkpoint in %s: starting from scratch", self.root)
            return None
        (epoch, step), location = found
        self._state.load(location)
        logger.info(
            "resumed from %s (epoch %d, step %d): training goes on at the row after it",
            location.url,
            epoch,
            step,
        )
        return location.url

    def _save_auto(self) -> str:
        """Write the "auto" checkpoint (of this timeline, even where a load that went back
        abandoned the one it replaces)."""
        url = self._state.save(self._auto_location())
        assert self.root is not None
        reclaim(self.root, self._state.checkpoint_name)
        return url

    def _auto_location(self) -> Storage:
        if self.root is None:
            self._scratch = tempfile.mkdtemp(prefix="raysgd-checkpoints-")
            self.root = as_storage(self._scratch)
            logger.info(
                "checkpoint='auto' writes to %s, removed at shutdown() (a checkpoint_dir keeps it)",
                self.root.url,
            )
        return self.root.join(self._state.checkpoint_name)
