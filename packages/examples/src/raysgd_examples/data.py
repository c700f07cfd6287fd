"""The data every example trains on: scikit-learn's bundled handwritten digits, and a synthetic line.

Nothing is downloaded. The digits (1797 images of 8x8 pixels, classes 0-9) ship inside scikit-learn;
`prepare_digits` still follows the pattern a real data set needs on a cluster: the first worker on a
node writes the prepared arrays to a shared folder under a `filelock.FileLock`, the others wait for
the lock and then only read. Copy this file next to an example when you copy the example.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from filelock import FileLock
from torch.utils.data import Dataset, TensorDataset

__all__ = ["DIGITS_CLASSES", "LinearDataset", "digits_datasets", "prepare_digits"]

DIGITS_CLASSES = 10
_DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "raysgd_examples_data")


def prepare_digits(data_dir: str | None = None, seed: int = 0, val_fraction: float = 0.2) -> str:
    """Write the digits, scaled to [0, 1] and split train/validation with `seed`, to an `.npz` file.

    Safe to call from every worker at once: the lock makes one process write and the others reuse
    the file (written to a temporary name and renamed, so a reader never sees half a file).
    Returns the file's path.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    data_dir = data_dir or _DEFAULT_DIR
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, f"digits_seed{seed}_val{val_fraction:g}.npz")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            # Imported here: only the process that prepares the data needs scikit-learn.
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            digits = load_digits()
            images = (digits.images / 16.0).astype(np.float32)[:, None]  # N x 1 x 8 x 8
            x_train, x_val, y_train, y_val = train_test_split(
                images,
                digits.target.astype(np.int64),
                test_size=val_fraction,
                random_state=seed,
                stratify=digits.target,
            )
            tmp = path + f".{os.getpid()}.tmp.npz"
            np.savez(tmp, x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val)
            os.replace(tmp, path)
    return path


def digits_datasets(
    data_dir: str | None = None, seed: int = 0, val_fraction: float = 0.2
) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets of `(image [1, 8, 8] float32, label int64)` pairs."""
    with np.load(prepare_digits(data_dir, seed, val_fraction)) as arrays:
        train = TensorDataset(
            torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
        )
        val = TensorDataset(torch.from_numpy(arrays["x_val"]), torch.from_numpy(arrays["y_val"]))
    return train, val


class LinearDataset(Dataset):
    """Points on the line y = a * x + b for x evenly spaced in [-1, 1): the seeds' regression data.

    (Centred on 0 so that plain SGD finds `a` and `b` in a few epochs.)
    """

    def __init__(self, a: float = 2.0, b: float = 5.0, size: int = 1000) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size!r}")
        self.x = torch.arange(size, dtype=torch.float32).unsqueeze(1) * (2.0 / size) - 1.0
        self.y = a * self.x + b

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]
