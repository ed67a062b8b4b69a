"""CUDA streams, and their stand-in on CPU where every stream call does nothing.

Each partition on a CUDA device computes on a stream of its own (so two partitions on
one GPU can overlap) and copies its inputs in on a second stream (so copying overlaps
compute). On CPU there are no streams: :data:`CPU_STREAM` stands in and every function
here is a no-op for it, so the CPU path never touches CUDA state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Final

import torch
from torch import Tensor

__all__ = [
    "CPU_STREAM",
    "AnyStream",
    "current_stream",
    "new_stream",
    "record_stream",
    "use_device",
    "use_stream",
    "wait_stream",
]


class CPUStreamType:
    """The stream of a CPU device: a placeholder, since CPU work is synchronous."""

    def __repr__(self) -> str:
        return "CPU_STREAM"


CPU_STREAM: Final = CPUStreamType()

AnyStream = torch.cuda.Stream | CPUStreamType


def new_stream(device: torch.device) -> AnyStream:
    """A new stream on ``device``, or :data:`CPU_STREAM` for a CPU device."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AnyStream:
    """The stream the calling thread uses on ``device``."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device within the block (no-op on CPU)."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        yield


@contextmanager
def use_stream(stream: AnyStream) -> Iterator[None]:
    """Make ``stream`` the current stream within the block (no-op on CPU)."""
    if isinstance(stream, CPUStreamType):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(waiter: AnyStream, source: AnyStream) -> None:
    """Make work queued later on ``waiter`` wait for the work queued so far on ``source``."""
    if isinstance(waiter, CPUStreamType) or isinstance(source, CPUStreamType):
        return
    waiter.wait_stream(source)


def record_stream(tensor: Tensor, stream: AnyStream) -> None:
    """Tell the caching allocator that ``stream`` uses ``tensor``.

    Its memory is then not reused before the work queued on ``stream`` so far finishes.
    """
    if isinstance(stream, CPUStreamType) or tensor.device.type != "cuda":
        return
    tensor.record_stream(stream)
