"""Runnable raysgd examples, the demo and the benchmarks."""

__version__ = "0.1.0"
__all__: list[str] = []
