"""U-Net (B, C) of the torchgpipe paper as one nn.Sequential, its skips made with torchgpipe.skip.

The network of the paper's U-Net experiments (after Ronneberger et al., 2015): five
levels (``depth``) below the input resolution, a bottleneck, and five levels back up.
``B`` is the number of convolution units in every cell, ``C`` the channels at the top
level, doubled at each level down. A convolution unit is a 3x3 convolution without bias,
2-D dropout (p = 0.1), instance norm and a leaky ReLU. A level down is a cell whose
output is stashed for the matching level up, then a 2x2 max pool; a level up doubles the
resolution (nearest neighbour), pops the level's skip and concatenates it, then runs a
cell. A 1x1 convolution gives one output channel. With this structure U-Net (6, 72) has
362.2M parameters and (11, 128) 2.21B, as the paper's memory table says.

Each convolution unit, each stash and pop, and each pool or upsampling is one layer of
the Sequential, so GPipe can cut between any two. A ``Namespace`` per level keeps the
levels' skips apart, so one skip name serves every level and GPipe sends each skip
straight to the partition that pops it.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from torchgpipe.skip import Namespace, pop, skippable, stash

__all__ = ["unet"]


def _unit(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.Dropout2d(p=0.1),
        nn.InstanceNorm2d(out_channels),
        nn.LeakyReLU(negative_slope=0.01),
    )


def _cell(in_channels: int, mid_channels: int, out_channels: int, units: int) -> list[nn.Module]:
    """``units`` convolution units: ``in`` to ``mid``, ``mid`` to ``mid``, ..., to ``out``."""
    if units == 1:
        return [_unit(in_channels, out_channels)]
    widths = [in_channels, *[mid_channels] * (units - 1), out_channels]
    return [_unit(a, b) for a, b in itertools.pairwise(widths)]


@skippable(stash=["skip"])
class Keep(nn.Module):
    """Stashes its input for the level up, and passes it on."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Stash ``x`` as this level's skip; return it unchanged."""
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Join(nn.Module):
    """Concatenates the level's skip to its input, padding the input if it is smaller."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]  # a generator
        """Pop this level's skip; return ``cat([x, skip])`` along the channels."""
        skip = yield pop("skip")
        dh, dw = skip.shape[-2] - x.shape[-2], skip.shape[-1] - x.shape[-1]
        if dh or dw:
            x = nn.functional.pad(x, [0, dw, 0, dh])
        return torch.cat([x, skip], dim=1)


def unet(
    units: int = 5, channels: int = 64, *, depth: int = 5, in_channels: int = 3,
    out_channels: int = 1,
) -> nn.Sequential:  # fmt: skip
    """U-Net (B = ``units``, C = ``channels``) with ``depth`` levels down and up."""
    levels = [Namespace(f"level {k}") for k in range(depth)]
    layers: list[nn.Module] = []
    for k in range(depth):
        entering = in_channels if k == 0 else channels * 2 ** (k - 1)
        width = channels * 2**k
        layers += _cell(entering, width, width, units)
        layers += [Keep().isolate(levels[k]), nn.MaxPool2d(2)]
    bottom = channels * 2 ** (depth - 1)
    layers += _cell(bottom, 2 * bottom, bottom, units)
    for k in reversed(range(depth)):
        # The level below gives channels * 2**k, the skip as many again.
        leaving = channels * 2 ** (k - 1) if k > 0 else channels // 2
        layers += [nn.Upsample(scale_factor=2), Join().isolate(levels[k])]
        layers += _cell(channels * 2 ** (k + 1), leaving, leaving, units)
    layers.append(nn.Conv2d(channels // 2, out_channels, 1, bias=False))
    return nn.Sequential(*layers)
