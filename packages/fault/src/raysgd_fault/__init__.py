"""Failure policies for elastic training: pure decisions, no Ray calls.

A policy turns a `FailureStatus` (failures so far, workers wanted / alive / fitting, attempts) into a
`Decision` (RETRY with K workers, WAIT S seconds, GIVE_UP) with a human reason. The trainer performs
the decision; the policy only decides, so it is tested without Ray::

    from raysgd_fault import FailureStatus, get_policy

    policy = get_policy("elastic", min_workers=2)
    decision = policy.decide(FailureStatus(failures=1, max_retries=3, workers_wanted=4,
                                           workers_alive=2, workers_fitting=1))
    print(decision)  # RETRY with 3 worker(s): ...

When no worker was lost (the start of `train()` below the wanted size, a move off a draining
node) the policy's `scaling` (a `ScalingPolicy`) sizes the group instead: sizing is not a failure.
"""

from raysgd_fault.decision import (
    Action,
    Decision,
    FailureStatus,
    check_max_retries,
    describe,
)
from raysgd_fault.policies import DefaultPolicy, ElasticPolicy, FailurePolicy, NeverRetryPolicy
from raysgd_fault.registry import (
    ENTRY_POINT_GROUP,
    available_policies,
    get_policy,
    register_policy,
)
from raysgd_fault.scaling import (
    MOMENTS,
    FixedSize,
    GrowWhenRoom,
    ScalingDecision,
    ScalingPolicy,
    ScalingStatus,
)

__version__ = "0.1.0"
__all__ = [
    "ENTRY_POINT_GROUP",
    "MOMENTS",
    "Action",
    "Decision",
    "DefaultPolicy",
    "ElasticPolicy",
    "FailurePolicy",
    "FailureStatus",
    "FixedSize",
    "GrowWhenRoom",
    "NeverRetryPolicy",
    "ScalingDecision",
    "ScalingPolicy",
    "ScalingStatus",
    "available_policies",
    "check_max_retries",
    "describe",
    "get_policy",
    "register_policy",
]
