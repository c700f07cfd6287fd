"""Which kind of state: the one a strategy gives its workers (`kind_for`), and the one whose
format a checkpoint or a state dict to load is (`reader_at`, `reader_of_state`): each format is
read by the kind that writes it, into whatever kind the trainer has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raysgd._internal.state.kind import StateKind
from raysgd._internal.state.replicated import Replicated
from raysgd._internal.state.sharded import Sharded
from raysgd._internal.storage.format import gathered_files
from raysgd._internal.storage.location import Storage
from raysgd_operator import TrainingOptions

__all__ = ["kind_for", "reader_at", "reader_of_state"]


def kind_for(options: TrainingOptions) -> StateKind:
    """The kind of state the options' strategy gives its workers."""
    return Sharded() if options.sharded else Replicated()


def reader_at(location: Storage) -> type[StateKind]:
    """The kind whose checkpoint is at `location`: a folder of parts is a sharded state's, a
    file a whole state's."""
    return Sharded if location.is_folder() else Replicated


def reader_of_state(state: Mapping[str, Any]) -> type[StateKind]:
    """The kind whose `TorchTrainer.state_dict()` `state` is: a gathered folder's files are a
    sharded state's, anything else a whole state's dict."""
    return Sharded if gathered_files(state) is not None else Replicated
