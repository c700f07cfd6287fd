"""The trainer's driver side: what runs in the user's process.

`recovery` is the loop every change of the group goes through (a loss, a grow, a preemption move,
a repair), `losses` its ledger of lost workers, and `training_state` the training state as the driver knows it (where it is, how it is
restored, saved and loaded), planned by `restore_plan`; `worker_calls` owns the workers and what
they are built from; `checkpoint_schedule` says what `checkpoint_dir` receives and when;
`preemption` acts on drain notices; `events`, `goodput` and `run_loggers` record what happened.
The rest checks and routes the user's arguments (`arguments`, `keywords`), splits Ray Data
(`datasets`), keeps the bounded copy of a small state (`state_copy`) and reads the machine
(`cluster`).
"""
