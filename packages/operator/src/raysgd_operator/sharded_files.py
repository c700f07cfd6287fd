"""The names of the files a sharded state is written as (torch.distributed.checkpoint's layout),
for code that moves those files without importing DCP itself."""

from __future__ import annotations

__all__ = ["METADATA_FILE"]

#: DCP's metadata file beside the data files (``__<rank>_0.distcp``) of a sharded state.
METADATA_FILE = ".metadata"
