"""A trace of every cell: what ran where and when, as a table, a Chrome trace or a picture.

Tracing is opt-in and scoped::

    with model.trace() as trace:
        model(x).sum().backward()
    print(trace.summary())                 # busy time per partition, bubble fraction
    trace.save_chrome("trace.json")        # chrome://tracing or ui.perfetto.dev
    trace.draw("timeline.png")             # partitions as rows, micro-batches coloured

While a trace is on, each cell records spans on the thread that runs them:

- ``copy``: the cell's input moved to its partition's device;
- ``forward``: the cell's forward (checkpointed or not);
- ``recompute``: a checkpointed cell's forward, again, in backward;
- ``backward``: the cell's backward (for a checkpointed cell, the backward of the
  recomputed graph; otherwise from the moment its outputs' gradient arrives until its
  input's gradient leaves);
- ``weight``: with a schedule that splits the backward (zero bubble), the weight
  gradient, when it runs apart from the input gradient (``backward``).

Off, the pipeline checks one attribute per cell and records nothing.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.profiler import record_function

from torchgpipe.microbatch import flatten, unflatten

__all__ = ["CellEvent", "Trace", "TraceSummary"]

Kind = Literal["copy", "forward", "recompute", "backward", "weight"]


@dataclass(frozen=True)
class CellEvent:
    """One span of one cell: micro-batch ``i`` on partition ``j``.

    ``start`` and ``end`` are ``time.perf_counter()`` seconds.
    """

    j: int
    i: int
    kind: Kind
    start: float
    end: float
    thread: str

    @property
    def duration(self) -> float:
        """``end - start``, in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class TraceSummary:
    """How busy each partition was while the traced work ran.

    ``busy`` is each partition's time covered by its spans, ``span`` the time from the
    first span's start to the last one's end, and ``bubble`` the fraction of
    ``n * span`` in which partitions sat idle. ``ideal_bubble`` is GPipe's
    ``(n - 1) / (m + n - 1)`` for the same ``n`` and ``m``.
    """

    n: int
    m: int
    span: float
    busy: tuple[float, ...]
    bubble: float
    ideal_bubble: float

    def __str__(self) -> str:
        lines = [
            f"{self.n} partitions, {self.m} micro-batches, {self.span * 1e3:.2f} ms traced",
            *(
                f"  partition {j}: busy {b * 1e3:8.2f} ms ({b / self.span:6.1%})"
                for j, b in enumerate(self.busy)
            ),
            f"bubble {self.bubble:.1%} (GPipe's ideal for n = {self.n}, m = {self.m}: "
            f"{self.ideal_bubble:.1%})",
        ]
        return "\n".join(lines)


@dataclass
class Trace:
    """The cell events recorded while a trace was on.

    Args:
        n: the number of partitions of the traced pipeline.
    """

    n: int
    events: list[CellEvent] = field(default_factory=list)
    m: int = 0  # the most micro-batches of a traced forward
    # time.time() - time.perf_counter() when the trace began: the events' times plus
    # this are on the wall clock, which processes share (see ``on_wall_clock``).
    origin: float = field(default_factory=lambda: time.time() - time.perf_counter())
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on_wall_clock(self) -> list[tuple[int, int, str, float, float, str]]:
        """The events as plain tuples, their times on the wall clock.

        What crosses processes, to be merged into one trace there (:meth:`merge`).
        """
        origin = self.origin
        return [(e.j, e.i, e.kind, e.start + origin, e.end + origin, e.thread) for e in self.events]

    def merge(self, events: list[tuple[int, int, str, float, float, str]], label: str) -> None:
        """Add another process's events (from its ``on_wall_clock``), on this clock.

        ``label`` prefixes their thread names (``"rank 1"``), to tell processes apart.
        """
        with self._lock:
            for j, i, kind, start, end, thread in events:
                start, end = start - self.origin, end - self.origin
                self.events.append(CellEvent(j, i, kind, start, end, f"{label}: {thread}"))  # type: ignore[arg-type]

    def record(self, j: int, i: int, kind: Kind, start: float, end: float) -> None:
        """Add a span (called by the pipeline, on the thread that ran it)."""
        event = CellEvent(j, i, kind, start, end, threading.current_thread().name)
        with self._lock:
            self.events.append(event)

    @contextmanager
    def span(self, j: int, i: int, kind: Kind) -> Iterator[None]:
        """Record the time the block takes as a span of cell (i, j)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(j, i, kind, start, time.perf_counter())

    def summary(self) -> TraceSummary:
        """Busy time per partition and the bubble fraction of the traced work.

        Meant for a trace of one step: time between traced steps counts as idle, and
        ``m`` is that of the largest traced forward.

        Raises:
            ValueError: nothing was recorded.
        """
        if not self.events:
            raise ValueError("the trace is empty: run the model while the trace is on")
        begin = min(e.start for e in self.events)
        span = max(e.end for e in self.events) - begin
        busy = tuple(
            _covered([(e.start, e.end) for e in self.events if e.j == j]) for j in range(self.n)
        )
        bubble = 1 - sum(busy) / (self.n * span) if span > 0 else 0.0
        m = max(self.m, 1)
        return TraceSummary(self.n, m, span, busy, bubble, (self.n - 1) / (m + self.n - 1))

    def chrome(self) -> dict[str, Any]:
        """The events in Chrome's trace format (microseconds; one row per partition)."""
        begin = min((e.start for e in self.events), default=0.0)
        events: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": 0,
                "args": {"name": "torchgpipe"},
            },
            *(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": j,
                    "args": {"name": f"partition {j}"},
                }
                for j in range(self.n)
            ),
        ]
        for e in sorted(self.events, key=lambda e: e.start):
            events.append(
                {
                    "name": f"{e.kind[0].upper()}{e.i}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.j,
                    "ts": (e.start - begin) * 1e6,
                    "dur": e.duration * 1e6,
                    "args": {"micro_batch": e.i, "partition": e.j, "thread": e.thread},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome(self, path: str | Path) -> None:
        """Write :meth:`chrome` as JSON, for chrome://tracing or ui.perfetto.dev."""
        Path(path).write_text(json.dumps(self.chrome()))

    def draw(self, path: str | Path, *, title: str | None = None) -> None:
        """Draw the timeline to an image file: partitions as rows, micro-batches coloured.

        Forward spans are solid, recomputation hatched, backward lighter, copies thin.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
            ValueError: nothing was recorded.
        """
        from torchgpipe._timeline import draw_timeline

        if not self.events:
            raise ValueError("the trace is empty: run the model while the trace is on")
        draw_timeline(self, Path(path), title=title)


def profiled(name: object) -> AbstractContextManager[Any]:
    """A ``torch.profiler.record_function`` span named ``str(name)``, when profiling.

    Actions show in ``torch.profiler`` traces by their names, as torch's own pipelining
    names them. Without a profiler running, nothing (not even the name is formatted): a
    ``record_function`` costs a few microseconds even then, and the check a tenth of one.
    """
    if _profiling():
        return record_function(str(name))
    return _NOTHING


_NOTHING = nullcontext()


def _profiling() -> bool:
    # The profiler's Python-side flag, which every thread sees: torch's own per-thread
    # check is still false on a worker thread until an operator has run there.
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The total length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class _Stamp(torch.autograd.Function):
    """Identity whose backward calls ``stamp()``: marks when a gradient passes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, stamp: Callable[[], None]) -> Tensor:
        ctx.stamp = stamp
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.stamp()
        return grad, None


class BackwardSpan:
    """Records the backward of a cell that is not checkpointed.

    The cell's first floating-point output is marked so that the arrival of its
    gradient starts the span. The span ends when the gradient leaves through the cell's
    first floating-point input, if that input needs one; otherwise (the first
    partition's input, token ids) when the last of the partition's parameters has
    received its gradient for this micro-batch. Nothing is made to need a gradient that
    did not: tracing must not add work to what it measures.
    """

    def __init__(self, trace: Trace, j: int, i: int) -> None:
        self._trace, self._j, self._i = trace, j, i
        self._start: float | None = None
        self._done = False
        self._waiting = 0
        self._handles: list[Any] = []

    def mark_input(self, value: Any, parameters: list[Tensor]) -> Any:
        """``value`` with its first float tensor marked as the end of the span.

        Without such a tensor, hooks on the parameters end the span. They hold the span
        weakly, and are removed when it ends or when it is collected: the graph holds
        the span, so a forward whose backward never runs leaves no hook behind, and
        nothing that keeps the trace alive.
        """
        value, marked = _mark_first(value, self._end)
        if not marked:
            watched = [p for p in parameters if p.requires_grad]
            self._waiting = len(watched)
            hook = partial(_on_accumulated, weakref.ref(self))
            self._handles = [p.register_post_accumulate_grad_hook(hook) for p in watched]
            weakref.finalize(self, _remove, list(self._handles))
        return value

    def mark_output(self, value: Any) -> Any:
        """``value`` with its first float tensor marked as the start of the span."""
        return _mark_first(value, self._begin)[0]

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _accumulated(self, parameter: Tensor) -> None:
        if self._start is None:  # another micro-batch's gradient, before this one's
            return
        self._waiting -= 1
        if self._waiting == 0:
            self._end()

    def _end(self) -> None:
        if self._start is not None and not self._done:
            self._done = True
            self._trace.record(self._j, self._i, "backward", self._start, time.perf_counter())
            for handle in self._handles:
                handle.remove()
            self._handles = []


def _on_accumulated(span: weakref.ReferenceType[BackwardSpan], parameter: Tensor) -> None:
    alive = span()
    if alive is not None:
        alive._accumulated(parameter)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _mark_first(value: Any, callback: Callable[[], None]) -> tuple[Any, bool]:
    """``value`` with ``callback`` stamped on its first float tensor that needs a grad."""
    leaves, spec = flatten(value)
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            leaves[index] = _Stamp.apply(leaf, callback)  # type: ignore[no-untyped-call]  # apply is unannotated
            return unflatten(leaves, spec), True
    return value, False
