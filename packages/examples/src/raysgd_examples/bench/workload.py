"""The one workload every benchmark side trains: a small ResNet on synthetic CIFAR-shaped data.

raysgd, `torchrun` DDP and Ray Train all build their model, data and step from this module, so a
difference in the numbers comes from the framework around the loop, never from the loop itself.
It imports only torch: the torchrun side runs it without Ray.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = [
    "NUM_CLASSES",
    "SyntheticCIFAR",
    "Timeline",
    "Workload",
    "make_dataset",
    "make_loader",
    "make_model",
    "make_optimizer",
    "train_step",
]

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)


@dataclass(frozen=True)
class Workload:
    """Sizes of the benchmark job; `quick()` gives a tiny one for smoke runs.

    Attributes:
        batch_size: Per-worker batch (the global batch is `batch_size * world_size`).
        width: Channels of the first stage (doubled at each of the three stages).
        blocks: Residual blocks per stage.
        pool: Distinct synthetic images held in memory (the data set cycles over them).
        seed: Seeds the images, the labels and the model's initial weights.
        lr: SGD learning rate.
        threads: torch threads per worker (one core each, so 2 workers on 2 cores do not fight).
    """

    batch_size: int = 64
    width: int = 32
    blocks: int = 1
    pool: int = 512
    seed: int = 0
    lr: float = 0.05
    threads: int = 1

    @classmethod
    def quick(cls) -> Workload:
        """Tiny sizes for a smoke run (seconds, not a measurement)."""
        return cls(batch_size=8, width=8, blocks=1, pool=64)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON results and for passing through configs and argv."""
        return asdict(self)


class SyntheticCIFAR(Dataset):
    """`length` items of (3x32x32 float image, class) cycling over `pool` seeded random images.

    A small pool keeps memory flat however many steps are run, while indexing and collation cost
    the same as a real in-memory CIFAR-10.
    """

    def __init__(self, length: int, pool: int = 512, seed: int = 0) -> None:
        if length < 1 or pool < 1:
            raise ValueError(f"length and pool must be >= 1, got {length} and {pool}")
        gen = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn((pool, *IMAGE_SHAPE), generator=gen)
        self.labels = torch.randint(0, NUM_CLASSES, (pool,), generator=gen)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = index % len(self.images)
        return self.images[i], self.labels[i]


class _Block(nn.Module):
    """A basic residual block (two 3x3 convs), with a 1x1 projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def make_model(workload: Workload) -> nn.Module:
    """A ResNet-style CNN: stem, three stages (width, 2x, 4x; stride 2 between), pool, linear."""
    torch.manual_seed(workload.seed)
    w = workload.width
    layers: list[nn.Module] = [
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
    ]
    c_in = w
    for stage, c_out in enumerate((w, 2 * w, 4 * w)):
        for block in range(workload.blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(_Block(c_in, c_out, stride))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, NUM_CLASSES)]
    return nn.Sequential(*layers)


def make_optimizer(model: nn.Module, workload: Workload) -> torch.optim.Optimizer:
    """Plain SGD with momentum, as in the seeds' CIFAR example."""
    return torch.optim.SGD(model.parameters(), lr=workload.lr, momentum=0.9)


def make_dataset(workload: Workload, num_steps: int, world_size: int = 1) -> SyntheticCIFAR:
    """A data set long enough for `num_steps` batches on each of `world_size` workers."""
    return SyntheticCIFAR(
        num_steps * workload.batch_size * world_size, workload.pool, workload.seed
    )


def make_loader(
    workload: Workload, num_steps: int, rank: int = 0, world_size: int = 1
) -> DataLoader:
    """A loader with `num_steps` batches for worker `rank`, sharded like raysgd shards.

    raysgd adds a `DistributedSampler` to a plain (unshuffled) loader; the torchrun and Ray Train
    sides add the same sampler themselves here, so all three read identical batches.
    """
    dataset = make_dataset(workload, num_steps, world_size)
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=False)
    return DataLoader(dataset, batch_size=workload.batch_size, sampler=sampler, drop_last=True)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """One step as RaySGD's default `train_batch` does it: forward, loss, backward, step."""
    features, target = batch
    loss = criterion(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    # `.item()` as RaySGD does for its metrics: every side pays the same sync.
    return loss.item()


class Timeline:
    """Wall-clock events appended as JSON lines to a file that several processes may share.

    Used where a time spans processes (a kill in one worker, the next step in a restarted one):
    `time.time()` is comparable across processes on one machine, `perf_counter` is not.
    """

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def mark(self, event: str, **fields: Any) -> None:
        """Append one event (no-op when the timeline has no file)."""
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields})
        # One short write per line in append mode: lines from different processes do not interleave.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read(self) -> list[dict[str, Any]]:
        """All events so far, oldest first."""
        if not self.path or not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
