"""The mechanics of a sharded training state on the driver: snapshots, checkpoint directories.

`ShardedSnapshots` is what `trainer_state.ShardedState` (the sharded implementation of the
trainer's `TrainingState`) works with; a replicated trainer uses one too, to load a checkpoint
directory. With a sharded strategy no process holds the whole model. The workers snapshot their parts in the
training loop, each part also on a peer (see `worker_sharded`); the driver learns of a snapshot
only when it asks for one (start-up, `save`, after a restore) or when a restore collects what the
survivors hold, and then keeps only what is small: the DCP metadata and the replicated rest of the
state (epoch, position, schedulers, ...).

A checkpoint is a directory: DCP's `.metadata`, one `__<rank>_0.distcp` data file per worker, and
`raysgd_state.pt` (the rest, read with `torch.load(weights_only=True)`). Workers on the driver's
node write their files straight into it; the others send theirs through Ray's object store. It is
written into a temporary directory beside the target and renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import ray
import torch

from raysgd._internal import worker_sharded as ws
from raysgd._internal.restore_plan import StateLostError
from raysgd_core import WorkerGroup
from raysgd_operator import TrainingOptions

__all__ = [
    "GATHERED_FORMAT",
    "STATE_FILE",
    "ShardedSnapshots",
    "is_sharded_checkpoint",
    "read_checkpoint",
]

logger = logging.getLogger("raysgd")

#: The replicated part of the state inside a sharded checkpoint directory.
STATE_FILE = "raysgd_state.pt"
#: `format` of the dict `ShardedSnapshots.gather` returns (what `state_dict()` gives when sharded).
GATHERED_FORMAT = "raysgd-dcp"


def is_sharded_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint directory (rather than a one-file checkpoint)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ws.METADATA_FILE))


def read_checkpoint(path: str) -> tuple[bytes, dict[str, Any]]:
    """(metadata, state) of a checkpoint directory, validated; nothing in it runs as code."""
    from raysgd_operator import load_failure_reason, read_dcp_metadata

    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path!r} is not a raysgd checkpoint directory (no {ws.METADATA_FILE})")
    with open(os.path.join(path, ws.METADATA_FILE), "rb") as handle:
        metadata = handle.read()
    read_dcp_metadata(metadata)  # raises ValueError unless it is plain DCP metadata
    try:
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types; all mean "not ours"
        raise ValueError(
            f"{os.path.join(path, STATE_FILE)} is not a raysgd checkpoint file that can be "
            f"loaded safely: {load_failure_reason(exc)}"
        ) from None
    if not isinstance(state, dict) or "epoch" not in state:
        raise ValueError(f"{path!r}: {STATE_FILE} is not a raysgd state")
    return metadata, state


def _driver_node() -> str:
    return ray.get_runtime_context().get_node_id()


def _source_for(group: WorkerGroup, path: str) -> ws.Source:
    """`path` itself when every worker is on this node, else its files through the object store."""
    if all(w.node_id == _driver_node() for w in group.workers):
        return path
    source: dict[str, Any] = {}
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as handle:
                source[name] = ray.put({name: handle.read()})
    return source


class ShardedSnapshots:
    """The driver's view of the workers' sharded snapshots (small: DCP metadata and the
    replicated rest of the state), and the checkpoint directories written from them."""

    def __init__(self) -> None:
        self.step = -1
        self.metadata: Optional[bytes] = None
        self.state: Optional[dict[str, Any]] = None
        #: The last checkpoint written or loaded, and its step: the fallback when a part is lost
        #: together with the peer that held its copy.
        self.last_checkpoint: Optional[str] = None

    def start(self, group: WorkerGroup) -> None:
        """Make every worker keep snapshots (after its runner was built) and take the first."""
        group.execute(ws.start_snapshots)
        self.capture(group)

    def capture(self, group: WorkerGroup) -> None:
        """Snapshot every worker's part now, and its peer's copy (a collective); wait for it."""
        results = group.execute(ws.snapshot_now)
        self.step, self.metadata, self.state = results[0]

    def write(self, group: WorkerGroup, path: str) -> str:
        """Write the current snapshot as a checkpoint directory at `path`; returns its absolute path."""
        if self.metadata is None or self.state is None:
            raise RuntimeError("no sharded snapshot to write")
        path = os.path.abspath(os.fspath(path))
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".raysgd-ckpt-", dir=parent)
        try:
            refs = group.execute(ws.write_own, self.step, tmp, _driver_node())
            for ref in refs:
                if ref is not None:  # a worker on another node: its files came through Ray
                    ws._write_dir(tmp, ray.get(ref))
            ws._write_dir(tmp, {ws.METADATA_FILE: self.metadata})
            torch.save(self.state, os.path.join(tmp, STATE_FILE))
            _replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last_checkpoint = path
        return path

    def load(self, group: WorkerGroup, path: str) -> None:
        """Load a checkpoint directory into every worker, resharded to the group's size."""
        path = os.path.abspath(os.fspath(path))
        metadata, state = read_checkpoint(path)
        group.execute(ws.load_checkpoint, metadata, state, _source_for(group, path))
        self.last_checkpoint = path

    def gather(self, group: WorkerGroup) -> dict[str, Any]:
        """The whole snapshot in this process (what `TorchTrainer.state_dict()` returns)."""
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            keep = self.last_checkpoint
            path = self.write(group, os.path.join(tmp, "ckpt"))
            self.last_checkpoint = keep
            files = ws._read_dir(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"format": GATHERED_FORMAT, "files": files}

    def load_gathered(self, group: WorkerGroup, state: dict[str, Any]) -> None:
        """Load what `gather` returned."""
        files = state.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, bytes) for v in files.values()):
            raise ValueError("a sharded state dict must hold {'files': {name: bytes}}")
        tmp = tempfile.mkdtemp(prefix="raysgd-state-")
        try:
            for name in files:
                if os.path.basename(name) != name or name in (".", ".."):
                    raise ValueError(f"bad file name in sharded state: {name!r}")
            ws._write_dir(tmp, files)
            keep = self.last_checkpoint
            self.load(group, tmp)
            self.last_checkpoint = keep
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def hand_over(self, group: WorkerGroup, leaving: Sequence[int]) -> None:
        """Before the workers of `leaving` leave on purpose: snapshot now (every worker is at the
        same step boundary) and give each leaving worker's part to a worker that stays, so that
        the group rebuilt without them restores every part (no step is redone). When every
        worker leaves, the snapshot is all: the replacements that join first restore from it."""
        self.capture(group)
        staying = [r for r in range(group.world_size) if r not in set(leaving)]
        if not staying:
            return
        offers = group.execute(ws.offer)
        wanted = set(leaving)
        given: list[dict[int, Any]] = [{} for _ in range(group.world_size)]
        for i, rank in enumerate(sorted(wanted)):
            for offered in offers:
                part = offered["held"].get(self.step, {}).get("parts", {}).get(rank)
                if part is not None:
                    given[staying[i % len(staying)]][rank] = part
                    break
        # Each worker takes its own share (the argument is every worker's, in rank order).
        group.execute(ws.adopt_parts_of, self.step, given)

    def restore(
        self,
        group: WorkerGroup,
        operator_ref: Any,
        config: dict[str, Any],
        options: TrainingOptions,
        dataset_splits: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[int, int, str]:
        """After a resize: rebuild every runner from the newest snapshot whose every part survived
        (each worker's own or its peer's copy), resharded to the new size, and go on with the call
        the survivors were in; when some part is lost with its copy, from the last checkpoint.
        `dataset_splits`: the datasets split over the new group (every rank's, in rank order).

        Returns (the step training goes on from, the furthest step a survivor had started, where
        the state came from).
        """
        offers = group.execute(ws.offer)
        reached = max(
            (
                p.step + (1 if p.in_batch or not p.clean else 0)
                for o in offers
                if (p := o["progress"])
            ),
            default=0,
        )
        call = next((o["call"] for o in offers if o["call"] is not None), None)
        complete = _complete_snapshots(offers)
        if complete:
            step, snapshot = max(complete.items())
            source: ws.Source = {
                name: ref for names, ref, _ in snapshot["parts"].values() for name in names
            }
            metadata, state = snapshot["metadata"], snapshot["state"]
            meters = _meters_for(snapshot["parts"], group.world_size)
            what = f"the in-memory snapshot at step {step}"
        elif self.last_checkpoint is not None:
            logger.warning(
                "the in-memory parts of worker(s) %s were lost together with their replicas: "
                "restoring the last checkpoint %s (work since then is redone)",
                _missing_parts(offers),
                self.last_checkpoint,
            )
            metadata, state = read_checkpoint(self.last_checkpoint)
            source = _source_for(group, self.last_checkpoint)
            step, call, meters = int(state.get("step", 0)), None, []
            what = f"checkpoint {self.last_checkpoint} at step {step}"
        else:
            raise StateLostError(
                "a worker's part of the sharded state was lost together with the peer holding its "
                "copy, and there is no checkpoint to fall back on (save one, or train with "
                "checkpoint='auto')"
            )
        # `operator_ref`: the operator class in the object store (a top-level ref, resolved there)
        group.execute(
            ws.restore,
            operator_ref,
            config,
            options,
            metadata,
            state,
            source,
            dataset_splits,
            call,
            meters,
        )
        group.execute(ws.start_snapshots)
        self.capture(group)  # every part has a copy again, in the new group's layout
        return step, max(reached, step), what


def _complete_snapshots(offers: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """The snapshots every part of which some survivor holds: step -> metadata, state, parts."""
    found: dict[int, dict[str, Any]] = {}
    for offered in offers:
        for step, held in offered["held"].items():
            entry = found.setdefault(step, {**held, "parts": {}})
            entry["parts"].update(held["parts"])
    return {
        step: entry
        for step, entry in found.items()
        if set(entry["parts"]) >= set(range(entry["world_size"]))
    }


def _missing_parts(offers: Sequence[Mapping[str, Any]]) -> list[int]:
    """The old ranks whose part of the newest snapshot no survivor holds."""
    newest: dict[str, Any] = {}
    for offered in offers:
        for step, held in offered["held"].items():
            if not newest or step > newest["step"]:
                newest = {"step": step, "size": held["world_size"], "ranks": set()}
            if step == newest["step"]:
                newest["ranks"] |= set(held["parts"])
    if not newest:
        return []
    return sorted(set(range(newest["size"])) - newest["ranks"])


def _meters_for(parts: Mapping[int, Any], world_size: int) -> list[Any]:
    """The call's metrics per new rank: new rank r takes those of the old ranks r, r + n, ..."""
    merged: list[Any] = [None] * world_size
    for old_rank in sorted(parts):
        meters = parts[old_rank][2]
        if meters is None:
            continue
        index = old_rank % world_size
        if merged[index] is None:
            merged[index] = meters
        else:
            merged[index].merge(meters)
    return merged


def _replace_dir(tmp: str, path: str) -> None:
    """Move the finished directory `tmp` to `path`; an older checkpoint there is replaced only now."""
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
