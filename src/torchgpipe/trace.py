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
- ``backward``: the cell's backward, one span per backward through it (for a
  checkpointed cell, the backward of the recomputed graph; otherwise from the moment
  the last of its outputs' gradients arrives until its inputs' gradients have left,
  or, for an input that needs none, until the last node of the cell's own graph has
  run: see :class:`~torchgpipe.trace_backward.BackwardSpan`);
- ``weight``: with a schedule that splits the backward (zero bubble), the weight
  gradient, when it runs apart from the input gradient (``backward``).

Off, the pipeline checks one attribute per cell and records nothing. A trace pickles
(``copy.deepcopy``, ``torch.save``) with its events.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch.profiler import record_function

# BackwardSpan lives apart for its size; cells import it from here (not public).
from torchgpipe.trace_backward import BackwardSpan as BackwardSpan

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
    partitions is busy. ``ideal_bubble`` is ``(R - 1) / (v * m + R - 1)`` for ``v``
    partitions per rank and ``R = n / v`` ranks: GPipe's ``(n - 1) / (m + n - 1)``
    where each partition has a rank of its own, interleaved 1F1B's where a rank runs
    ``v``.

    A partition with no span ran elsewhere (one process's own trace of a run across
    processes), or not at all (a failed run): it is in no rank, its ``busy`` is 0, and
    the ranks not traced are taken to hold ``v`` partitions each, as those traced do.
    Times are the host's: on a GPU, when its partition's thread issued the work.
    """

    n: int
    m: int
    span: float
    busy: tuple[float, ...]
    bubble: float
    ideal_bubble: float
    ranks: tuple[tuple[int, ...], ...]
    rank_busy: tuple[float, ...]

    @property
    def per_rank(self) -> int:
        """Partitions per rank: the most a traced rank ran.

        A rank that failed may have left some out; the ranks not traced here hold as many.
        """
        return max((len(group) for group in self.ranks), default=1)

    def __str__(self) -> str:
        traced = sorted(j for group in self.ranks for j in group)
        r, v = len(self.ranks), self.per_rank
        shared = v > 1  # a rank runs several partitions
        elsewhere = [j for j in range(self.n) if j not in traced]

        def share(busy: float) -> str:
            return f"{busy / self.span if self.span > 0 else 0.0:6.1%}"

        lines = [
            f"{self.n} partitions{f' on {self.n / v:g} ranks' if shared else ''}, {self.m} "
            f"micro-batches, {self.span * 1e3:.2f} ms traced",
            *(
                f"  partition {j}: busy {self.busy[j] * 1e3:8.2f} ms ({share(self.busy[j])})"
                for j in traced
            ),
        ]
        if elsewhere:
            names = f"partition{'s' if len(elsewhere) > 1 else ''} {', '.join(map(str, elsewhere))}"
            lines.append(
                f"  {names}: not in this trace (another process's, which gather_trace "
                f"joins in; or not run, where the traced work failed before them)"
            )
        if shared:
            # A partial trace does not know the pipeline's numbers of its ranks.
            labels = [
                f"the rank of partitions {', '.join(map(str, group))}"
                if elsewhere
                else f"rank {k} (partitions {', '.join(map(str, group))})"
                for k, group in enumerate(self.ranks)
            ]
            lines += [
                f"  {label}: busy {b * 1e3:8.2f} ms ({share(b)})"
                for label, b in zip(labels, self.rank_busy, strict=True)
            ]
            ideal = f"interleaved 1F1B's ideal for {self.n / v:g} ranks, v = {v:g}, m = {self.m}"
        else:
            ideal = f"GPipe's ideal for n = {self.n}, m = {self.m}"
        ranks = "the rank traced" if r == 1 else f"the {r} ranks traced"
        bubble = f"bubble {self.bubble:.1%}{f' of {ranks}' if elsewhere else ''}"
        lines.append(f"{bubble} ({ideal}: {self.ideal_bubble:.1%})")
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

    def __post_init__(self) -> None:
        # Not a field: dataclasses.asdict() and astuple() copy every field, and a lock
        # cannot be copied.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # A lock cannot be pickled, and a copy's events are its own: it gets a new one.
        with self._lock:  # a snapshot of the events, should a cell still record
            state = self.__dict__.copy()
            state["events"] = list(self.events)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
        groups = _ranks(self.events)
        rank_busy = tuple(
            _covered([(e.start, e.end) for e in self.events if e.j in group]) for group in groups
        )
        r = len(groups)
        bubble = 1 - sum(rank_busy) / (r * span) if span > 0 else 0.0
        m = max(self.m, 1)
        summary = TraceSummary(self.n, m, span, busy, bubble, 0.0, groups, rank_busy)
        v = summary.per_rank
        ranks = self.n / v
        return replace(summary, ideal_bubble=(ranks - 1) / (v * m + ranks - 1))

    def chrome(self) -> dict[str, Any]:
        """The events in Chrome's trace format (microseconds; one row per partition).

        A row shows spans nested or apart, never overlapping in part, which Perfetto
        cannot draw (backward spans of neighbouring micro-batches may, in autograd's
        engine): where one starts inside an earlier one and ends after it, the earlier
        is cut short at its start, with its recorded duration in ``args["recorded_dur"]``.
        ``events`` keep the recorded times. Events are under process id 1: Perfetto
        takes 0 for the kernel's idle process.
        """
        begin = min((e.start for e in self.events), default=0.0)
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": _PID, "args": {"name": "torchgpipe"}},
            *(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": _PID,
                    "tid": j,
                    "args": {"name": f"partition {j}"},
                }
                for j in range(self.n)
            ),
        ]
        for e, end in _nested(self.events):
            args: dict[str, Any] = {"micro_batch": e.i, "partition": e.j, "thread": e.thread}
            if end != e.end:
                args["recorded_dur"] = e.duration * 1e6
            events.append(
                {
                    "name": f"{e.kind[0].upper()}{e.i}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": _PID,
                    "tid": e.j,
                    "ts": (e.start - begin) * 1e6,
                    # The end's own, less the start's: cut short at the next span's start,
                    # it ends at that start exactly, not an ulp past it.
                    "dur": (end - begin) * 1e6 - (e.start - begin) * 1e6,
                    "args": args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome(self, path: str | Path) -> None:
        """Write :meth:`chrome` as JSON, for chrome://tracing or ui.perfetto.dev."""
        Path(path).write_text(json.dumps(self.chrome()))

    def draw(self, path: str | Path, *, title: str | None = None) -> None:
        """Draw the timeline to an image file: partitions as rows, micro-batches coloured.

        Forward spans are solid, recomputation hatched, backward lighter, copies thin.

        ``path`` without a suffix gets ``.png``, as matplotlib names it.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
            ValueError: nothing was recorded, or ``path`` is a folder.
        """
        from torchgpipe._timeline import draw_timeline

        if not self.events:
            raise ValueError("the trace is empty: run the model while the trace is on")
        if Path(path).is_dir():  # matplotlib wrote a file beside it, named <path>.png
            raise ValueError(f"{str(path)!r} is a folder: name a file in it (timeline.png)")
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


_PID = 1  # Chrome's process id for every event: Perfetto takes 0 for the idle process


def _nested(events: list[CellEvent]) -> list[tuple[CellEvent, float]]:
    """The events by start, each with an end that nests it or sets it apart on its row.

    On each row (partition), the spans still open when one starts hold it, the latest
    innermost: those that end before it would end are cut short at its start (they
    and what they hold all end there, still nested), the others hold it whole.
    """
    ends: dict[int, float] = {}
    opened: dict[int, list[int]] = {}  # per row: indices of the open spans, outermost first
    ordered = sorted(enumerate(events), key=lambda ie: (ie[1].start, -ie[1].end))
    for index, e in ordered:
        stack = opened.setdefault(e.j, [])
        while stack and ends[stack[-1]] <= e.start:
            stack.pop()  # over before this one starts
        while stack and ends[stack[-1]] < e.end:  # overlaps it in part: cut short
            ends[stack.pop()] = e.start
        ends[index] = e.end
        stack.append(index)
    return [(e, ends[index]) for index, e in ordered]


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The total length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _ranks(events: list[CellEvent]) -> tuple[tuple[int, ...], ...]:
    """The partitions of each rank, in order of their first partition.

    A rank's worker runs the forwards of all its partitions, so partitions whose first
    forward span was recorded on one thread share a rank: the caller's thread or a
    worker's in one process, ``"rank r: ..."`` in a merged trace. Backward spans tell
    nothing: autograd's engine records them on its own threads where it runs the
    backward. A partition with spans but no forward span is a rank of its own; one
    without any span ran elsewhere, and is in no rank.
    """
    thread: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.start):
        if e.kind == "forward":
            thread.setdefault(e.j, e.thread)
    groups: dict[str | int, list[int]] = {}
    for j in sorted({e.j for e in events}):
        groups.setdefault(thread.get(j, j), []).append(j)
    return tuple(sorted(tuple(group) for group in groups.values()))
