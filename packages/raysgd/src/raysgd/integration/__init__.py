"""RaySGD's ``ray.tune.integration`` names for raysgd (see `raysgd.integration.torch`)."""

__all__: list[str] = []
