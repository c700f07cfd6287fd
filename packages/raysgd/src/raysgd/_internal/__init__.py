"""The trainer's private parts, by where they run: `driver` (the user's process), `worker` (each
worker process), `state` (the kinds of training state, each with its driver's and its workers'
half) and `storage` (checkpoint files, read and written on both sides); `legacy` keeps the
earliest RaySGD's names working."""

__all__: list[str] = []
