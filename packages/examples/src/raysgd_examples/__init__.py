"""Runnable raysgd examples, the demo and the benchmarks.

Each example is a module run with ``python -m raysgd_examples.<name>`` (all take ``--smoke``):

- ``demo``: the first thing to run (``hatch run demo``): a CNN on the digits with a progress bar, a
  metrics table, TensorBoard logs and a checkpoint.
- ``linear``: creator functions fitting y = 2x + 5.
- ``digits``: the demo's training code as a minimal ``TrainingOperator``.
- ``dcgan``: two models and two optimizers in a custom operator.
- ``tune_example``, ``tune_ddp``, ``pbt``: Ray Tune searches.
- ``fault_demo``: a worker killed mid-epoch, and the recovery.
- ``migrate``: a RaySGD 1.x script with only its imports changed.

``raysgd_examples.data`` prepares their data; ``raysgd_examples.bench`` holds the benchmarks.
"""

__version__ = "0.1.0"
__all__: list[str] = []
