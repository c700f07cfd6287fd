"""Checkpoints inside an epoch, written in the background (`checkpoint_every=N`).

At the first window boundary at or after every N-th step of a `train()` call (with gradient
accumulation a checkpoint is taken only where no partial gradient would be lost: at the end of an
accumulation window; without, at every N-th step) every worker stages its part of the training state
in host memory (`WorkerState.copy_to_host`: the loop waits only for this copy) and hands it to its writer
thread (one per worker, kept between checkpoints), which writes it into a new checkpoint folder
under `checkpoint_dir` (`storage.catalog.checkpoint_name`: a folder per attempt). Rank 0 then waits, in
its thread, until every part is there and writes the manifest last, so an upload cut short (a
worker lost, storage unreachable) leaves the previous checkpoint the newest complete one; it then
removes the checkpoints past `keep_checkpoints`. Before the first checkpoint falls due the same
thread has the state map the memory of its host copy (`WorkerState.prepare_host_copy`), so that no
checkpoint's copy waits for the system to map fresh pages. The thread runs at the lowest CPU
priority: on a machine whose cores the training keeps busy it writes in the time the loop leaves
idle (waits in collectives, data loading) instead of slowing every step, and all ranks with it.

At most one upload is in flight per worker: a checkpoint that falls due while the previous one is
still being written waits for it (the loop is blocked only when storage cannot keep up; the time
is counted in `blocked_s`), so every checkpoint asked for is written. A worker whose part fails
leaves a marker in the folder, so that rank 0 gives the checkpoint up at once instead of waiting
for it. `finish` waits for the upload in flight: the trainer calls it before `save()`, `load()`,
`load_state_dict()` and `shutdown()`, so a clean exit never loses the last checkpoint and no
upload of a replaced state lands after a load.

A checkpoint taken by a process group that has since been re-formed (a worker lost, stopped,
moved or joined) is given up by `finish` if rank 0 still waits for a part of it: the part's
writer may be gone with its process, and a stopped one never answers, so waiting for it would
hold the training loop (the next checkpoint waits for this one) or the trainer's call for as long
as the parts' own timeout. The newest complete checkpoint stays the one before; the group has
gone on from its own copies, and the next checkpoint falls due as planned.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from raysgd._internal.protocol import CheckpointPlan, call_meta
from raysgd._internal.storage.atomic_files import SCRATCH_PREFIX
from raysgd._internal.storage.catalog import checkpoint_name, prune
from raysgd._internal.storage.format import write_manifest
from raysgd._internal.storage.location import Storage
from raysgd._internal.worker.state import WorkerState
from raysgd_core import get_context

__all__ = ["PeriodicCheckpoints"]

logger = logging.getLogger("raysgd")

#: How long rank 0 waits for the other workers' parts of one checkpoint before giving it up.
PARTS_TIMEOUT_S = 300.0
#: The marker a worker leaves when its part of a checkpoint failed (never a part: a scratch name).
_FAILED = SCRATCH_PREFIX + "failed-"


@dataclass(frozen=True)
class Written:
    """The last checkpoint this worker finished its part of (rank 0: committed)."""

    url: str
    epoch: int
    step: int


class PeriodicCheckpoints:
    """This worker's step hook and upload thread (see the module docstring)."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.plan: Optional[CheckpointPlan] = None
        #: Seconds the training loop waited at checkpoint steps (staging, a previous upload).
        self.blocked_s = 0.0
        self.last: Optional[Written] = None
        # The step of the last checkpoint taken, or the window start the call began at (`arm`).
        self._taken_at = state.runner.position.step
        self.error: Optional[str] = None
        #: The writer: one thread for all of this worker's checkpoints, fed through `_jobs` (a
        #: queue's put costs the loop microseconds; starting a thread waits for the busy cores
        #: to run it, up to milliseconds).
        self._jobs: queue.SimpleQueue[Optional[tuple[Callable[[], None], threading.Event]]] = (
            queue.SimpleQueue()
        )
        self._writer: Optional[threading.Thread] = None
        self._pending: Optional[threading.Event] = None  # set once the job in flight is done
        #: The process group (its generation) the upload in flight was taken in, and the event
        #: that makes rank 0 stop waiting for its parts (see the module docstring).
        self._pending_group: Optional[int] = None
        self._give_up_parts = threading.Event()
        #: The state whose `prepare_host_copy` work was started (once per state: a restore makes one).
        self._ahead: Optional[WorkerState] = None
        state.runner.add_step_hook(self._on_step)

    def arm(self, plan: Optional[CheckpointPlan]) -> None:
        """Checkpoint as `plan` says from the next step boundary on (None: not at all).

        Every worker arms at the start of each attempt of a call, at the same window start: the
        checkpoints fall due from there on, on every worker alike. A worker's own record of
        the last one it took is not kept across a recovery: a worker that failed before its
        checkpoint step (its ring peer died, say) and one that got past it would otherwise
        disagree on the next one, and writing a checkpoint takes every worker (its per-rank
        slots are gathered), so the one that takes it alone would wait for the others."""
        self.plan = plan
        self._taken_at = self.state.runner.position.window_step
        if plan is not None:
            # The root's filesystem, built here on the training thread if not yet, is shared by
            # every folder joined to it: threads it starts (fsspec's event loop) are never the
            # writer's, which would hand them its lowered priority; and the first checkpoint
            # does not wait for it.
            plan.root.fs  # noqa: B018

    @property
    def busy(self) -> bool:
        """Whether an upload is in flight."""
        return self._pending is not None and not self._pending.is_set()

    def _submit(self, job: Callable[[], None]) -> None:
        """Hand `job` to the writer thread (started on first use)."""
        done = self._pending = threading.Event()
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(
                target=_serve, args=(self._jobs,), name="raysgd-checkpoint", daemon=True
            )
            self._writer.start()
        self._jobs.put((job, done))

    def close(self) -> None:
        """Let the writer thread end once the job in flight is done."""
        if self._writer is not None:
            self._jobs.put(None)
            self._writer = None

    def _on_step(self) -> None:
        plan, runner = self.plan, self.state.runner
        if plan is None:
            return
        # Due once a multiple of `every` was passed since the last checkpoint's step (a step
        # done again after a recovery does not take it again).
        due = runner.position.step // plan.every > self._taken_at // plan.every
        if not (due and runner.position.at_window_start):
            self._stage_ahead()
            return
        self._taken_at = runner.position.step
        started = time.perf_counter()
        self.finish()  # the one before, if storage has not kept up
        ctx = get_context()
        given_up = self._give_up_parts = threading.Event()
        self._pending_group = ctx.generation
        position = runner.position.position_state()
        epoch, step = int(position["epoch"]), int(position["step"])
        # Every worker finds the same folder on its own: the name derives from the attempt.
        name = checkpoint_name(epoch, step, token=plan.token)
        folder = plan.root.join(name)
        host_copy = self.state.copy_to_host()
        self.blocked_s += time.perf_counter() - started
        expected = type(self.state).parts(ctx.world_size)
        rank = ctx.world_rank
        # What a restore that goes back to this checkpoint needs besides its parts: whether it
        # holds every rank's slot of the group it would restore, and the call's count up to it.
        meta = {"world_size": ctx.world_size, "call": call_meta(runner.position.call)}

        def upload() -> None:
            try:
                if host_copy is not None:
                    host_copy.write(folder)
                if rank == 0:
                    _wait_for(folder, expected, given_up)
                    write_manifest(
                        folder,
                        self.state.kind,
                        epoch,
                        step,
                        expected=dict.fromkeys(expected),
                        meta=meta,
                    )
                    if plan.keep is not None:
                        prune(plan.root, keep=plan.keep)
                self.last = Written(folder.url, epoch, step)
            except Exception as exc:  # the checkpoint stays invisible; the next one may succeed
                self.error = f"checkpoint {folder.url} failed: {type(exc).__name__}: {exc}"
                logger.warning("%s", self.error)
                if rank != 0:
                    _give_up(folder, rank)

        self._submit(upload)

    def _stage_ahead(self) -> None:
        """Once per state, between checkpoints: run its `prepare_host_copy` work in the writer's slot
        (a checkpoint that falls due meanwhile waits for it, as for an upload)."""
        if self._ahead is self.state or self.busy:
            return
        self._ahead = self.state
        work = self.state.prepare_host_copy()
        if work is None:
            return

        def run() -> None:
            try:
                work()
            except Exception:  # the first checkpoint then allocates its memory itself
                logger.debug("could not prepare the checkpoint's host copy", exc_info=True)

        self._submit(run)

    def take_blocked(self) -> float:
        """The loop's waits at checkpoint steps since the last call of this (then reset)."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked

    def finish(self, timeout_s: Optional[float] = None) -> Optional[Written]:
        """Wait for the upload in flight; the last checkpoint this worker finished. One taken by
        an earlier process group stops waiting for the other workers' parts (see the module
        docstring)."""
        pending = self._pending
        if pending is not None:
            if self._pending_group != get_context().generation:
                self._give_up_parts.set()
            pending.wait(timeout_s)
        return self.last


#: The writer's nice value: the highest, so that it runs when the training loop leaves a core free.
WRITER_NICE = 19


def _serve(jobs: queue.SimpleQueue) -> None:
    """The writer thread: run each job handed over, at the lowest priority, until told to end."""
    _behind_training()
    while True:
        item = jobs.get()
        if item is None:
            return
        job, done = item
        try:
            job()
        finally:
            done.set()


def _behind_training() -> None:
    """Give the calling thread the lowest CPU priority, so that the training loop's steps, which
    run beside it on the same cores, are not slowed by the serialisation and the copy into the
    file (Linux keeps a nice value per thread; elsewhere the thread keeps its priority)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    except OSError:  # refused (a restricted container): the write goes on at normal priority
        logger.debug("could not lower the checkpoint writer's priority", exc_info=True)


def _give_up(folder: Storage, rank: int) -> None:
    """Tell rank 0 that this worker's part of `folder` will not come (best effort)."""
    try:
        folder.write_bytes(f"{_FAILED}{rank}", b"")
    except Exception:
        logger.debug("could not mark checkpoint %s as given up", folder.url, exc_info=True)


def _wait_for(folder: Storage, parts: list[str], given_up: threading.Event) -> None:
    """Wait until every part is in `folder` (written by the other workers' threads), or until
    `given_up` is set."""
    deadline = time.monotonic() + PARTS_TIMEOUT_S
    delay = 0.02
    while True:
        try:
            present = set(folder.file_sizes())
        except FileNotFoundError:
            present = set()
        missing = [p for p in parts if p not in present]
        if not missing:
            return
        failed = sorted(p for p in present if p.startswith(_FAILED))
        if failed:
            raise RuntimeError(f"a worker could not write its part ({failed[0]})")
        if given_up.is_set():
            raise RuntimeError(
                f"parts {missing} were still missing when the group was re-formed (their "
                "writers may be gone)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"parts {missing} never arrived")
        given_up.wait(delay)
        delay = min(1.0, delay * 2)
