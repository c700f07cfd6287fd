"""Distributed PyTorch training on Ray: the RaySGD TorchTrainer, back on today's Ray and PyTorch."""

__version__ = "0.1.0"
__all__: list[str] = []
