"""Benchmarks: raysgd vs `torchrun` DDP vs Ray Train, side by side (`hatch run bench:<name>`).

Scripts: `core_startup`, `throughput`, `startup`, `recovery`, `amp`, and `run_all`, which runs them
all and writes `bench_results/all.json`, a chart and a markdown table. Every script takes
`--repeats`, `--steps`, `--quick` (tiny sizes, a smoke run) and `--out`.
"""

__all__: list[str] = []
