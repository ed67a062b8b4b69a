"""AmoebaNet-D (L, F) as one nn.Sequential of cells (Real et al., 2019; GPipe's benchmark).

Every cell combines the two previous cells' outputs: it turns both to ``C`` channels,
then builds five nodes, each the sum of two operations applied to earlier states
(the two inputs, then the nodes), and concatenates some of the states. Which operations
read which states is AmoebaNet-D's genotype, as published (the lists below). Normal
cells keep the size; reduction cells halve it (operations reading the cell's inputs use
stride 2) and double ``C``.

In the Sequential, a cell takes and returns the pair ``(previous, current)``, so GPipe
can cut between any two cells. The ImageNet network: a stem (3x3 convolution with
stride 2 and batch norm to ``F / 4`` channels, then reduction cells at ``F / 2`` and
``F``), three stacks of ``L / 3`` normal cells with a reduction cell between them, and
a head (ReLU, global average pool, linear): ``L + 6`` layers. In a cell, state 0 is the
newest input and state 1 the one before. The stem's channel counts are this
implementation's reading of the ImageNet network; (18, 256) comes to 122,458,408
parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["amoebanetd"]

Pair = tuple[Tensor, Tensor]


def _relu_conv_bn(c_in: int, c_out: int, kernel: int = 1, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


def _none(c: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else _FactorizedReduce(c, c)


def _conv_1x1(c: int, stride: int) -> nn.Module:
    return _relu_conv_bn(c, c, 1, stride)


def _conv_3x3(c: int, stride: int) -> nn.Module:
    """A bottleneck: 1x1 to C/4, 3x3 (with the stride), 1x1 back to C."""
    quarter = max(c // 4, 1)
    return nn.Sequential(
        _relu_conv_bn(c, quarter), _relu_conv_bn(quarter, quarter, 3, stride),
        _relu_conv_bn(quarter, c),
    )  # fmt: skip


def _conv_1x7_7x1(c: int, stride: int) -> nn.Module:
    """A bottleneck: 1x1 to C/4, 1x7 then 7x1 (with the stride), 1x1 back to C."""
    quarter = max(c // 4, 1)
    return nn.Sequential(
        _relu_conv_bn(c, quarter),
        nn.ReLU(),
        nn.Conv2d(quarter, quarter, (1, 7), stride=(1, stride), padding=(0, 3), bias=False),
        nn.Conv2d(quarter, quarter, (7, 1), stride=(stride, 1), padding=(3, 0), bias=False),
        nn.BatchNorm2d(quarter),
        _relu_conv_bn(quarter, c),
    )


def _max_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride=stride, padding=1)


def _max_pool_2x2(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(2, stride=stride) if stride > 1 else nn.MaxPool2d(3, 1, padding=1)


def _avg_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


Op = Callable[[int, int], nn.Module]

# AmoebaNet-D's genotype: (state read, operation) for the two halves of each node.
NORMAL: list[tuple[int, Op]] = [
    (1, _conv_1x1), (1, _max_pool_3x3), (1, _none), (0, _conv_1x7_7x1), (0, _conv_1x1),
    (0, _conv_1x7_7x1), (2, _max_pool_3x3), (2, _none), (1, _avg_pool_3x3), (5, _conv_1x1),
]  # fmt: skip
NORMAL_CONCAT = (0, 3, 4, 6)
REDUCTION: list[tuple[int, Op]] = [
    (0, _max_pool_2x2), (0, _max_pool_3x3), (2, _none), (1, _conv_3x3), (2, _conv_1x7_7x1),
    (2, _max_pool_3x3), (3, _none), (1, _max_pool_2x2), (2, _avg_pool_3x3), (3, _conv_1x1),
]  # fmt: skip
REDUCTION_CONCAT = (4, 5, 6)


class _FactorizedReduce(nn.Module):
    """Halves the size with two stride-2 1x1 convolutions on offset pixels."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.left = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.right = nn.Conv2d(c_in, c_out - c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        """Both halves, concatenated, normalized."""
        x = self.relu(x)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.left(x), self.right(shifted)], dim=1))


class Cell(nn.Module):
    """A normal or reduction cell on the pair (previous, current)."""

    def __init__(
        self, c_prev_prev: int, c_prev: int, c: int, *, reduction: bool, reduction_prev: bool
    ) -> None:
        super().__init__()
        # State 0 is the newest input (the previous cell's output), state 1 the one before,
        # which is twice the size after a reduction: halve it too.
        self.pre0 = _relu_conv_bn(c_prev, c)
        self.pre1 = (
            _FactorizedReduce(c_prev_prev, c) if reduction_prev else _relu_conv_bn(c_prev_prev, c)
        )
        genotype = REDUCTION if reduction else NORMAL
        self.reads = [state for state, _ in genotype]
        self.ops = nn.ModuleList(
            op(c, 2 if reduction and state < 2 else 1) for state, op in genotype
        )
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.out_channels = len(self.concat) * c

    def forward(self, pair: Pair) -> Pair:
        """Return (current, this cell's output)."""
        previous, current = pair
        states = [self.pre0(current), self.pre1(previous)]
        for node in range(len(self.ops) // 2):
            a, b = 2 * node, 2 * node + 1
            states.append(self.ops[a](states[self.reads[a]]) + self.ops[b](states[self.reads[b]]))
        return current, torch.cat([states[k] for k in self.concat], dim=1)


class _Stem(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(c))  # fmt: skip

    def forward(self, x: Tensor) -> Pair:
        y = self.conv(x)
        return y, y


class _Head(nn.Module):
    def __init__(self, c: int, num_classes: int) -> None:
        super().__init__()
        self.classify = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(c, num_classes))  # fmt: skip

    def forward(self, pair: Pair) -> Tensor:
        return self.classify(pair[1])


def amoebanetd(
    num_layers: int = 18, num_filters: int = 256, num_classes: int = 1000
) -> nn.Sequential:
    """AmoebaNet-D (L = num_layers, F = num_filters) for ImageNet-sized images.

    A stem (3x3 convolution with stride 2 to ``F / 4`` channels, then two reduction
    cells at ``F / 2`` and ``F``), ``L`` normal cells in three stacks of ``L / 3`` with a
    reduction cell between stacks, and a head: ``L + 6`` layers.
    """
    layers: list[nn.Module] = [_Stem(max(num_filters // 4, 1))]
    c_prev_prev = c_prev = max(num_filters // 4, 1)
    reduction_prev = False

    def add(c: int, reduction: bool) -> None:
        nonlocal c_prev_prev, c_prev, reduction_prev
        cell = Cell(c_prev_prev, c_prev, c, reduction=reduction, reduction_prev=reduction_prev)
        layers.append(cell)
        c_prev_prev, c_prev, reduction_prev = c_prev, cell.out_channels, reduction

    add(max(num_filters // 2, 1), True)  # the stem's reduction cells
    add(num_filters, True)
    c = num_filters
    for stack in range(3):
        if stack > 0:
            c *= 2
            add(c, True)
        for _ in range(num_layers // 3):
            add(c, False)
    layers.append(_Head(c_prev, num_classes))
    return nn.Sequential(*layers)
