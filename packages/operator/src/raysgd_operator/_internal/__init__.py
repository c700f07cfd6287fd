"""Private helpers of raysgd_operator; no stable API."""

__all__: list[str] = []
