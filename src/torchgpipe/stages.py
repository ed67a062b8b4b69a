"""The description of the stages a step runs, as GPipe and PipelineStage build it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import TypeAlias

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.batchnorm import DeferredBatchNorm, freeze_running_stats
from torchgpipe.skip.layout import SkipRoute
from torchgpipe.skip.skippable import SkipKey, Skippable
from torchgpipe.stream import AnyStream
from torchgpipe.trace import Trace

__all__ = ["Guard", "Stages", "batch_norm_guard", "has_skippables"]


Guard: TypeAlias = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class Stages:
    """The stages a step runs: the modules of the local ones, and every stage's skips.

    In one process every stage is local. With several (:mod:`torchgpipe.distributed`)
    ``partitions`` and ``devices`` hold only the stages of this process.
    """

    partitions: dict[int, nn.Module]
    devices: dict[int, torch.device]
    inbound: list[tuple[SkipRoute, ...]]  # per stage: the skips it pops from earlier ones
    outbound: list[tuple[SkipKey, ...] | None]  # per stage; None: no skippable layers
    routes: tuple[SkipRoute, ...]
    guards: dict[int, Guard | None]
    streams: dict[int, tuple[AnyStream, AnyStream]]  # per local stage: compute, copy
    checkpoint_stop: int  # micro-batches below this are checkpointed
    tracer: Trace | None = None


def batch_norm_guard(partition: nn.Module) -> Guard | None:
    """What keeps a recomputation from updating batch norm's running statistics again."""
    tracking = [
        m
        for m in partition.modules()
        if isinstance(m, _BatchNorm)
        and not isinstance(m, DeferredBatchNorm)  # it never updates in recomputation
        and m.track_running_stats
    ]
    return partial(freeze_running_stats, tracking) if tracking else None


def has_skippables(partition: nn.Module) -> bool:
    """Whether ``partition`` holds a skippable layer (it then runs under a tracker)."""
    return any(isinstance(module, Skippable) for module in partition.modules())
