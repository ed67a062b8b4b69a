"""The GPipe schedule, and its run over one worker thread per partition.

The schedule is data: :func:`clock_cycles` yields, tick by tick, the cells ``(i, j)``
(micro-batch ``i`` on partition ``j``) that may run together. With m = 3, n = 3::

    tick k:    0       1       2       3       4
    j = 0    (0,0)   (1,0)   (2,0)
    j = 1            (0,1)   (1,1)   (2,1)
    j = 2                    (0,2)   (1,2)   (2,2)

The run follows it without a barrier per tick. The cells of partition ``j``, in the
order the ticks give them, are the job of worker ``j``; worker ``j`` takes each input
from a queue that worker ``j - 1`` fills. So cell ``(i, j)`` starts once ``(i - 1, j)``
has finished (same worker) and ``(i, j - 1)`` has delivered (the queue), which is the
schedule's order, and a slow cell delays only what depends on it.

Failures flow down the same queues: a cell that raises passes a :class:`_Failure` on
instead of its output, cells that receive one pass it on without running, and every
worker still handles all m items, so no worker waits forever and every thread is joined
before the caller sees the exception.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.batchnorm import DeferredBatchNorm, freeze_running_stats
from torchgpipe.checkpoint import checkpoint
from torchgpipe.copy import move
from torchgpipe.dependency import fork, join
from torchgpipe.microbatch import flatten, map_tensors
from torchgpipe.rng import CellRandomness, cell_seed, draw_seed
from torchgpipe.skip.layout import SkipLayout, SkipRoute
from torchgpipe.skip.skippable import SkipKey, Skippable
from torchgpipe.skip.tracker import run_cell
from torchgpipe.stages import Stages
from torchgpipe.stream import (
    AnyStream,
    CPUStreamType,
    PartitionStreams,
    current_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from torchgpipe.trace import BackwardSpan, Trace, profiled
from torchgpipe.worker import ThreadState, WorkerPool

__all__ = ["Pipeline", "clock_cycles"]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, for each clock tick ``k``, the cells ``(i, j)`` with ``i + j == k``.

    ``m`` is the number of micro-batches and ``n`` the number of partitions.
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(0, k - m + 1), min(k + 1, n))]


@dataclass
class _Failure:
    """Travels down the pipeline in place of an output that could not be computed."""

    error: BaseException | None  # None: skipped after an earlier failure
    i: int
    j: int


_Inbox = queue.SimpleQueue[Any]


class _Outputs:
    """Collects the last partition's outputs; wakes the caller once, when all are in.

    The caller has nothing to do with an output before the last one arrives, and waking
    it per micro-batch would take the GIL from the workers m times per forward.
    """

    def __init__(self, m: int) -> None:
        self.items: list[Any] = []
        self.lost: BaseException | None = None  # a worker that could not report
        self._m = m
        self._done = threading.Event()

    def put(self, item: Any) -> None:
        """Add the next output (only the last partition's worker calls this)."""
        self.items.append(item)
        if len(self.items) == self._m:
            self._done.set()

    def abandon(self, error: BaseException) -> None:
        """A worker failed to report ``error``: wake the caller to raise it."""
        self.lost = error
        self._done.set()

    def wait(self) -> None:
        """Block until all m outputs are in, or a worker could not report."""
        self._done.wait()


@dataclass(frozen=True)
class _Run:
    """What every cell of one forward pass shares."""

    m: int
    checkpoint_stop: int  # micro-batches i < checkpoint_stop are checkpointed
    state: ThreadState
    seed: int  # the cells' random numbers derive from it (rng.py)
    compute: list[AnyStream]
    copy: list[AnyStream]
    source: AnyStream  # where the caller produced the input
    abort: threading.Event
    skips: list[dict[SkipKey, Any]]  # per micro-batch: stashed, waiting for their pop
    trace: Trace | None  # where cells record their spans, while a trace is on


class Pipeline:
    """Runs micro-batches through partitions as GPipe does.

    Args:
        partitions: the partitions, each already on its device.
        devices: the device of each partition.
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        devices: Sequence[torch.device],
        layout: SkipLayout | None = None,
    ) -> None:
        self.partitions = list(partitions)
        self.devices = list(devices)
        # Partitions with skippable layers run under a tracker of their own (skip/),
        # which takes the inbound skips and hands back the outbound ones; None: no skips.
        layout = layout or SkipLayout(())
        self._inbound = [layout.inbound(j) for j in range(len(self.partitions))]
        self._outbound = [
            layout.outbound(j) if has_skippables(p) else None for j, p in enumerate(self.partitions)
        ]
        # Recomputation must not update plain batch norm's running statistics again.
        self._guards = [batch_norm_guard(p) for p in self.partitions]
        self.streams = PartitionStreams(self.devices)  # kept from run to run: see stream.py
        self.tracer: Trace | None = None  # set by GPipe.trace()
        self._pool: WorkerPool | None = None  # started by the first run
        self._lock = threading.Lock()  # one run at a time on the workers

    def __getstate__(self) -> dict[str, Any]:
        # Threads and locks are not copied: a copy starts workers of its own. Nor is a
        # trace in progress: it belongs to the original.
        state = self.__dict__.copy()
        del state["_pool"], state["_lock"]
        state["tracer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._lock = threading.Lock()

    def stages(self, routes: tuple[SkipRoute, ...], checkpoint_stop: int) -> Stages:
        """The description of every partition as a step's stages (``stages.py``)."""
        n = len(self.partitions)
        return Stages(
            partitions=dict(enumerate(self.partitions)),
            devices=dict(enumerate(self.devices)),
            inbound=list(self._inbound),
            outbound=list(self._outbound),
            routes=routes,
            guards=dict(enumerate(self._guards)),
            streams={j: (self.streams.compute(j), self.streams.copy(j)) for j in range(n)},
            checkpoint_stop=checkpoint_stop,
            tracer=self.tracer,
        )

    def _workers(self) -> WorkerPool:
        if self._pool is None or self._pool.pid != os.getpid():
            self._pool = WorkerPool(len(self.partitions))
        return self._pool

    def run(self, batches: list[Any], *, checkpoint_stop: int) -> list[Any]:
        """Run every micro-batch through every partition; return the outputs in order.

        Raises:
            BaseException: the first exception (by micro-batch) that any cell raised,
                with a note naming the partition and micro-batch.
        """
        n, m = len(self.partitions), len(batches)
        run = _Run(
            m=m,
            checkpoint_stop=checkpoint_stop,
            state=ThreadState.capture(),
            seed=draw_seed(),
            compute=[self.streams.compute(j) for j in range(n)],
            copy=[self.streams.copy(j) for j in range(n)],
            source=current_stream(device_of(batches[0])),
            abort=threading.Event(),
            skips=[{} for _ in batches],
            trace=self.tracer,
        )
        if self.tracer is not None:
            self.tracer.m = max(self.tracer.m, m)
        queues: list[_Inbox] = [queue.SimpleQueue() for _ in range(n)]
        for batch in batches:
            queues[0].put(batch)
        outputs = _Outputs(m)

        with self._lock:
            workers = self._workers()
            for j in range(n):
                outbox = queues[j + 1] if j + 1 < n else outputs
                job = partial(self._work, run, j, queues[j], outbox)
                workers.submit(j, job, partial(_lost, run, outputs))
            try:
                outputs.wait()
            except BaseException:  # e.g. KeyboardInterrupt: stop the cells, let them finish
                run.abort.set()
                outputs.wait()
                raise
            if outputs.lost is not None:
                # The pipeline's items may be short: the other workers could wait on
                # them forever. Leave those threads, and start fresh ones next time.
                workers.close()
                self._pool = None
                add_note(outputs.lost, "torchgpipe: a worker failed while reporting a result")
                raise outputs.lost

        failures = [x for x in outputs.items if isinstance(x, _Failure) and x.error is not None]
        if failures:
            first = min(failures, key=lambda f: (f.i, f.j))
            assert first.error is not None
            note = (
                f"torchgpipe: raised in partition {first.j} (device {self.devices[first.j]}) "
                f"on micro-batch {first.i} of {m}"
            )
            add_note(first.error, note)
            raise first.error
        return self._hand_back(run, outputs.items)

    def _hand_back(self, run: _Run, outputs: list[Any]) -> list[Any]:
        """Make the caller's stream wait for the last partition's outputs (CUDA only)."""
        caller = current_stream(self.devices[-1])
        if isinstance(caller, CPUStreamType):
            return outputs
        wait_stream(caller, run.compute[-1])
        for output in outputs:
            for leaf in flatten(output)[0]:
                if isinstance(leaf, Tensor):
                    record_stream(leaf, caller)
        return outputs

    def _work(
        self,
        run: _Run,
        j: int,
        inbox: _Inbox,
        outbox: _Inbox | _Outputs,
    ) -> None:
        """Worker ``j``: run cells (0, j), (1, j), ... as their inputs arrive.

        Puts exactly one item in ``outbox`` per micro-batch, whatever happens.
        """
        done, phony = 0, None
        try:
            with use_device(self.devices[j]), use_stream(run.compute[j]), run.state.apply():
                for i in range(run.m):
                    item = inbox.get()
                    if isinstance(item, _Failure):
                        pass
                    elif run.abort.is_set():
                        item = _Failure(None, i, j)
                    else:
                        try:
                            item, phony = self._cell(run, i, j, item, phony)
                        except BaseException as error:
                            run.abort.set()
                            item = _Failure(error, i, j)
                    outbox.put(item)
                    done += 1
        except BaseException as error:  # entering the worker's device or state failed
            run.abort.set()
            for i in range(done, run.m):
                outbox.put(_Failure(error, i, j))

    def _cell(
        self, run: _Run, i: int, j: int, value: Any, phony: Tensor | None
    ) -> tuple[Any, Tensor | None]:
        """Cell (i, j): move the input and the skips in, compute, keep the skips out."""
        device = self.devices[j]
        trace = run.trace
        started = time.perf_counter() if trace is not None else 0.0
        source = run.source if j == 0 else run.compute[j - 1]
        value = move(value, device, source=source, copy=run.copy[j], target=run.compute[j])
        # A skip comes straight from the partition that stashed it: one copy, here.
        outbound_keys = self._outbound[j]
        inbound = {
            route.key: move(
                run.skips[i].pop(route.key),
                device,
                source=run.compute[route.stash_partition],
                copy=run.copy[j],
                target=run.compute[j],
            )
            for route in self._inbound[j]
        }
        if trace is not None:
            trace.record(j, i, "copy", started, time.perf_counter())
        with (
            profiled(f"{j}F{i}"),
            trace.span(j, i, "forward") if trace is not None else nullcontext(),
        ):
            if outbound_keys is None:
                return self._compute(run, i, j, self.partitions[j], value, phony)
            function = partial(run_cell, self.partitions[j], outbound_keys)
            packed = (value, inbound)
            (output, outbound), phony = self._compute(run, i, j, function, packed, phony)
        run.skips[i].update(outbound)
        return output, phony

    def _compute(
        self,
        run: _Run,
        i: int,
        j: int,
        function: Callable[[Any], Any],
        value: Any,
        phony: Tensor | None,
    ) -> tuple[Any, Tensor | None]:
        """Run ``function(value)`` as cell (i, j): checkpointed or not, with its edges."""
        device = self.devices[j]
        randomness = CellRandomness(cell_seed(run.seed, i, j))
        # A phony for the next micro-batch's cell on this partition (see dependency.py).
        wants_phony = run.state.grad_enabled and i + 1 < run.m
        if i < run.checkpoint_stop:
            return checkpoint(
                function,
                value,
                state=run.state,
                randomness=randomness,
                device=device,
                after=phony,
                fork=wants_phony,
                guard=self._guards[j],
                record=None if run.trace is None else partial(run.trace.record, j, i),
                name=f"{j}B{i}",
            )
        if j == 0 and run.state.grad_enabled:
            # Micro-batches are views of one input: when it needs grad, a layer that
            # works in place (ReLU(inplace=True)) on two of them would break autograd's
            # version checks, which the whole batch in one piece does not. Checkpointed
            # cells copy their input anyway.
            value = map_tensors(
                lambda x: x.clone() if x.requires_grad and x._is_view() else x, value
            )
        value = join(value, phony)
        backward = None
        if run.trace is not None and run.state.grad_enabled:
            backward = BackwardSpan(run.trace, j, i)
            value = backward.mark_input(value, list(self.partitions[j].parameters()))
        with randomness.forward():
            output = function(value)
        if backward is not None:
            output = backward.mark_output(output)
        return fork(output) if wants_phony else (output, None)


def _lost(run: _Run, outputs: _Outputs, error: BaseException) -> None:
    run.abort.set()
    outputs.abandon(error)


def batch_norm_guard(partition: nn.Module) -> Callable[[], AbstractContextManager[None]] | None:
    tracking = [
        m
        for m in partition.modules()
        if isinstance(m, _BatchNorm)
        and not isinstance(m, DeferredBatchNorm)  # it never updates in recomputation
        and m.track_running_stats
    ]
    return partial(freeze_running_stats, tracking) if tracking else None


def has_skippables(partition: nn.Module) -> bool:
    return any(isinstance(module, Skippable) for module in partition.modules())


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10, which has no notes, set ``__notes__``.

    Python 3.10 does not print ``__notes__``, but code that catches the exception can
    read them there, as on later versions.
    """
    if sys.version_info >= (3, 11):
        error.add_note(note)
        return
    with suppress(AttributeError):  # an exception type with __slots__ and no __dict__
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def device_of(value: Any) -> torch.device:
    for leaf in flatten(value)[0]:
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")
