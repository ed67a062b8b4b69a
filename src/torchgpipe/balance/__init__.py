"""Automatic balancing: how many layers each partition should hold.

Profile every layer (by time or by memory), then split the layers into consecutive
partitions so that the costliest partition costs as little as possible; the split is
exact (see ``blockpartition.py``). Example::

    from torchgpipe import GPipe
    from torchgpipe.balance import balance_by_time

    sample = torch.randn(32, 3, 224, 224)
    balance = balance_by_time(4, model, sample)
    model = GPipe(model, balance, chunks=8)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe.arguments import check_chunks, check_layers
from torchgpipe.balance.blockpartition import check_partitions, solve
from torchgpipe.balance.profile import layerwise_size, layerwise_time
from torchgpipe.devices import as_device
from torchgpipe.materialize import on_meta
from torchgpipe.microbatch import flatten
from torchgpipe.skip.layout import verify_skippables

__all__ = ["balance_by_size", "balance_by_time"]

Device = torch.device | str | int


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: Device | None = None,
) -> list[int]:
    """A balance that minimizes the time of the slowest partition.

    Each layer's forward and backward on ``sample`` (a mini-batch, or a micro-batch as
    the pipeline will see it) are timed on ``device``, in passes over all layers
    repeated until ``timeout`` seconds have gone by; the layers are then split so that
    the slowest partition is as fast as possible.

    Args:
        partitions: the number of partitions.
        module: the model; it is left as it was (profiled on copies of its layers).
        sample: an input of the model (a tensor, or any nesting of tuples, lists and
            dicts of tensors).
        timeout: seconds to spend timing (at least one pass is made).
        device: where to time the layers. Default: the current CUDA device, or the
            CPU without CUDA.

    Returns:
        The number of layers of each partition, positive and summing to ``len(module)``.

    Raises:
        TypeError: ``partitions`` is not an integer, ``module`` is not an
            ``nn.Sequential`` (or has a ``forward`` of its own), or its skips do not match.
        ValueError: ``partitions`` not positive or more than the layers, a
            ``timeout`` that is not a finite positive number, a model or ``sample`` on
            the meta device, a layer listed twice, a ``device`` that is not available
            or is ``'meta'``, or a ``sample`` that the pipeline would refuse (an empty
            batch).
    """
    partitions = _check(partitions, module, sample)
    if not _real(timeout) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a finite positive number of seconds, got {timeout!r}")
    times = layerwise_time(module, sample, timeout=timeout, device=_device(device))
    return solve(times, partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Any,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = None,
) -> list[int]:
    """A balance that minimizes the memory of the fullest partition.

    A layer's memory is the activations it keeps for one micro-batch of ``input`` (its
    output and what it saves for backward) plus its parameters times ``param_scale``:
    a parameter that needs grad comes with its gradient, and optimizers keep state of
    their own (2 for plain SGD, 3 for SGD with momentum, 4 for Adam's two moments, and
    so on); frozen parameters count once.

    Args:
        partitions: the number of partitions.
        module: the model; it is left as it was (profiled on copies of its layers).
        input: a mini-batch; its first micro-batch is profiled.
        chunks: the micro-batches the pipeline will cut ``input`` into.
        param_scale: how many times its own size each parameter costs.
        device: where to run the layers. Default: the current CUDA device, or the CPU
            without CUDA.

    Returns:
        The number of layers of each partition, positive and summing to ``len(module)``.

    Raises:
        TypeError: ``partitions`` is not an integer, ``chunks`` is not one (a float
            with no fraction, ``4.0``, counts as one, as in :class:`~torchgpipe.GPipe`),
            ``module`` is not an ``nn.Sequential`` (or has a ``forward`` of its own),
            or its skips do not match.
        ValueError: ``partitions`` not positive or more than the layers, ``chunks``
            not positive, a ``param_scale`` that is not a finite non-negative number,
            a model or ``input`` on the meta device, a layer listed twice, or a
            ``device`` that is not available or is ``'meta'``.
    """
    partitions = _check(partitions, module, input)
    chunks = check_chunks(chunks)  # as GPipe checks it
    if not _real(param_scale) or not 0 <= param_scale < math.inf:
        raise ValueError(f"param_scale must be a finite non-negative number, got {param_scale!r}")
    sizes = layerwise_size(
        module, input, chunks=chunks, param_scale=param_scale, device=_device(device)
    )
    return solve(sizes, partitions)


def _check(partitions: int, module: nn.Sequential, sample: Any) -> int:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing takes an nn.Sequential, got {type(module).__name__}")
    if on_meta(module):
        raise ValueError(
            "balancing runs the layers, and this model is on the meta device, where "
            "nothing runs; give the balance by hand (for split, the split points by "
            "name: at=[...]), or balance a copy of the model built with values (a "
            "smaller one of the same layers, for a model too large for one process)"
        )
    if any(isinstance(x, Tensor) and x.is_meta for x in flatten(sample)[0]):
        raise ValueError(
            "balancing times and measures the layers on the sample, which is on the meta "
            "device, where nothing runs: give a sample with values (of the same shapes)"
        )
    partitions = check_partitions(len(module), partitions)  # before the slow profiling
    check_layers(module)  # what GPipe would refuse (a forward of its own): no use to balance
    verify_skippables(module)
    return partitions


def _device(device: Device | None) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return as_device(device)  # checked as GPipe checks its devices: 'meta' is refused


def _real(x: object) -> bool:
    """Whether ``x`` is a real number (an int, a float, a NumPy scalar; not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
