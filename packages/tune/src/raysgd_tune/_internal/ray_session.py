"""The one place raysgd_tune touches a private part of Ray.

`ray.tune.report`, `ray.tune.get_checkpoint` and `ray.tune.get_context` find their session through a
module-level global of Ray (`ray.train._internal.session`); Ray has no public way to give a process
that Tune did not start (a `DistributedTrainableCreator` worker) a session. `installed_session` sets
that global for the duration of the user's function and nothing else here reaches into Ray.
`tests/tune/test_ray_session.py` calls the public functions through it, so a Ray release that
changes the mechanism fails that test instead of silently dropping the workers' reports.

What the trial knows about itself is read with the public `ray.tune.get_context()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray import tune

__all__ = ["TrialInfo", "installed_session", "trial_info"]


@dataclass(frozen=True)
class TrialInfo:
    """The trial's identity, copied from the trial process to its workers."""

    experiment_name: str | None = None
    trial_name: str | None = None
    trial_id: str | None = None
    trial_resources: Any = None
    trial_dir: str | None = None


def trial_info() -> TrialInfo:
    """This trial's `TrialInfo` (call it in the trial process, inside Tune's function)."""
    context = tune.get_context()
    return TrialInfo(
        experiment_name=context.get_experiment_name(),
        trial_name=context.get_trial_name(),
        trial_id=context.get_trial_id(),
        trial_resources=context.get_trial_resources(),
        trial_dir=context.get_trial_dir(),
    )


@contextlib.contextmanager
def installed_session(session: Any) -> Iterator[None]:
    """Make `session` the one `ray.tune.report` & co. use in this process while the block runs.

    `session` needs what those public functions read: `report(metrics, checkpoint=...)`,
    `loaded_checkpoint`, the `TrialInfo` fields and the worker's ranks (`world_rank`, ...).
    """
    from ray.train._internal import session as ray_session  # private: see the module docstring

    if not (
        hasattr(ray_session, "_session") and callable(getattr(ray_session, "get_session", None))
    ):
        raise RuntimeError(
            "this Ray release no longer keeps Tune's session in ray.train._internal.session; "
            "raysgd_tune's DistributedTrainableCreator needs updating for it"
        )
    previous = ray_session.get_session()
    ray_session._session = session
    try:
        yield
    finally:
        ray_session._session = previous
