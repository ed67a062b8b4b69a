"""The description of the stages a step runs, as GPipe and PipelineStage build it."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchgpipe.guards import RecomputeGuard
from torchgpipe.skip.layout import SkipRoute
from torchgpipe.skip.skippable import SkipKey, Skippable
from torchgpipe.stream import AnyStream
from torchgpipe.trace import Trace

if TYPE_CHECKING:
    from torchgpipe.schedules import Schedule
    from torchgpipe.steps import StepResult, TableSteps

__all__ = ["Layout", "StageHolder", "Stages", "has_skippables", "trainable_params"]

_TRACING = threading.Lock()  # StageHolder.traced's check and set


def trainable_params(partitions: Iterable[nn.Module]) -> list[Tensor]:
    """The parameters of ``partitions`` that want a gradient, each once, in model order.

    Leaves only: a tensor computed from others (``torch.func.functional_call``'s) takes
    its gradient back the way the stages' inputs do, not through ``.grad``.
    """
    found: dict[int, Tensor] = {}
    for partition in partitions:
        for module in partition.modules():  # twice as fast as parameters(), once per forward
            for p in module._parameters.values():
                if p is not None and p.requires_grad and p.is_leaf:
                    found.setdefault(id(p), p)
    return list(found.values())


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
    guards: dict[int, RecomputeGuard]  # per local stage (guards.py)
    streams: dict[int, tuple[AnyStream, AnyStream]]  # per local stage: compute, copy
    checkpoint_stop: int  # micro-batches below this are checkpointed (where any wants a grad)
    tracer: Trace | None = None
    # Per placement of a table: its Layout, made at its first run (a GPipe keeps its
    # Stages from call to call, and what runs before the first cell is on the critical
    # path, run cold).
    layouts: dict[tuple[int, ...], Layout] = field(default_factory=dict, compare=False, repr=False)

    def layout(self, placement: tuple[int, ...]) -> Layout:
        """Where each rank of a table with ``placement`` runs: devices and streams."""
        made = self.layouts.get(placement)
        if made is None:
            made = self.layouts[placement] = Layout.of(self, placement)
        return made


@dataclass(frozen=True)
class Layout:
    """Each rank's device and streams, for the stages a table puts on it.

    A rank runs its stages on one device (the schedules check it), and on the streams
    of the first of them.
    """

    devices: dict[int, torch.device]  # per rank
    compute: dict[int, AnyStream]
    copy: dict[int, AnyStream]
    cpu: bool  # every local stage on the CPU
    popped_by: dict[SkipKey, int]  # per skip, the stage that pops it

    @classmethod
    def of(cls, stages: Stages, placement: tuple[int, ...]) -> Layout:
        """The layout of ``stages`` when stage ``s`` runs on rank ``placement[s]``."""
        devices = {placement[s]: d for s, d in stages.devices.items()}
        first = {r: min(s for s in stages.devices if placement[s] == r) for r in devices}
        return cls(
            devices=devices,
            compute={r: stages.streams[s][0] for r, s in first.items()},
            copy={r: stages.streams[s][1] for r, s in first.items()},
            cpu=all(device.type == "cpu" for device in stages.devices.values()),
            popped_by={route.key: route.pop_partition for route in stages.routes},
        )


class StageHolder:
    """What holds the stages a schedule steps: a GPipe, or a PipelineStage.

    :class:`~torchgpipe.GPipe` holds every stage, in one process;
    :class:`~torchgpipe.distributed.PipelineStage` those of one process of several. The
    schedule classes (:mod:`torchgpipe.training`) are written once, against this:
    how many ranks a table may have, which tables fit, and how a step runs.
    """

    chunks: int
    balance: list[int]
    _tracer: Trace | None  # while a trace is on (``traced``)

    @contextmanager
    def traced(self) -> Iterator[Trace]:
        """A new trace of every stage, on while the block runs (``trace()``'s body)."""
        with _TRACING:  # checked and set at once: two threads cannot both start one
            if self._tracer is not None:
                raise RuntimeError(
                    f"this {type(self).__name__} is traced already; end that trace first"
                )
            trace = self._tracer = Trace(len(self.balance))
        try:
            yield trace
        finally:
            self._tracer = None

    def schedule_ranks(self, virtual_stages: int, schedule: str) -> int:
        """The ranks of a table that gives each rank ``virtual_stages`` stages.

        Raises:
            ValueError: these stages cannot be run that way (``schedule`` names the
                schedule class in the message, which says what to do instead).
        """
        raise NotImplementedError

    def default_virtual_stages(self) -> int:
        """The stages per rank of an interleaved schedule built without saying."""
        raise NotImplementedError

    def check_table(self, table: Schedule) -> None:
        """Refuse a table whose placement of stages on ranks these stages cannot follow.

        Raises:
            ValueError: saying which stages go where they cannot.
        """
        raise NotImplementedError

    def run_step(self, steps: TableSteps, input: Any, target: Any) -> StepResult:
        """One step of ``steps``' schedule and loss over these stages."""
        raise NotImplementedError

    def run_forward(self, steps: TableSteps, input: Any) -> Any:
        """The forward of every micro-batch only, without a graph; the output or None."""
        raise NotImplementedError


def has_skippables(partition: nn.Module) -> bool:
    """Whether ``partition`` holds a skippable layer (it then runs under a tracker)."""
    return any(isinstance(module, Skippable) for module in partition.modules())
