"""ResNet-50 after torchvision's ``resnet50`` layout (torchvision need not be installed): the same
modules in the same registration order, 161 parameter tensors, 25,557,032 parameters. A workload
(``package.module:build``, ``ddp.bench.config.workloads``) for ``ddp simulate --model tests.resnet:build``,
held to PyTorch's DDP benchmark on DGX-1s (docs/torchrun-and-simulate.md, "Validation")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_PIXELS = 224  # torchvision's ImageNet crop, as PyTorch's DDP benchmark feeds it
CLASSES = 1000


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, torchvision's "v1.5"), 1x1 expand by 4; a projection on
    the shortcut where the shape changes."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)  # (B, 64, 112, 112)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)  # (B, 64, 56, 56)
        channels = 64
        for index, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=1):
            layer = [Bottleneck(channels, width, stride)] + [Bottleneck(width * 4, width) for _ in range(blocks - 1)]
            setattr(self, f"layer{index}", nn.Sequential(*layer))  # layer4: (B, 2048, 7, 7)
            channels = width * 4
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # (B, classes)


def build(batch_size: int, seq_len: int):
    """The workload contract: ``seq_len`` is unused (images are 224 x 224)."""

    def batch(generator: torch.Generator):
        images = torch.randn(batch_size, 3, IMAGE_PIXELS, IMAGE_PIXELS, generator=generator)
        return images, torch.randint(0, CLASSES, (batch_size,), generator=generator)

    return ResNet50(), batch, F.cross_entropy
