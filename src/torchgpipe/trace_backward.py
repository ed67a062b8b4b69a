"""Backward spans in autograd's engine: when a cell's backward starts and ends there.

On the path where PyTorch's engine runs ``model(x)``'s backward (a partition on a GPU),
no code of ours runs a cell's backward: the engine runs its nodes, interleaved with its
neighbours'. :class:`BackwardSpan` learns when the cell's part happens from marks put on
its boundary in the forward::

       next partition, or a later one (a skip)     gradients arrive here, one by one
          │                │
     [stamp out]      [stamp out]
          │                │
      ┌───┴────────────────┴───┐          pre-hooked where the stamps feed them: the
      │  the cell's own nodes  │          first to run after the last gradient arrived
      │                        │          starts the span; own: made by the cell's
      └───┬────────────────┬───┘          thread during its forward
          │                │
     [stamp in]       sink (hooked)       the last input to pass a gradient on, or
          │                │              the last sink to run, ends the span
     previous partition   parameters' accumulators, or a node the cell did not make

A span is recorded per backward (per graph task of the engine's), so a graph kept with
``retain_graph=True`` and run twice records two. Nothing is made to need a gradient that
did not: tracing must not add work to what it measures.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from torchgpipe.microbatch import flatten, per_tensor, unflatten

if TYPE_CHECKING:
    from torchgpipe.trace import Trace

__all__ = ["BackwardSpan"]


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


@dataclass
class _Backward:
    """One backward's progress through a cell (``task``: autograd's graph task)."""

    task: int | None
    waiting: int  # the sinks yet to run
    reached: float = 0.0  # when the latest output gradient arrived
    began: float | None = None  # when a node it feeds first ran after that
    left: int = 0  # the marked inputs that passed a gradient on
    last: tuple[float, str, float] | None = None  # the latest input or sink: end, thread, start
    recorded: bool = False

    @property
    def start(self) -> float:
        """When the cell's own work began, once its last output gradient was in."""
        return self.reached if self.began is None else self.began


class BackwardSpan:
    """Records the backward of a cell that is not checkpointed, in autograd's engine.

    The cell's floating-point (or complex) outputs that need a gradient are marked, and
    so are its inputs. The span starts when, after the last output gradient has arrived
    (of those that arrive before it ends), the first of the cell's own nodes fed by an
    output runs (a pre-hook on each). Not at the first gradient: a skip's comes back
    from a later partition long before the main output's, and until that arrives the
    cell's nodes wait (a node runs once all its gradients are in), so the span would
    cover other partitions' work; the few nodes of a skip's own branch that may run
    early are left out rather than that wait put in. Not at the arrival itself: where
    partitions share an engine thread (on one device), the engine may run another
    partition's ready nodes before this cell's.

    The span ends when the last marked input that gets a gradient has passed it on.
    Which will get one is known only when the backward is over (a partition may ignore
    an input), so where some did not, a callback of the engine's at the end of the
    backward records the span, ending at the last that did. Where no input needs a
    gradient (the first partition's input: token ids, or a batch that needs none) the
    span ends when the last of the cell's own nodes has run: the nodes whose gradients
    go on to none of its own ("sinks") are hooked, and counted down.

    The cell's own nodes are those its thread made during its forward: autograd numbers
    nodes per thread in the order they are made, so a node made just before the forward
    (an input's mark, or one made for the purpose) and the outputs' marks just after
    bound their numbers. A node outside the bounds ends the walk: a parameter's
    gradient accumulator (shared by every micro-batch, and not the cell's work), or the
    caller's graph the partition reads (``functional_call`` with parameters computed
    before, ``weight * scale``), whose nodes run once every micro-batch is done. Nodes
    made on another thread during the forward (a nested pipeline's workers) are not
    recognised, and the span ends before them; a node of the caller's made on another
    thread may by chance carry a number within the bounds, and then the span ends late,
    at it. Either way no hook outlives the span's graph or records anything but this
    cell's backward: hooks hold the span weakly and are removed when it goes (with the
    graph), and they count only in a backward in which a gradient reached one of the
    cell's outputs.

    A backward that runs some sinks only (an output the next partition ignores, or
    ``torch.autograd.grad`` of only some tensors) records the span at its end, ending
    at the last sink that ran; one that reaches no marked input or sink records no span.
    The hooks stay while the graph may run again (``retain_graph=True``), and are
    removed after a backward that frees it.
    """

    def __init__(self, trace: Trace, j: int, i: int) -> None:
        self._trace, self._j, self._i = trace, j, i
        self._inputs = 0  # the marked inputs: the span ends at them, not at sinks
        self._first = _UNKNOWN  # a number below those of the cell's own nodes
        self._sinks = 0
        self._handles: list[RemovableHandle] = []  # on the cell's own nodes
        self._now: _Backward | None = None  # the backward running through the cell

    def mark_input(self, value: Any) -> Any:
        """``value`` with each float (or complex) tensor needing a gradient marked.

        The last of them to pass a gradient on ends the span. Where none needs one, a
        node is made to learn the number the cell's own nodes start after (a few
        microseconds, in the cell's forward span).
        """
        value, marked = _mark_all(value, self._input_left)
        self._inputs = len(marked)
        numbers = [_number(x.grad_fn) for x in marked]
        self._first = min(numbers) - 1 if numbers else _number_now()
        return value

    def mark_output(self, value: Any) -> Any:
        """``value`` with each float (or complex) tensor needing a gradient marked.

        The cell's own nodes that the marks feed get a pre-hook (the span's start), and
        where no input was marked, each sink of the cell's own graph from them a hook
        (its end). Finding the sinks walks the cell's graph once, a microsecond or so
        per node, in the cell's forward span.
        """
        value, marked = _mark_all(value, self._output_reached)
        if not marked:
            return value
        last = min(_number(x.grad_fn) for x in marked)  # made after every own node
        fed = _own([edge[0] for x in marked for edge in _next(x)], self._first, last)
        starts = _weak_hook(self._node_starts)
        self._handles = [node.register_prehook(starts) for node in fed]
        if not self._inputs:
            sinks = _own_sinks(fed, self._first, last)
            self._sinks = len(sinks)
            ran = _weak_hook(self._sink_ran)
            self._handles += [node.register_hook(ran) for node in sinks]
        if self._handles:  # however the graph goes, its hooks go with the span
            weakref.finalize(self, _remove, self._handles).atexit = False
        return value

    def _output_reached(self) -> None:
        now, task = time.perf_counter(), _graph_task()
        run = self._now
        if run is None or run.task != task:  # the first gradient here in this backward
            run = self._now = _Backward(task, self._sinks)
            # However this backward ends, an input or sink that got no gradient does not
            # keep the span from being recorded, and the hooks go with a freed graph.
            _engine().queue_callback(partial(self._backward_over, run))
        if run.recorded:
            return  # an output whose gradient reaches neither an input nor a sink
        run.reached, run.began = now, None
        if not self._inputs and run.waiting == 0:  # no node of its own: nothing to run
            self._record(run, now, now, None)

    def _running(self) -> _Backward | None:
        """This backward's run, if a gradient reached an output in it and it goes on."""
        run = self._now
        if run is None or run.recorded or run.task != _graph_task():
            return None  # another backward through a node of the caller's, say
        return run

    def _node_starts(self) -> None:
        run = self._running()
        if run is not None and run.began is None:
            run.began = time.perf_counter()

    def _input_left(self) -> None:
        run = self._running()
        if run is not None:
            run.left += 1
            self._passed(run, run.left == self._inputs)

    def _sink_ran(self) -> None:
        run = self._running()
        if run is not None:
            run.waiting -= 1
            self._passed(run, run.waiting == 0)

    def _passed(self, run: _Backward, last: bool) -> None:
        now = time.perf_counter()
        if last:
            self._record(run, run.start, now, None)
        else:
            run.last = (now, threading.current_thread().name, run.start)

    def _backward_over(self, run: _Backward) -> None:
        if self._now is run:
            self._now = None
        if not run.recorded and run.last is not None:
            # Some input got no gradient, or some sink did not run (an output the next
            # partition ignores, or autograd.grad of some tensors): what ran ends it.
            end, thread, start = run.last
            self._record(run, start, end, thread)
        if self._handles and _keeps_graph() is False:  # the graph cannot run again
            _remove(self._handles)

    def _record(self, run: _Backward, start: float, end: float, thread: str | None) -> None:
        run.recorded = True
        self._trace.record(self._j, self._i, "backward", start, end, thread=thread)


def _weak_hook(method: Callable[[], None]) -> Callable[..., None]:
    """A node hook (or pre-hook) calling ``method`` while its object lives, no longer.

    A hook must not keep the span, and its trace, alive after the cell's graph is gone
    (on a node the caller keeps, say, which the walk took for the cell's by chance).
    """
    ref = weakref.WeakMethod(method)

    def hook(*grads: object) -> None:
        bound = ref()
        if bound is not None:
            bound()

    return hook


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_UNKNOWN = 2**64  # above every node's number: none is taken for the cell's own


def _number(node: Node | None) -> int:
    """The sequence number autograd gave ``node``, counted per thread as nodes are made."""
    return _UNKNOWN if node is None else int(node._sequence_nr())


def _number_now() -> int:
    """The number of a node made now on this thread (a view of a fresh leaf).

    ``_UNKNOWN`` where no graph is recorded (grad mode off): then there is none to walk.
    """
    return _number(torch.empty(0, device="cpu", requires_grad=True).view(0).grad_fn)


def _next(x: Tensor) -> tuple[tuple[Node | None, int], ...]:
    assert x.grad_fn is not None  # a mark's output
    return tuple(x.grad_fn.next_functions)


def _own(nodes: list[Node | None], first: int, last: int) -> list[Node]:
    """``nodes`` numbered strictly between ``first`` and ``last``, each once."""
    own: dict[Node, None] = {}  # ordered; nodes compare by identity (see _own_sinks)
    for node in nodes:
        if node is not None and first < _number(node) < last:
            own[node] = None
    return list(own)


def _own_sinks(fed: list[Node], first: int, last: int) -> list[Node]:
    """The own nodes reached from ``fed`` whose gradients go on to none of the cell's own.

    The cell's own: numbered strictly between ``first`` and ``last`` (see
    :class:`BackwardSpan`). Every own node runs before some sink, so once every sink
    has run, the cell's part of the graph has.
    """
    # The set holds the nodes it has seen, not their ids: the Python object of a C++
    # node lives only while referenced, and a freed one's id is soon another node's
    # (with torch 2.11, a chain's sink was taken for a node seen and left out).
    stack = list(fed)
    seen: set[Node] = set()
    sinks = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        following = _own([n for n, _ in node.next_functions], first, last)
        stack.extend(following)
        if not following:
            sinks.append(node)
    return sinks


def _engine() -> Any:
    return torch.autograd.Variable._execution_engine


def _graph_task() -> int | None:
    """The backward running now (an id of autograd's graph task), where torch says."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


def _keeps_graph() -> bool | None:
    """Whether the backward running now keeps its graph (None: torch does not say)."""
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return None if keeps is None else bool(keeps())


def _mark_all(value: Any, callback: Callable[[], None]) -> tuple[Any, list[Tensor]]:
    """``value`` with ``callback`` stamped on each float or complex tensor needing grad.

    A tensor found twice is stamped once (:func:`per_tensor`); returns the stamped ones.
    """
    leaves, spec = flatten(value)
    marked: list[Tensor] = []

    def mark(x: Tensor) -> Tensor:
        if x.requires_grad and (x.is_floating_point() or x.is_complex()):
            marked.append(_Stamp.apply(x, callback))  # type: ignore[no-untyped-call]  # apply is unannotated
            return marked[-1]
        return x

    leaves = per_tensor(mark, leaves)
    return (unflatten(leaves, spec), marked) if marked else (value, [])
