"""A small text corpus that needs no download: the source of a few standard-library modules.

The language-model examples train on it character by character (bytes 0-127, anything else as
127), which is real text with structure to learn, the same on every machine with this Python.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["VOCAB", "corpus"]

#: Characters are their byte values, anything past 127 folded into 127.
VOCAB = 128

_MODULES = ("argparse", "textwrap", "string", "shlex", "fractions", "dataclasses")


def corpus(max_chars: int) -> torch.Tensor:
    """The first `max_chars` characters of the corpus as a 1-D tensor of token ids."""
    import importlib

    text = "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in _MODULES)
    data = text.encode("ascii", errors="replace")[:max_chars]
    return torch.tensor(list(data), dtype=torch.long).clamp_(max=VOCAB - 1)
