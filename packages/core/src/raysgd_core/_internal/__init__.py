"""Private building blocks of raysgd_core; no stable API."""

__all__: list[str] = []
