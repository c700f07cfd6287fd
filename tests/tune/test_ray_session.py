"""The public `ray.tune` functions reach the stand-in session raysgd installs on its workers.

raysgd_tune gives its workers a session through a private global of Ray (in one function,
`installed_session`); this test goes through Ray's public `tune.report`, `tune.get_checkpoint` and
`tune.get_context` so that a Ray release that moves the session fails here, loudly.
"""

from __future__ import annotations

import pytest
from ray import tune

from raysgd_tune._internal.ray_session import TrialInfo, installed_session
from raysgd_tune._internal.worker_run import WorkerRun, _ForwardingSession


def test_public_tune_calls_reach_the_installed_session() -> None:
    run = WorkerRun(rank=0, world_size=1, local_rank=0, local_world_size=1)
    info = TrialInfo(experiment_name="exp", trial_name="trial_1", trial_id="abc", trial_dir="/t")
    with installed_session(_ForwardingSession(run, info, checkpoint="restored")):
        tune.report({"loss": 0.5})
        assert tune.get_checkpoint() == "restored"
        context = tune.get_context()
        assert (context.get_experiment_name(), context.get_trial_name()) == ("exp", "trial_1")
        assert (context.get_trial_id(), context.get_trial_dir()) == ("abc", "/t")
    taken = run.poll(0.0, trial_node_id="", take=True)
    assert [r.metrics for r in taken.reports] == [{"loss": 0.5}]
    # Outside the block the process has no session again: Tune's calls return their defaults
    # (and Tune warns that it was called outside a trial).
    with pytest.warns(UserWarning, match="get_checkpoint"):
        assert tune.get_checkpoint() is None
