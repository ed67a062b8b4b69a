"""U-Net (Ronneberger et al., 2015) as one nn.Sequential, its skips made with torchgpipe.skip.

``unet(depth, channels)`` is U-Net (B, C) of the torchgpipe paper: ``depth`` (B)
down-sampling levels below the top, and ``channels`` (C) channels at the top level,
doubled at each level down. Each level down is two 3x3 convolutions (with batch norm and
ReLU) whose output is stashed for the matching level up, then a 2x2 max pool; each level
up is a 2x2 transposed convolution, the popped skip concatenated, and two convolutions
again. A ``Namespace`` per level keeps the levels' skips apart, so the one skip name
serves every level and GPipe sends each skip straight to the partition that pops it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchgpipe.skip import Namespace, pop, skippable, stash

__all__ = ["unet"]


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


@skippable(stash=["skip"])
class Down(nn.Module):
    """Two convolutions, the result stashed for the level up, then a 2x2 max pool."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.convs = _double_conv(in_channels, out_channels)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Stash the features of this level; return them pooled."""
        features = self.convs(x)
        yield stash("skip", features)
        return self.pool(features)


@skippable(pop=["skip"])
class Up(nn.Module):
    """A 2x2 transposed convolution, the level's skip concatenated, two convolutions."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.convs = _double_conv(2 * out_channels, out_channels)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Up-sample, join the skip of the level down, convolve."""
        skip = yield pop("skip")
        return self.convs(torch.cat([self.up(x), skip], dim=1))


def unet(
    depth: int = 5, channels: int = 64, in_channels: int = 3, num_classes: int = 1
) -> nn.Sequential:
    """U-Net (B = depth, C = channels) in 2 * depth + 2 layers."""
    levels = [Namespace(f"level {k}") for k in range(depth)]
    widths = [channels * 2**k for k in range(depth + 1)]
    downs = [
        Down(in_channels if k == 0 else widths[k - 1], widths[k]).isolate(levels[k])
        for k in range(depth)
    ]
    middle = _double_conv(widths[depth - 1], widths[depth])
    ups = [Up(widths[k + 1], widths[k]).isolate(levels[k]) for k in reversed(range(depth))]
    head = nn.Conv2d(widths[0], num_classes, 1)
    return nn.Sequential(*downs, middle, *ups, head)
