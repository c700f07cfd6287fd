"""The trainer's driver side: what runs in the user's process.

`controller` is the run controller, the one loop every train call and every change of the group
goes through (a loss, a drain, spares joining, a grow, a repair), in the phases of `phases`, with
the policies' answers checked in `decide` and each resize's result in `resize`; `losses` is its
ledger of lost workers, `group_view` what it needs of the group, the state and the cluster,
`guard` guards the calls other than train() (repairing through the controller), and `drains`
reads drain notices. `training_state` is the training state as the driver knows it
(where it is, how it is restored, saved and loaded), with what differs between a whole and a
sharded state left to its kind (the `state` folder); `worker_calls` owns the workers and what
they are built from; `checkpoints` says what `checkpoint_dir` receives and when;
`events`, `goodput` and `run_loggers` record what happened.
The rest checks and routes the user's arguments (`arguments`, `keywords`), splits Ray Data
(`datasets`), keeps the bounded copy of a small state (`state_copy`) and reads the machine
(`cluster`).
"""
