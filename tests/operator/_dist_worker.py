"""One rank of the 2-process gloo checks in test_distributed.py (run as a script, not collected).

Usage: python _dist_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR. Writes OUT_DIR/rank<RANK>.pt.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raysgd_operator import BATCH_SIZE, OperatorRunner, TrainingOperator

# Rank r holds rows r*8 .. r*8+7 of this data; the reference is the full 16 rows at once.
X = torch.arange(32.0).reshape(16, 2) / 32
Y = X.sum(dim=1, keepdim=True) * 3 - 1


class RegressionOperator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.register(
            models=model,
            optimizers=optimizer,
            criterion=nn.MSELoss(),
            ddp_args=config.get("ddp_args"),
        )
        rows = (
            slice(config["rank"] * 8, config["rank"] * 8 + 8)
            if config.get("own_shard")
            else slice(0, 16)
        )
        self.register_data(
            train_loader=DataLoader(
                TensorDataset(X[rows], Y[rows]), batch_size=config.get(BATCH_SIZE, 4)
            )
        )
        self.grads: list[torch.Tensor] = []

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        metrics = super().train_batch(batch, batch_info)
        self.grads.append(
            self.model.module.weight.grad.clone()
            if isinstance(self.model, DistributedDataParallel)
            else self.model.weight.grad.clone()
        )
        return metrics


class OwnSamplerOperator(RegressionOperator):
    def setup(self, config: dict[str, Any]) -> None:
        super().setup(config)
        dataset = TensorDataset(X, Y)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=config["rank"])
        self.register_data(
            train_loader=DataLoader(dataset, batch_size=config[BATCH_SIZE], sampler=sampler)
        )


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    out: dict[str, Any] = {}
    base = {"rank": rank, "own_shard": True}

    # A runner built before the group exists (world of 1), rebound once the group of 2 is formed.
    early = OperatorRunner(RegressionOperator, {BATCH_SIZE: 8, "rank": rank})
    own = OperatorRunner(OwnSamplerOperator, {BATCH_SIZE: 8, "rank": rank})
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    out["rebind"] = early.rebind(
        world_rank=rank, local_rank=rank, world_size=2, config={BATCH_SIZE: 4, "rank": rank}
    )
    loader = early.operator.train_loader
    out["rebind_ddp"] = isinstance(early.operator.model, DistributedDataParallel)
    out["rebind_loader"] = (
        isinstance(loader.sampler, DistributedSampler),
        loader.sampler.num_replicas,
        loader.batch_size,
    )
    early.train_epoch()
    out["rebind_weight"] = early.get_models()[0].weight.detach().clone()
    out["rebind_own_sampler"] = own.rebind(
        world_rank=rank, local_rank=rank, world_size=2, config={BATCH_SIZE: 2, "rank": rank}
    )

    # Custom ddp_args reach DDP; wrap_ddp=False leaves the model alone.
    ddp = OperatorRunner(
        RegressionOperator,
        {**base, "ddp_args": {"find_unused_parameters": True}},
        world_rank=rank,
        world_size=2,
    )
    out["find_unused"] = ddp.operator.model.find_unused_parameters
    out["ddp_type"] = type(ddp.operator.model).__name__
    plain = OperatorRunner(RegressionOperator, base, world_rank=rank, world_size=2, wrap_ddp=False)
    out["plain_type"] = type(plain.operator.model).__name__

    # Accumulation over 2 batches of 4 on each of 2 ranks == one step on all 16 rows.
    for k in (1, 2):
        runner = OperatorRunner(
            RegressionOperator,
            base,
            world_rank=rank,
            world_size=2,
            accumulate_grad_batches=k,
            add_dist_sampler=False,
        )
        runner.train_epoch(num_steps=2)
        out[f"acc{k}_grads"] = runner.operator.grads
        out[f"acc{k}_weight"] = runner.get_models()[0].weight.detach().clone()

    # set_epoch each epoch on the added sampler.
    sharded = OperatorRunner(RegressionOperator, {"rank": rank}, world_rank=rank, world_size=2)
    sharded.train_epoch()
    sharded.train_epoch()
    sampler = sharded.operator.train_loader.sampler
    out["sampler_epoch"] = sampler.epoch
    out["sharded_samples"] = sharded.train_epoch()["num_samples"]
    dist.barrier()
    dist.destroy_process_group()

    # Shrink: rank 0 alone re-forms a group of 1 and keeps its runner (as after losing rank 1).
    if rank == 0:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}.small", rank=0, world_size=1
        )
        out["shrink"] = early.rebind(
            world_rank=0, local_rank=0, world_size=1, config={BATCH_SIZE: 8, "rank": 0}
        )
        loader = early.operator.train_loader
        out["shrink_model"] = type(early.operator.model).__name__
        # Unsharded: the one worker left reads every row (its split has one replica).
        out["shrink_loader"] = (getattr(loader.sampler, "num_replicas", 1), loader.batch_size)
        out["shrink_samples"] = early.train_epoch()["num_samples"]
        dist.destroy_process_group()
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    # Skip interpreter teardown: gloo's background threads have been seen to abort the process
    # there ("terminate called without an active exception") after all the work was done.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
