"""A worker's training state as `torch.distributed.checkpoint` (DCP) files, written and read safely.

Used for strategies whose workers each hold part of the model (`ParallelStrategy.sharded`). The tensors go
through DCP, so every worker writes only its own shards and reads only the parts it needs when the
number of workers changed (DCP reshards on load); everything else (epoch, position, schedulers,
optimizer hyper-parameters, ...) is small, the same on every worker, and travels as a plain dict.

Loading never runs code from the files:

- DCP reads tensors with `torch.load(weights_only=True)`, but it un-pickles its `.metadata` file with
  plain `pickle` and non-tensor entries with `torch.load(weights_only=False)`. raysgd writes no
  non-tensor entry (they live in the plain dict) and refuses any at load (`_TensorsOnlyPlanner`),
  and reads the metadata with an unpickler that accepts only DCP's own metadata classes and torch's
  dtype/size/layout constants (`read_metadata`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    CheckpointException,
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.futures import Future
from torch.optim import Optimizer

from raysgd_operator.safe_load import load_failure_reason
from raysgd_operator.sharded_files import METADATA_FILE

__all__ = [
    "METADATA_FILE",
    "load_files",
    "load_full",
    "merge",
    "needed_parts",
    "read_metadata",
    "save_files",
    "split",
    "tensor_state",
]

#: Key in `others` listing the optimizers that had not stepped yet (saved without state).
FRESH = "fresh_optimizers"


def _container(models: Sequence[nn.Module]) -> nn.Module:
    # DCP's state-dict helpers take one module: a ModuleList gives every model a stable prefix
    # ("0.", "1.", ...) and lets several optimizers over several models be saved together.
    return nn.ModuleList(list(models))


def split(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split nested dicts into (tensor leaves, every other leaf), both keeping the nesting."""
    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            t, o = split(value)
            if t:
                tensors[key] = t
            if o or not t:
                # An empty dict is kept too: an optimizer without per-parameter state (SGD without
                # momentum) has `"state": {}`, and DCP takes a dict without "state" for its flat
                # form and fails to load it.
                others[key] = o
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            others[key] = value
    return tensors, others


def merge(tensors: dict[str, Any], others: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split`."""
    out = dict(tensors)
    for key, value in others.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def tensor_state(
    models: Sequence[nn.Module], optimizers: Sequence[Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, others) of the models and optimizers: sharded (DTensor) parts where sharded.

    DCP's `get_state_dict` gives an optimizer that has not stepped yet a state by taking a step
    with zero gradients and a zero learning rate. That step would count in Adam's bias correction,
    so such optimizers are emptied again afterwards, and `others[FRESH]` lists them so that loading
    leaves them empty too. The tensors still serve as the template a checkpoint is loaded into.
    """
    fresh = [i for i, optimizer in enumerate(optimizers) if not optimizer.state]
    model_sd, optim_sd = get_state_dict(
        _container(models), list(optimizers), options=StateDictOptions(full_state_dict=False)
    )
    for i in fresh:
        optimizers[i].state.clear()
    tensors, others = split({"models": model_sd, "optimizers": optim_sd})
    others[FRESH] = fresh
    return tensors, others


def save_files(tensors: dict[str, Any], directory: str, group: Any = None) -> None:
    """Write this worker's part of `tensors` under `directory` (a collective over `group`, by
    default the whole process group).

    Each worker may pass its own directory: the data files are per worker, and the worker of rank 0
    also writes the metadata file there.
    """
    dcp.save(
        tensors,
        storage_writer=FileSystemWriter(directory, single_file_per_rank=True),
        process_group=group,
    )


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing non-tensor entries (DCP un-pickles those unsafely)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise ValueError(
            "checkpoint holds a non-tensor entry in its tensor files "
            f"({read_item.dest_index.fqn!r}); raysgd does not load such entries (they could run code)"
        )


class _SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by the restricted unpickler, and which reads one
    data file at a time, so that a file that cannot be read is named in the error."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise ValueError(
                    f"{os.path.join(self.path, name)} is not a raysgd checkpoint file that can be "
                    f"loaded safely: {load_failure_reason(exc)}"
                ) from None
        done: Future = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(os.path.join(self.path, METADATA_FILE), "rb") as handle:
            metadata = read_metadata(handle.read())
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_files(
    models: Sequence[nn.Module],
    optimizers: Sequence[Optimizer],
    source: Union[str, StorageReader],
    others: dict[str, Any],
) -> None:
    """Load the tensors of `source` (a directory, or a reader of a state kept in memory:
    `sharded_memory.reader`), resharded to this group, plus `others` into the models and
    optimizers. A collective over the group."""
    if isinstance(source, StorageReader):
        storage_reader, directory = source, "the in-memory snapshot"
    else:
        storage_reader, directory = _SafeReader(source), source
    live, _ = tensor_state(models, optimizers)
    # DCP copies each tensor into the template as it reads it. Reading into copies, and setting
    # the state only once every file was read, leaves the worker as it was when a file turns out
    # unreadable half-way (at the cost of a second copy of this worker's part while loading).
    template = _clone(live)
    del live
    error: Optional[str] = None
    try:
        dcp.load(template, storage_reader=storage_reader, planner=_TensorsOnlyPlanner())
    except CheckpointException as exc:  # a BaseException holding each failed rank's traceback
        error = _first_failure(exc, directory)
    except ValueError as exc:  # the reader's, naming the file or chunk
        error = str(exc)
    # A rank's read failure does not always reach the others: they agree before any of them
    # sets its state, so that all of them keep the state they had, and all raise the same reason.
    error = _first_error(error)
    if error is not None:
        raise ValueError(error)
    others = dict(others)
    fresh = others.pop(FRESH, [])
    state = merge(template, others)
    if "param_groups" in state.get("optimizers", {}):
        # checkpoints written before `split` kept empty dicts lack it for stateless optimizers
        state["optimizers"].setdefault("state", {})
    set_state_dict(
        _container(models),
        list(optimizers),
        model_state_dict=state["models"],
        optim_state_dict=state.get("optimizers", {}),
        options=StateDictOptions(full_state_dict=False),
    )
    for i in fresh:
        optimizers[i].state.clear()


def _clone(tree: Any) -> Any:
    """A nested dict/list with every tensor replaced by a copy (DTensors stay DTensors)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _clone(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(item) for item in tree)
    return tree


def _first_error(error: Optional[str]) -> Optional[str]:
    """The first rank's error of all the ranks' `error`s (None when none failed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _first_failure(exc: CheckpointException, directory: str) -> str:
    """The first failed rank's reason, in one line."""
    for rank in sorted(exc.failures):
        error = exc.failures[rank][0]
        if isinstance(error, ValueError):  # ours: names the file and the reason
            return str(error)
        return f"checkpoint {directory} cannot be loaded: {load_failure_reason(error)}"
    return f"checkpoint {directory} cannot be loaded"


def needed_parts(
    models: Sequence[nn.Module], optimizers: Sequence[Optimizer], metadata: bytes
) -> set[Any]:
    """The parts this worker reads when loading a state with `metadata` (no collective): the data
    files of a checkpoint folder, the ranks whose chunks it reads of a state kept in memory
    (`sharded_memory`); empty when the layout is not one of these (then it needs them all).

    Lets a worker fetch only the shards that overlap its own part instead of the whole model.
    """
    template, _ = tensor_state(models, optimizers)
    planner = DefaultLoadPlanner()
    meta = read_metadata(metadata)
    planner.set_up_planner(template, meta, is_coordinator=False)
    plan = planner.create_local_plan()
    parts: set[Any] = set()
    for item in plan.items:
        info = meta.storage_data.get(item.storage_index) if meta.storage_data else None
        if hasattr(info, "relative_path"):
            parts.add(str(info.relative_path))  # type: ignore[union-attr]
        elif isinstance(info, int):
            parts.add(info)  # the rank that kept the chunk in memory
        else:
            return set()  # a layout this function does not know: the caller fetches everything
    return parts


_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("__"):
            import importlib

            found = getattr(importlib.import_module(module), name, None)
            # Only plain data: DCP's dataclasses and enums, never a function.
            if isinstance(found, type):
                return found
        if module == "torch":
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, _TORCH_CONSTANTS):
                return found
        if module == "torch.serialization" and name == "_get_layout":
            # maps a layout's name ("torch.strided") to the layout object; nothing else
            return torch.serialization._get_layout
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            import builtins

            return getattr(builtins, name)
        if module == "pathlib" and name in (
            "PosixPath",
            "PurePosixPath",
            "WindowsPath",
            "PureWindowsPath",
        ):
            import pathlib

            return getattr(pathlib, name)  # the checkpoint's own path, recorded by DCP
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: not allowed")


def read_metadata(data: bytes) -> Metadata:
    """DCP metadata from its bytes, refusing anything but DCP's data classes (no code runs)."""
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling error means: not metadata raysgd can read safely
        raise ValueError(f"not DCP checkpoint metadata that can be loaded safely: {exc}") from None
    if not isinstance(meta, Metadata):
        raise ValueError(f"not DCP checkpoint metadata: got {type(meta).__name__}")
    return meta


def load_full(
    models: Sequence[nn.Module],
    optimizers: Sequence[Optimizer],
    model_states: Sequence[dict[str, Any]],
    optimizer_states: Sequence[dict[str, Any]],
) -> None:
    """Load whole-model state dicts (`model.state_dict()`, `optimizer.state_dict()` of an unsharded
    run) into possibly sharded models: every worker keeps its own part of each tensor.

    Optimizer states name parameters by position; they are matched to this run's parameters by
    position in the parameter groups, which registering the same models in the same order keeps.
    """
    container = _container(models)
    model_sd = {
        f"{i}.{key}": value for i, sd in enumerate(model_states) for key, value in sd.items()
    }
    fqn_of = {id(p): name for name, p in container.named_parameters()}
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer, saved in zip(optimizers, optimizer_states):
        live = [p for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
        if len(live) != len(saved_ids):
            raise ValueError(
                f"optimizer state has {len(saved_ids)} parameters, the optimizer has {len(live)}"
            )
        to_fqn = {sid: fqn_of[id(p)] for sid, p in zip(saved_ids, live)}
        for sid, param_state in saved["state"].items():
            optim_sd["state"][to_fqn[sid]] = param_state
        for group in saved["param_groups"]:
            optim_sd["param_groups"].append(
                {**group, "params": [to_fqn[i] for i in group["params"]]}
            )
    set_state_dict(
        container,
        list(optimizers),
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )
