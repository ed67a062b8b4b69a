"""ResNet-101 as one flat nn.Sequential (He et al., 2016), with a width knob.

The bottleneck blocks (1x1, 3x3, 1x1 convolutions with a shortcut) are layers of the
Sequential, between the stem (7x7 convolution, batch norm, ReLU, max pool) and the head
(average pool, flatten, linear), so GPipe can cut between any two blocks: 3 + 4 + 23 + 3
blocks and 7 other layers, 40 layers in all. ``width=64`` is the published network;
smaller widths keep the shape and shrink every convolution.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["Bottleneck", "resnet101"]

BLOCKS_101 = (3, 4, 23, 3)


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (with the stride), 1x1 up to 4x, plus the shortcut; then ReLU."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = 4 * channels
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """The block's output: ReLU(body(x) + shortcut(x))."""
        return self.relu(self.body(x) + self.shortcut(x))


def resnet101(width: int = 64, num_classes: int = 1000) -> nn.Sequential:
    """ResNet-101 flattened into 40 layers; ``width`` is the first stage's channels."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    in_channels = width
    for stage, count in enumerate(BLOCKS_101):
        channels = width * 2**stage
        for index in range(count):
            stride = 2 if stage > 0 and index == 0 else 1
            layers.append(Bottleneck(in_channels, channels, stride))
            in_channels = 4 * channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)
