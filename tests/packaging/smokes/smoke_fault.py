"""raysgd-fault alone (no torch, no Ray): each built-in policy decides."""

import dataclasses

from _smoke import import_every_module, report

from raysgd_fault import Action, FailureStatus, get_policy

status = FailureStatus(
    failures=1,
    max_retries=3,
    workers_wanted=4,
    workers_alive=2,
    workers_fitting=1,
    attempt=0,
    error="worker 3 died (node lost)",
)
decisions = {}
for name in ("default", "never"):
    decision = get_policy(name).decide(status)
    decisions[name] = [decision.action.name, decision.num_workers, decision.wait_s, decision.reason]
over_budget = get_policy("default").decide(
    dataclasses.replace(status, failures=4, total_failures=4)
)
try:
    get_policy("nope")
    unknown = None
except ValueError as error:
    unknown = str(error)

report(
    "raysgd_fault",
    imported=import_every_module("raysgd_fault"),
    decisions=decisions,
    over_budget=over_budget.action.name,
    give_up_is=Action.GIVE_UP.name,
    unknown=unknown,
)
