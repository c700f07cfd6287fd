"""Swappable mixed-precision backends (full, native torch.amp fp16/bf16, NVIDIA Apex)."""

__version__ = "0.1.0"
__all__: list[str] = []
