"""The description of the stages a step runs, as GPipe and PipelineStage build it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

from torchgpipe.skip.layout import SkipRoute
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.stream import AnyStream
from torchgpipe.trace import Trace

__all__ = ["Guard", "Stages"]


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
