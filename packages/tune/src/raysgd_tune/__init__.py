"""Ray Tune adapters for raysgd: as_trainable, DistributedTrainableCreator."""

__version__ = "0.1.0"
__all__: list[str] = []
