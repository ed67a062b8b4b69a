"""A deferred batch-norm layer's tally of its mini-batch: merged per micro-batch, used once.

Each training call of a :class:`~torchgpipe.batchnorm.DeferredBatchNorm` merges its
input's statistics (:func:`merge`); its j-th calls of every micro-batch apart from its
others. The last micro-batch's j-th call updates the running statistics from the merged
j-th calls (:func:`commit`). A pipeline marks where a micro-batch starts (every call of
a partition in a cell runs inside :func:`enter_cell`), and, once its forwards of the
mini-batch are done, updates from what no call of the last micro-batch took
(:func:`finish`): a layer that runs on the samples routed to it, none of them in the
last micro-batch, or that one micro-batch calls more often than the last.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

if TYPE_CHECKING:  # batchnorm.py imports this module
    from torchgpipe.batchnorm import DeferredBatchNorm

__all__ = ["Moments", "Tally", "commit", "enter_cell", "finish", "leave_cell", "merge"]


# What a layer has merged of its j-th calls: samples per channel, mean, and the sum of
# squared deviations from the mean.
Moments = tuple[Tensor, Tensor, Tensor]


@dataclass
class Tally:
    """Where a deferred layer is in its mini-batch: one attribute, beside a subclass's."""

    chunks: int = 1  # the micro-batches of the mini-batch
    cell: object | None = None  # the enter_cell() token of the latest call
    begun: int = 0  # the micro-batches of the mini-batch begun
    calls: int = 0  # the calls in the current one
    moments: dict[int, Moments] = field(default_factory=dict)  # the j-th calls', by j
    forwards: int = 0  # the deferred forward's runs: a subclass's forward reached it


def merge(layer: DeferredBatchNorm, x: Tensor) -> None:
    """Merge ``x``'s statistics into ``layer``'s tally; update from them if it is time."""
    # Functions, not methods: a converted layer's class may have methods of any name.
    tally = layer._deferred_tally
    cell = getattr(_cells, "token", None)
    if cell is None or cell is not tally.cell:  # a micro-batch begins
        tally.cell = cell
        if tally.begun >= tally.chunks:  # on its own: no expect() between mini-batches
            tally.begun, tally.moments = 0, {}
        tally.begun += 1
        tally.calls = 0
    j = tally.calls
    tally.calls += 1
    moments = _merged(tally.moments.pop(j, None), x)
    if tally.begun == tally.chunks:  # the last micro-batch: the j-th calls are complete
        commit(layer, moments)
    elif moments is not None:
        tally.moments[j] = moments


def commit(layer: _BatchNorm, moments: Moments | None) -> None:
    """Track the mini-batch's statistics as ``BatchNorm`` tracks a batch's.

    What is None is skipped, as ``BatchNorm`` skips it (without ``num_batches_tracked``,
    ``momentum=None`` averages with a factor of 0). An empty mini-batch (no moments)
    counts, and changes no statistics.
    """
    factor = 0.0 if layer.momentum is None else layer.momentum
    with torch.no_grad():
        if layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
            if layer.momentum is None:  # a cumulative average over the mini-batches
                factor = 1.0 / float(layer.num_batches_tracked)
        if moments is None:
            return
        count, mean, m2 = moments
        variance = torch.where(count > 1, m2 / (count - 1), m2 / count)  # no sync
        for running, value in ((layer.running_mean, mean), (layer.running_var, variance)):
            if running is not None:
                # Blended in float64, cast after: a float16 variance over 65504 is inf,
                # its blend with the running value may be finite (BatchNorm's is).
                running.copy_(running.to(torch.float64).lerp(value, factor))


def finish(layers: Iterable[DeferredBatchNorm]) -> None:
    """Once a pipeline's forwards of a mini-batch are done: update from what is left.

    What the last micro-batch's calls took is in the running statistics already; the
    merged j-th calls it did not make update them now, in the order of ``j``.
    """
    for layer in layers:
        tally = layer._deferred_tally
        for j in sorted(tally.moments):
            commit(layer, tally.moments.pop(j))
        tally.begun = max(tally.begun, tally.chunks)  # a call after it begins anew


def _merged(moments: Moments | None, x: Tensor) -> Moments | None:
    """``moments`` with ``x``'s merged in (Chan et al.'s pairwise merge); none if empty."""
    samples = x.size(0) * math.prod(x.shape[2:])
    if samples == 0:
        return moments
    dims = [0, *range(2, x.dim())]
    # In float64 whatever the input: a float32 mean of data around 1e4 is off by 1e-3.
    # Two passes (the mean, then the norm of the deviations) rather than var(): on data
    # around 1e6 spread by 1e-3, var() was off by 8e-8, two passes by 7e-14 (relative),
    # in 0.7x to 1.4x var()'s time, a float64 input copied once (CPU, torch 2.13).
    stats = x.to(torch.float64)
    count = torch.full((), float(samples), dtype=stats.dtype, device=x.device)  # no sync
    mean = stats.mean(dims)
    shape = [1, -1, *[1] * (x.dim() - 2)]
    deviations = stats.sub_(mean.view(shape)) if stats is not x else stats - mean.view(shape)
    m2 = torch.linalg.vector_norm(deviations, 2, dims).square()
    if moments is None:
        return count, mean, m2
    count_before, mean_before, m2_before = moments
    total = count_before + count
    delta = mean - mean_before
    return (
        total,
        mean_before + delta * (count / total),
        m2_before + m2 + delta.square() * (count_before * count / total),
    )


# Per thread: the token of the cell whose partition runs (enter_cell), if any.
_cells = threading.local()


def enter_cell() -> object | None:
    """Before a partition's call in a cell: one micro-batch's calls of deferred layers.

    Returns what :func:`leave_cell` takes (two plain calls: this runs once per cell).
    """
    outer = getattr(_cells, "token", None)
    _cells.token = object()
    return outer


def leave_cell(outer: object | None) -> None:
    """After a partition's call in a cell (it may have raised)."""
    _cells.token = outer
