"""Copies of a micro-batch from one device to another that respect CUDA streams.

A copy is a plain differentiable ``Tensor.to``, issued on the receiving partition's copy
stream: autograd runs its backward (the copy of the gradient) on that same stream and
synchronizes with the streams around it. Forward needs two things by hand: the copy
stream waits for the producer's stream before reading, and both ends are recorded on the
streams that use them, so neither is freed early.

A tensor already on the receiving device is not copied, but it still changes streams:
the caching allocator gives a freed block back to the stream that allocated it, at
once, so the producer could reuse the memory while the receiver's kernels still wait
to read it. Recording the tensor on the receiving stream holds the block until they
have run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchgpipe.microbatch import flatten, map_tensors
from torchgpipe.stream import (
    CPU_STREAM,
    AnyStream,
    CPUStreamType,
    record_stream,
    use_stream,
    wait_stream,
)

__all__ = ["move"]


def move(
    value: Any,
    device: torch.device,
    *,
    source: AnyStream | Mapping[torch.device, AnyStream],
    copy: AnyStream,
    target: AnyStream,
) -> Any:
    """Move every tensor leaf of ``value`` to ``device``.

    ``source`` is the stream that produced the tensors, or, for the caller's tensors,
    which may come from several devices, each CUDA device's stream; ``copy`` the stream
    that copies them and ``target`` the stream that will use the copies. Tensors already
    on ``device`` are returned as they are, recorded on ``target`` (CUDA only).
    """
    if isinstance(copy, CPUStreamType):
        if isinstance(value, Tensor) and value.device == device:
            return value  # the common case, on the path of every cell

        def to_cpu(x: Tensor) -> Tensor:  # a blocking copy, issued where x was produced
            if x.device == device:
                return x
            with use_stream(_stream_of(source, x.device)):
                return x.to(device)

        return map_tensors(to_cpu, value)

    if isinstance(source, Mapping):  # the caller's: its stream on ``device`` was waited
        for other in {x.device for x in flatten(value)[0] if isinstance(x, Tensor)} - {device}:
            wait_stream(copy, source.get(other))  # for when the run started
    else:
        wait_stream(copy, source)

    def one(x: Tensor) -> Tensor:
        if x.device == device:
            record_stream(x, target)
            return x
        with use_stream(copy):
            y = x.to(device, non_blocking=True)
        record_stream(x, copy)
        record_stream(y, target)
        return y

    moved = map_tensors(one, value)
    wait_stream(target, copy)
    return moved


def _stream_of(
    source: AnyStream | Mapping[torch.device, AnyStream], device: torch.device
) -> AnyStream:
    if isinstance(source, Mapping):
        return source.get(device, CPU_STREAM)
    return source
