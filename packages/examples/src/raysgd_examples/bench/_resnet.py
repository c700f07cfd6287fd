"""A ResNet-50-shaped network for `bench:gpu` where torchvision is not installed.

Bottleneck blocks in four stages of 3, 4, 6 and 3 blocks (widths 64 to 512, expansion 4), a 7x7
stem with max pooling, global average pooling and a linear classifier: the layer shapes and the
amount of work of ResNet-50, written here so that the benchmark runs with torch alone. Only torch is
imported.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet50_like"]

_EXPANSION = 4


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    ]


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand; a projected shortcut where the shape changes."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * _EXPANSION
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride),
            nn.ReLU(inplace=True),
            *_conv_bn(width, c_out, 1),
        )
        self.shortcut: nn.Module = (
            nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet50_like(num_classes: int = 1000) -> nn.Module:
    """A randomly initialised ResNet-50-shaped classifier for 3-channel images."""
    layers: list[nn.Module] = [
        *_conv_bn(3, 64, 7, 2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(_Bottleneck(c_in, width, stride if i == 0 else 1))
            c_in = width * _EXPANSION
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)
