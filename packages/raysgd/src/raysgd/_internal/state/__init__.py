"""The kinds of training state, each one module with both halves: the driver's and the workers'.

`kind` is the interface (`StateKind`, naming its workers' half, a `worker.state.WorkerState`);
`replicated` (``ddp``, ``none``: every worker holds all of it) and `sharded` (``fsdp``: each
holds its part, with in-memory snapshots) implement it, each planning its restores, writing and
reading its own checkpoint format and handing its state over on a move; `plan` is the one rule
both plan by; `pick` says which kind a strategy, a checkpoint or a state dict is. The driver
imports this folder; the workers import only the module of their own kind, whose class the
driver hands them (nothing here is imported by `worker/`).
"""
