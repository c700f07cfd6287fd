"""TrainingOperator, creator adapter, metrics and BATCH_SIZE for raysgd."""

__version__ = "0.1.0"
__all__: list[str] = []
