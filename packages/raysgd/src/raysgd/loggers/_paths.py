"""Where a file-writing logger puts one run's files (private)."""

from __future__ import annotations

import os

from raysgd.loggers.logger import current_trial

__all__ = ["run_directory"]


def run_directory(directory: str) -> str:
    """`directory`, or inside a Tune trial its subdirectory named after the trial, so that the
    trials of an experiment sharing one setting each write their own run."""
    trial = current_trial()
    path = os.path.join(directory, trial.trial_name) if trial is not None else directory
    return os.path.abspath(path)
