"""A trace of every cell: what ran where and when, as a table, a Chrome trace or a picture.

Tracing is opt-in and scoped::

    with model.trace() as trace:
        model(x).sum().backward()
    print(trace.summary())                 # busy time per partition and rank, bubble
    trace.save_chrome("trace.json")        # chrome://tracing or ui.perfetto.dev
    trace.draw("timeline.png")             # partitions as rows, micro-batches coloured

While a trace is on, each cell records spans on the thread that runs them:

- ``copy``: the cell's input moved to its partition's device;
- ``forward``: the cell's forward (checkpointed or not);
- ``recompute``: a checkpointed cell's forward, again, in backward;
- ``backward``: the cell's backward (for a checkpointed cell, the backward of the
  recomputed graph; otherwise from the moment its outputs' gradient arrives until its
  input's gradient leaves, or, for an input that needs none, until the last node of
  the micro-batch's own graph has run: see :class:`BackwardSpan`);
- ``weight``: with a schedule that splits the backward (zero bubble), the weight
  gradient, when it runs apart from the input gradient (``backward``).

Off, the pipeline checks one attribute per cell and records nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from torchgpipe.microbatch import flatten, per_tensor, unflatten

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
    """How busy each partition and each rank was while the traced work ran.

    ``busy`` is each partition's time covered by its spans, ``span`` the time from the
    first span's start to the last one's end. ``ranks`` holds the partitions each rank
    ran, told by the thread that ran their forwards (one process: the caller's or a
    worker's; a merged trace: a process's), ``rank_busy`` each rank's time covered by
    the spans of its partitions. ``bubble`` is the fraction of
    ``r * span`` in which the ``r`` ranks sat idle: a rank running another of its
    partitions is busy. ``ideal_bubble`` is ``(r - 1) / (v * m + r - 1)`` for ``v = n /
    r`` partitions per rank: GPipe's ``(n - 1) / (m + n - 1)`` where each partition has
    a rank of its own, interleaved 1F1B's where a rank runs ``v``.
    """

    n: int
    m: int
    span: float
    busy: tuple[float, ...]
    bubble: float
    ideal_bubble: float
    ranks: tuple[tuple[int, ...], ...]
    rank_busy: tuple[float, ...]

    def __str__(self) -> str:
        r = len(self.ranks)
        shared = r < self.n  # some rank runs several partitions
        lines = [
            f"{self.n} partitions{f' on {r} ranks' if shared else ''}, {self.m} "
            f"micro-batches, {self.span * 1e3:.2f} ms traced",
            *(
                f"  partition {j}: busy {b * 1e3:8.2f} ms ({b / self.span:6.1%})"
                for j, b in enumerate(self.busy)
            ),
        ]
        if shared:
            lines += [
                f"  rank {k} (partitions {', '.join(map(str, group))}): busy "
                f"{b * 1e3:8.2f} ms ({b / self.span:6.1%})"
                for k, (group, b) in enumerate(zip(self.ranks, self.rank_busy, strict=True))
            ]
            ideal = f"interleaved 1F1B's ideal for {r} ranks, v = {self.n / r:g}, m = {self.m}"
        else:
            ideal = f"GPipe's ideal for n = {self.n}, m = {self.m}"
        lines.append(f"bubble {self.bubble:.1%} ({ideal}: {self.ideal_bubble:.1%})")
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

    def record(
        self, j: int, i: int, kind: Kind, start: float, end: float, *, thread: str | None = None
    ) -> None:
        """Add a span (called by the pipeline, on the thread that ran it, or naming it)."""
        name = threading.current_thread().name if thread is None else thread
        event = CellEvent(j, i, kind, start, end, name)
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
        """Busy time per partition and per rank, and the bubble fraction of the traced work.

        Meant for a trace of one step: time between traced steps counts as idle, and
        ``m`` is that of the largest traced forward. A rank is told by the thread that
        ran its partitions' forwards (see ``TraceSummary.ranks``).

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
        groups = _ranks(self.events, self.n)
        rank_busy = tuple(
            _covered([(e.start, e.end) for e in self.events if e.j in group]) for group in groups
        )
        r = len(groups)
        bubble = 1 - sum(rank_busy) / (r * span) if span > 0 else 0.0
        m = max(self.m, 1)
        ideal = (r - 1) / (self.n * m / r + r - 1)
        return TraceSummary(self.n, m, span, busy, bubble, ideal, groups, rank_busy)

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


def _ranks(events: list[CellEvent], n: int) -> tuple[tuple[int, ...], ...]:
    """The partitions of each rank, in order of their first partition.

    A rank's worker runs the forwards of all its partitions, so partitions whose first
    forward span was recorded on one thread share a rank: the caller's thread or a
    worker's in one process, ``"rank r: ..."`` in a merged trace. Backward spans tell
    nothing: autograd's engine records them on its own threads where it runs the
    backward. A partition without a forward span is a rank of its own.
    """
    thread: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.start):
        if e.kind == "forward":
            thread.setdefault(e.j, e.thread)
    groups: dict[str | int, list[int]] = {}
    for j in range(n):
        groups.setdefault(thread.get(j, j), []).append(j)
    return tuple(sorted(tuple(group) for group in groups.values()))


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
    """Records the backward of a cell that is not checkpointed, in autograd's engine.

    The cell's floating-point (or complex) outputs that need a gradient are marked, and
    the first gradient to reach one starts the span. Its inputs that need a gradient
    are marked too, and the span ends when the last of them that gets one has passed it
    on. Which will get one is known only when the backward is over (a partition may
    ignore an input), so where some did not, a callback of the engine's at the end of
    the backward records the span, ending at the last that did. The engine interleaves
    the nodes of neighbouring cells: a cell's span starts when the first gradient
    reaches it (through a skip, say), so where gradients arrive or leave at several
    points, the spans of neighbours may overlap. Where no input needs a gradient (the
    first partition's input: token ids, or a batch that needs no gradient) the span
    ends when the last node of the micro-batch's own graph has run: the cell's graph
    ends at its parameters' gradient accumulators, shared by every micro-batch and run
    once per backward, so it is the nodes just before them ("sinks") that tell. The
    accumulation itself is in no cell's span. Nothing is made to need a gradient that
    did not: tracing must not add work to what it measures.

    A backward that runs some sinks only (an output the next partition ignores, or
    ``torch.autograd.grad`` of only some tensors) records the span at its end, ending
    at the last sink that ran; one that reaches no marked input records no span for
    such a cell (a later backward through the same graph may).
    """

    def __init__(self, trace: Trace, j: int, i: int) -> None:
        self._trace, self._j, self._i = trace, j, i
        self._start: float | None = None
        self._done = False
        self._inputs = 0  # the marked inputs: the span ends at them, not at the sinks
        self._left = 0  # how many of them passed a gradient on in this backward
        self._last: tuple[float, str] | None = None  # when and where the last one did
        self._sinks = self._waiting = 0  # the sinks, and those yet to run
        self._task: int | None = None  # the backward (autograd's graph task) it started in
        self._handles: list[RemovableHandle] = []

    def mark_input(self, value: Any) -> Any:
        """``value`` with each float (or complex) tensor needing a gradient marked.

        The last of them to pass a gradient on ends the span. Where no input tensor
        needs a gradient, the cell's graph says where its backward ends
        (:meth:`mark_output`).
        """
        value, self._inputs = _mark_all(value, self._input_left)
        return value

    def mark_output(self, value: Any) -> Any:
        """``value`` with each float (or complex) tensor needing a gradient marked.

        The first of them that a gradient reaches starts the span.
        Where no input was marked, a hook on each sink of the graph from ``value``
        counts the sinks down. The hooks are on the micro-batch's own nodes, not on
        anything the model keeps: they are removed when the span ends or when the
        backward that started it is over, and a forward whose backward never runs takes
        them away with its graph (which holds the span: nothing keeps the trace alive).
        Finding the sinks walks the graph once, a microsecond or so per node, in the
        cell's forward span.
        """
        if not self._inputs:
            sinks = _sinks(value)
            self._sinks = self._waiting = len(sinks)
            self._handles = [node.register_hook(self._sink_ran) for node in sinks]
        return _mark_all(value, self._begin)[0]

    def _begin(self) -> None:
        self._arrived()
        if not self._inputs and self._waiting == 0:  # no node of its own: nothing to run
            self._end()

    def _arrived(self) -> None:
        task = _graph_task()
        if self._start is not None and (self._done or task == self._task):
            return
        # The first gradient here, or the first of a backward run again after one that
        # failed before this span ended (its callback never ran): the span starts now.
        self._start, self._task, self._waiting = time.perf_counter(), task, self._sinks
        self._left, self._last = 0, None
        if self._handles or self._inputs:  # however this backward ends: the hooks go,
            # and an input that got no gradient does not keep the span from being recorded
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_over)

    def _input_left(self) -> None:
        self._arrived()
        self._left += 1
        self._last = (time.perf_counter(), threading.current_thread().name)
        if self._left == self._inputs:
            self._end()

    def _sink_ran(self, grad_inputs: object, grad_outputs: object) -> None:
        self._arrived()  # a gradient through another output may come first
        self._waiting -= 1
        self._last = (time.perf_counter(), threading.current_thread().name)
        if self._waiting == 0:
            self._end()

    def _backward_over(self) -> None:
        if not self._done and self._last is not None:
            # Some input got no gradient, or some sink did not run (an output the next
            # partition ignores, or autograd.grad of some tensors): what ran ends it.
            self._done = True
            end, thread = self._last
            assert self._start is not None  # set by the first gradient here
            self._trace.record(self._j, self._i, "backward", self._start, end, thread=thread)
        if self._inputs:
            return  # none passed one on: a later backward through the graph may
        self._done = True  # ended, or never will
        self._remove_hooks()

    def _end(self) -> None:
        if self._start is not None and not self._done:
            self._done = True
            self._trace.record(self._j, self._i, "backward", self._start, time.perf_counter())
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _sinks(value: Any) -> list[Node]:
    """The nodes of the graph from ``value`` whose gradients go on to no other of them.

    The graph stops at gradient accumulators (of parameters, shared by every
    micro-batch). Every node runs before some sink, so once every sink has run, the
    whole graph has.
    """
    stack = [
        x.grad_fn for x in flatten(value)[0] if isinstance(x, Tensor) and x.grad_fn is not None
    ]
    seen: dict[int, Node] = {}  # by id: the engine's nodes compare by identity
    sinks = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        following = [n for n, _ in node.next_functions if n is not None and not _accumulator(n)]
        stack.extend(following)
        if not following:
            sinks.append(node)
    return sinks


def _accumulator(node: Node) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def _graph_task() -> int | None:
    """The backward running now (an id of autograd's graph task), where torch says."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


def _mark_all(value: Any, callback: Callable[[], None]) -> tuple[Any, int]:
    """``value`` with ``callback`` stamped on each float or complex tensor needing grad.

    A tensor found twice is stamped once (:func:`per_tensor`); returns how many were.
    """
    leaves, spec = flatten(value)
    marked = 0

    def mark(x: Tensor) -> Tensor:
        nonlocal marked
        if x.requires_grad and (x.is_floating_point() or x.is_complex()):
            marked += 1
            return _Stamp.apply(x, callback)  # type: ignore[no-any-return,no-untyped-call]  # apply is unannotated
        return x

    leaves = per_tensor(mark, leaves)
    return (unflatten(leaves, spec), marked) if marked else (value, 0)
