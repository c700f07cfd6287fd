"""Ray worker pool with a ready torch.distributed process group."""

__version__ = "0.1.0"
__all__: list[str] = []
