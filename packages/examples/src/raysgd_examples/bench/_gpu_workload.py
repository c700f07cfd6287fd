"""The GPU benchmark's job: ResNet-50 on one fixed synthetic batch, and the hand-written loop.

Every side of `bench:gpu` builds its model, data and optimizer here. The data set serves the same
in-memory batch (images and labels made once, page-locked on first use) at every index, so the
input pipeline costs nothing but the host-to-device copy and the numbers compare the training loops.
The plain and Ray Train sides run `timed_loop`; raysgd runs its own default `train_batch` on the
same pieces. Only torch is imported (torchvision lazily, with a built-in fallback).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "AUTOCAST",
    "PRECISIONS",
    "FixedBatch",
    "GpuJob",
    "StepClock",
    "make_loader",
    "make_model",
    "make_optimizer",
    "timed_loop",
]

PRECISIONS = ("fp32", "fp16", "bf16")
#: The autocast dtype of each precision (None: no autocast).
AUTOCAST: dict[str, Optional[torch.dtype]] = {
    "fp32": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

#: The job's settings as one plain dict (it travels through argv and Ray configs): ``batch_size``,
#: ``image``, ``num_classes``, ``warmup``, ``steps``, ``precision``, ``seed``.
GpuJob = dict[str, Any]


def make_model(num_classes: int = 1000, seed: int = 0) -> tuple[nn.Module, str]:
    """A randomly initialised ResNet-50 and what it is: torchvision's, else the built-in copy."""
    torch.manual_seed(seed)
    try:
        import torchvision
    except ImportError:
        from raysgd_examples.bench._resnet import resnet50_like

        return resnet50_like(num_classes), "built-in ResNet-50 (torchvision is not installed)"
    return torchvision.models.resnet50(weights=None, num_classes=num_classes), (
        f"torchvision {torchvision.__version__} resnet50"
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum (PyTorch's default multi-tensor implementation)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class FixedBatch(Dataset):
    """``length`` items, each the same ``(images, labels)`` batch: a loader with ``batch_size=None``."""

    def __init__(self, batch_size: int, image: int, num_classes: int, length: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(batch_size, 3, image, image, generator=gen)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index >= self.length:
            raise IndexError(index)
        if torch.cuda.is_available() and not self.images.is_pinned():
            # Pinned once here, so the loader's pin_memory finds nothing left to copy.
            self.images, self.labels = self.images.pin_memory(), self.labels.pin_memory()
        return self.images, self.labels


def make_loader(job: GpuJob) -> DataLoader:
    """``warmup + steps`` batches of the fixed batch, pinned, in the main process."""
    data = FixedBatch(
        job["batch_size"],
        job["image"],
        job["num_classes"],
        job["warmup"] + job["steps"],
        job["seed"],
    )
    return DataLoader(data, batch_size=None, pin_memory=torch.cuda.is_available())


class StepClock:
    """Wall-clock time of a run of steps, the device drained at both ends (and nowhere else)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: Optional[float] = None
        self.elapsed: Optional[float] = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self) -> None:
        """Before the first timed step."""
        self.start, self.elapsed = self._now(), None

    def end(self) -> None:
        """After the last timed step."""
        assert self.start is not None, "StepClock.end() before begin()"
        self.elapsed = self._now() - self.start


def timed_loop(job: GpuJob, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """The plain mixed-precision loop: autocast, a GradScaler for fp16, no host read per step.

    Trains ``warmup`` untimed then ``steps`` timed batches; returns ``elapsed_s`` and what the
    process ran with.
    """
    torch.backends.cudnn.benchmark = True
    dtype = AUTOCAST[job["precision"]]
    optimizer = make_optimizer(model)
    criterion = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type, enabled=job["precision"] == "fp16")
    clock = StepClock(device)
    model.train()
    for index, (images, labels) in enumerate(make_loader(job)):
        if index == job["warmup"]:
            clock.begin()
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = criterion(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    clock.end()
    return {"elapsed_s": clock.elapsed, "threads": torch.get_num_threads()}
