"""Keep the memory a worker frees for its next step instead of handing it back to the OS.

A CPU training step allocates and frees the same large activation and gradient buffers every step.
glibc's default allocator returns freed memory at the top of its heap to the kernel once more than a
threshold is free (and serves large blocks with fresh `mmap`s), so each step faults the same pages
back in (the raysgd-core README gives what that cost the benchmark CNN). Raising the two thresholds
keeps those pages mapped, at no cost in resident size, since the next step reuses them. Blocks larger than the mmap threshold are still mapped and unmapped each time.

Only glibc has `mallopt`; elsewhere nothing changes. A process whose environment sets glibc's own
malloc variables is left as its owner configured it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "thresholds_set"]

logger = logging.getLogger("raysgd_core")

#: Blocks up to this size come from the heap (32 MiB is the largest value glibc accepts).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept mapped, up to this much.
TRIM_THRESHOLD = 128 << 20

# `mallopt` parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Environment variables by which a user tunes glibc's allocator; any of them means "hands off".
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

#: Whether `keep_freed_memory` set this process's thresholds (glibc has no call that reads them).
_set = False


def thresholds_set() -> bool:
    """Whether `keep_freed_memory` set this process's thresholds."""
    return _set


def keep_freed_memory() -> bool:
    """Set this process's malloc thresholds (see the module docstring); True if they were set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a static or unusual build: keep its defaults
        return False
    # mallopt returns 1 on success. The mmap threshold goes first: setting either one switches
    # off glibc's own adjustment of both, and a trim threshold alone would leave large blocks on
    # fresh mmaps forever.
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    global _set
    _set = _set or done
    if not done:
        logger.debug("mallopt refused raysgd's thresholds; the allocator keeps its defaults")
    return done
