"""Failure policies for elastic training: pure decisions, no Ray calls."""

__version__ = "0.1.0"
__all__: list[str] = []
