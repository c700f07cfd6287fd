"""The training state as the driver handles it: where it is, how it is restored, saved and loaded.

The state lives on the workers (`worker.state`: what each holds, chosen by the strategy). The
driver keeps only what is small: the step the workers finished last, the last checkpoint written
or loaded, and, for a whole state up to `state_copy_limit_mb`, a bounded copy (`DriverCopy`).
After a resize it asks every worker what it holds, lets the strategy's planner decide
(`restore_plan`), falls back on the copy or the last checkpoint when no worker holds a state, and
has the workers restore. Checkpoints are written and read by the workers themselves
(`storage.format`): a whole state as one file (RaySGD's format), a sharded one as a folder of parts
with a manifest; either loads whatever the strategy and the number of workers.

Nothing here repairs or retries: the recovery loop calls `restore` inside a resize, and the
trainer guards every other call (see `recovery.Recovery.guarded`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional, Union

import ray
import torch

from raysgd._internal.driver.restore_plan import (
    RestoreOutcome,
    RestorePlan,
    StateLostError,
    missing_parts,
    plan_from_peers,
    plan_from_snapshots,
)
from raysgd._internal.driver.state_copy import DriverCopy
from raysgd._internal.driver.worker_calls import WorkerCalls
from raysgd._internal.storage.atomic_files import write_file
from raysgd._internal.storage.format import (
    GATHERED_FORMAT,
    MANIFEST_NAME,
    SHARDED,
    WHOLE,
    WHOLE_FILE,
    read_file,
    read_manifest,
    read_sharded,
    resolve_checkpoint,
    state_to_bytes,
    write_manifest,
)
from raysgd._internal.storage.location import Storage, as_storage
from raysgd._internal.worker import calls as worker
from raysgd._internal.worker.state import LoadSource
from raysgd_core import RecoveryReport, WorkerError

__all__ = [
    "AUTO_CHECKPOINT_NAME",
    "AUTO_SHARDED_CHECKPOINT_NAME",
    "TrainingState",
]

logger = logging.getLogger("raysgd")

PathLike = Union[str, "os.PathLike[str]"]

#: Name of the `train(checkpoint="auto")` checkpoint inside `checkpoint_dir`: a file...
AUTO_CHECKPOINT_NAME = "raysgd_checkpoint.pt"
#: ... or, for a sharded state, a folder.
AUTO_SHARDED_CHECKPOINT_NAME = "raysgd_checkpoint"


class TrainingState:
    """The driver's handling of the training state (see the module docstring).

    Args:
        workers: The trainer's workers.
        sharded: Whether the strategy shards the model (each worker holds a part).
        copy: The driver's bounded copy of a whole state (a limit of 0: none is kept; never with
            a sharded state, nor with ``use_local``, where losing every worker loses the driver).
        storage_options: fsspec options of the URLs given to `save`, `load` and checkpoints.

    Attributes:
        step: The step the workers finished last, as far as the driver knows.
        last_checkpoint: The last checkpoint written or loaded, and its step: what a restore
            falls back on when no worker holds a state.
    """

    def __init__(
        self,
        workers: WorkerCalls,
        *,
        sharded: bool,
        copy: DriverCopy,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        self._workers = workers
        self._whole = not sharded
        self._copy = copy
        self._copy_wanted = copy.enabled and self._whole and not workers.use_local
        self._storage_options = storage_options
        self.step = 0
        #: Epochs the workers finished (the one in progress not counted).
        self.epochs = 0
        self.last_checkpoint: Optional[tuple[Storage, int]] = None

    @property
    def whole(self) -> bool:
        """Whether every worker holds the whole model."""
        return self._whole

    @property
    def checkpoint_name(self) -> str:
        """Name of the `train(checkpoint="auto")` checkpoint inside `checkpoint_dir`."""
        return AUTO_CHECKPOINT_NAME if self.whole else AUTO_SHARDED_CHECKPOINT_NAME

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
        if not self.whole:
            self._workers.group.execute(worker.capture)

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
        if self.whole:
            plan = plan_from_peers([h.progress for h in holdings])
        else:
            plan = plan_from_snapshots(holdings, group.world_size)
        if not plan.found:
            plan = self._fall_back(plan, holdings)
        if report is not None:
            plan = replace(plan, rank_sources=rank_sources(report, group.world_size))
        group.execute(worker.restore, *self._workers.runner_args(), plan)
        if not self.whole:
            group.execute(worker.capture)  # every part has a copy again, in the new layout
        self.step = plan.step
        return RestoreOutcome(plan.description, plan.step, plan.steps_redone, plan.finished_at)

    def _fall_back(self, plan: RestorePlan, holdings: Sequence[Any]) -> RestorePlan:
        """`plan` with the newest of the driver's copy and the last checkpoint; StateLostError
        when there is neither."""
        self._copy.wait()
        options: list[tuple[int, str, Any]] = []
        copy = self._copy.latest() if self._copy_wanted else None
        if copy is not None:
            data, step = copy
            options.append((step, f"the driver's copy at step {step}", data))
        if self.last_checkpoint is not None:
            location, step = self.last_checkpoint
            if location.parent().exists(location.name):
                options.append((step, f"checkpoint {location.url} at step {step}", location))
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
        source = LoadSource(whole=ray.put(held)) if isinstance(held, bytes) else self._source(held)
        # A lower bound: the steps the driver knows were finished since, plus the one in flight;
        # how far the interrupted call got died with its workers.
        redone = max(0, self.step - step) + 1
        if self.whole:
            logger.warning(
                "no worker holds the training state any more: restoring %s; the interrupted "
                "call starts again from there (at least %d step(s) are done again)",
                what,
                redone,
            )
        else:
            logger.warning(
                "the in-memory parts of worker(s) %s were lost together with their replicas: "
                "restoring the last %s (work since then is redone)",
                missing_parts(holdings),
                what,
            )
        return plan.falling_back(source, step, what, redone)

    # ------------------------------------------------------------------------- checkpoints
    def save(self, path: Union[PathLike, Storage]) -> str:
        """Write the state to `path` (a file for a whole state, a folder with a manifest for a
        sharded one); returns where it is (an absolute path for a local one)."""
        location = self.location(path)
        if self.whole:
            written = self._save_file(location)
        else:
            written = self._save_folder(location)
        self.last_checkpoint = (location, self.step)
        return written

    def _save_file(self, location: Storage) -> str:
        """One file, written by a worker that can reach it (an object store; the local disk of
        a worker on this node or of one that shares it), else through the driver."""
        group = self._workers.group
        if not location.is_local:
            group.execute(worker.save_file, location, 0)
            return location.url
        path = location.path
        rank = self._workers.writer_rank(os.path.dirname(path))
        if rank is not None:
            group.execute(worker.save_file, location, rank)
            logger.debug("checkpoint %s written by rank %d", path, rank)
        else:
            write_file(path, group.execute(worker.state_bytes)[0])
            logger.debug(
                "checkpoint %s written through the driver (no worker shares its disk)", path
            )
        return path

    def _save_folder(self, location: Storage) -> str:
        """A sharded checkpoint folder at `location`: on the local disk written beside it and
        renamed into place (an older checkpoint there is replaced only then); on an object store
        its old manifest goes first, so that a write cut short leaves no torn checkpoint."""
        epoch = self._epoch()
        if not location.is_local:
            location.remove(MANIFEST_NAME)
            self._write_parts(location)
            write_manifest(location, SHARDED, epoch, self.step)
            return location.url
        path = location.path
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".raysgd-ckpt-", dir=parent)
        try:
            folder = self.location(tmp)
            self._write_parts(folder)
            write_manifest(folder, SHARDED, epoch, self.step)
            _replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def _write_parts(self, folder: Storage) -> None:
        """Every worker writes its part into `folder` (a collective); the parts of workers that
        cannot reach a local folder come through the object store and are written here."""
        for shipped in self._workers.group.execute(worker.save, folder):
            if shipped:
                bundles: dict[int, dict[str, bytes]] = {}
                for name, ref in shipped.items():
                    data = bundles.setdefault(id(ref), ray.get(ref))[name]
                    folder.write_bytes(name, data)

    def _epoch(self) -> int:
        return int(self._workers.group.execute_single(0, worker.epoch))

    def load(self, path: Union[PathLike, Storage]) -> None:
        """Load a checkpoint (a file; a checkpoint folder; a folder of checkpoint folders: the
        newest complete one) into every worker. What is not a checkpoint raises ValueError (one
        line, naming the file) and leaves the trainer as it was."""
        location = self.location(path)
        if not location.exists():
            raise FileNotFoundError(errno.ENOENT, "no checkpoint there", location.url)
        step = None
        if location.is_folder():
            checkpoint = resolve_checkpoint(location)
            location, step = checkpoint.location, checkpoint.step
            if checkpoint.kind == WHOLE:
                location = location.join(WHOLE_FILE)
        self._load(self._source(location))
        self.last_checkpoint = (location, self.step if step is None else step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict()` returned (of either kind) into every worker."""
        if state.get("format") == GATHERED_FORMAT:
            files = state.get("files")
            if not isinstance(files, dict) or not all(isinstance(v, bytes) for v in files.values()):
                raise ValueError("a sharded state dict must hold {'files': {name: bytes}}")
            tmp = tempfile.mkdtemp(prefix="raysgd-state-")
            try:
                for name, data in files.items():
                    if os.path.basename(name) != name or name in (".", ".."):
                        raise ValueError(f"bad file name in sharded state: {name!r}")
                    with open(os.path.join(tmp, name), "wb") as handle:
                        handle.write(data)
                self._load(self._source(self.location(tmp)))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return
        data = state_to_bytes(state)
        self._load(LoadSource(whole=ray.put(data)))
        if self._copy_wanted:
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
        self.step, self.epochs = int(answers[0].step), int(answers[0].epochs)
        if not self.whole:
            # The loaded state is the newest snapshot from now on (with its copies on the peers).
            group.execute(worker.capture)

    def _source(self, location: Storage) -> LoadSource:
        """What the workers load `location` from: the location itself when every worker can
        read it (an object store; the local disk of workers on this node), else its bytes through
        the object store."""
        reachable = not location.is_local or self._workers.all_on_this_node()
        if location.is_folder():
            metadata, rest = read_sharded(location)
            if reachable:
                return LoadSource(metadata=metadata, state=rest, files=location)
            files = {
                name: ray.put({name: location.read_bytes(name)})
                for name in location.listdir()
                if name.endswith(".distcp")
            }
            return LoadSource(metadata=metadata, state=rest, files=files)
        if reachable:
            return LoadSource(whole=location)
        return LoadSource(whole=ray.put(location.parent().read_bytes(location.name)))

    def state_dict(self) -> dict[str, Any]:
        """The whole state in this process: a whole state's dict, or a sharded state's folder
        as bytes (`GATHERED_FORMAT`), which `load_state_dict` takes back."""
        from raysgd._internal.storage.format import state_from_bytes

        if self.whole:
            return state_from_bytes(self._workers.group.execute(worker.state_bytes)[0])
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            folder = self.location(os.path.join(tmp, "state"))
            os.makedirs(folder.path)
            self._write_parts(folder)
            write_manifest(folder, SHARDED, self._epoch(), self.step)
            files = {name: folder.read_bytes(name) for name in folder.listdir()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"format": GATHERED_FORMAT, "files": files}

    def finish_uploads(self) -> None:
        """Wait for the checkpoints the workers are writing in the background; a failed one is
        logged (the one before it stays the newest complete)."""
        for error in self._workers.group.execute(worker.finish_uploads):
            if error:
                logger.warning("%s", error)

    def position_of(self, location: Storage) -> tuple[int, int]:
        """(epoch, step) of the checkpoint at `location`, to compare it with others."""
        if location.is_folder():
            manifest = read_manifest(location)
            if manifest is not None:
                return manifest.epoch, manifest.step
            _, rest = read_sharded(location)
            return int(rest.get("epoch", 0)), int(rest.get("step", 0))
        if location.is_local:
            # Mapped, not read: only the two counters are looked at.
            state = torch.load(location.path, map_location="cpu", weights_only=True, mmap=True)
        else:
            state = read_file(location)[1]
        return int(state.get("epoch", 0)), int(state.get("step", 0))

    # ------------------------------------------------------------------------- moves
    def hand_over(self, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose (a preemption notice), or before
        spares join (`leaving` empty), with every worker at the same step boundary: make the
        state of this boundary restorable without the leaving workers. A whole state already is
        (the workers that stay hold it); a sharded one is snapshotted now and each leaving
        worker's part given to a worker that stays. When every worker leaves, the snapshot is
        all: the replacements that join first restore from it."""
        if self.whole:
            return
        group = self._workers.group
        step = group.execute(worker.capture)[0]
        staying = [r for r in range(group.world_size) if r not in set(leaving)]
        if not staying or not leaving:
            return
        holdings = group.execute(worker.holding)
        given: list[dict[int, Any]] = [{} for _ in range(group.world_size)]
        for i, rank in enumerate(sorted(set(leaving))):
            for holding in holdings:
                part = next((h.parts.get(rank) for h in holding.snapshots if h.step == step), None)
                if part is not None:
                    given[staying[i % len(staying)]][rank] = part
                    break
        # Each worker takes its own share (the argument is every worker's, in rank order).
        group.execute(worker.adopt_parts, step, given)


def rank_sources(report: RecoveryReport, world_size: int) -> tuple[Optional[int], ...]:
    """Whose per-rank state each rank of the re-formed group takes (`RestorePlan.rank_sources`):
    a kept worker its own old rank's, the new workers the lost ranks' in order (a grow's new
    workers, with none lost, none)."""
    sources: list[Optional[int]] = [None] * world_size
    for old, new in report.kept.items():
        sources[new] = old
    for new, old in zip(sorted(report.started), sorted(report.lost)):
        sources[new] = old
    return tuple(sources)


def _replace_dir(tmp: str, path: str) -> None:
    """Move the finished folder `tmp` to `path`; an older checkpoint there is replaced only now."""
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    old = tempfile.mkdtemp(prefix=".raysgd-old-", dir=os.path.dirname(path))
    os.rmdir(old)
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)
