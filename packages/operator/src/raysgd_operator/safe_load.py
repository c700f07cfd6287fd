"""Why `torch.load(weights_only=True)` refused some bytes, in one line a user can act on.

torch's own message for a refused file spans many lines and advises loading it again with
`weights_only=False`, which would run whatever code the file holds; a checkpoint from an unknown
source must never be loaded that way. raysgd reports the reason without that advice, for single-file
checkpoints and the data files of sharded ones alike.
"""

from __future__ import annotations

__all__ = ["load_failure_reason"]


#: Lines of torch's load errors that advise loading unsafely or point to docs, not the reason.
_ADVICE_MARKERS = (
    "weights_only",
    "weights only",
    "trusted source",
    "check the documentation",
    "safe_globals",
    "http",
)


def load_failure_reason(exc: Exception) -> str:
    """Why `torch.load` refused the bytes, in one line, without torch's advice to retry with
    `weights_only=False` (that would run whatever code the file holds)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    refused_unsafe = bool(lines) and lines[0].lower().startswith("weights only load failed")
    kept = [
        line.removeprefix("WeightsUnpickler error:").strip()
        for line in lines
        if not any(marker in line.lower() for marker in _ADVICE_MARKERS)
    ]
    if refused_unsafe:
        detail = f" ({kept[0]})" if kept else ""
        return f"the safe loader (tensors and plain containers only) refused it{detail}"
    if kept:
        # The first sentence: torch follows it with guesses at the cause and advice.
        return f"{type(exc).__name__}: {kept[0].split('. ')[0].rstrip('.')}"
    return f"{type(exc).__name__} while reading it"
