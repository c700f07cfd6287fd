"""Private helpers of raysgd_tune: resource requests and the worker side of
`DistributedTrainableCreator`. No stable API."""

__all__: list[str] = []
