"""What each `torchrun` process runs: ``-m raysgd_examples.bench._torchrun_worker <json config>``.

``{"mode": "allreduce"}`` only forms the gloo group and all-reduces once (the core start-up
reference); ``{"mode": "checkpoint", ...}`` runs the checkpoint benchmark's MLP loop
(`_checkpoint_loop.checkpoint_loop`); any other config runs `worker_loop`; both under plain
`DistributedDataParallel`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raysgd_examples.bench._loop import worker_loop

__all__ = ["main"]


def _init_process_group() -> None:
    # torchrun keeps its rendezvous store across `--max-restarts`: a restarted rank can read the
    # dead peer's gloo address before the new peer overwrites it and then hangs or is refused.
    # A prefix per restart attempt keeps the attempts apart.
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"raysgd_bench_attempt_{attempt}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)


def main(argv: list[str]) -> None:
    """Form the group from torchrun's environment, run the job, and end the process (exit 0)."""
    cfg = json.loads(argv[0])
    _init_process_group()
    try:
        if cfg.get("mode") == "allreduce":
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == dist.get_world_size()
        elif cfg.get("mode") == "checkpoint":
            from raysgd_examples.bench._checkpoint_loop import checkpoint_loop

            checkpoint_loop(cfg, wrap=DistributedDataParallel)
        else:
            worker_loop(cfg, wrap=DistributedDataParallel)
        # Both ranks leave together: tearing gloo down while a peer still sends aborts the process.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # The job is done and its results are on disk (every file written is closed). Even after the
    # barrier, gloo's teardown can race with the peer's own and abort this process ("terminate
    # called without an active exception"), which torchrun reports as a failed job: leave without
    # running any destructor.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
