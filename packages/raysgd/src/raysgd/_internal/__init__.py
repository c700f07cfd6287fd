"""Private pieces of the trainer: worker-side functions, recovery, checkpoints, TensorBoard."""

__all__: list[str] = []
