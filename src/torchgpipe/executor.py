"""The executor: each rank's worker runs its actions, in its table's order.

Every run of the stages goes through :class:`StepRun`: a schedule's training step
(``F``, ``B`` and ``W`` actions, the loss in the step) and ``GPipe``'s forward (the ``F``
actions of the GPipe table, the outputs handed back to the caller; ``pipeline.py``).
A cell is built in one of two ways:

- **A graph per stage** (``connected=False``). The stage computes on leaves cut from
  what the previous stage sent; its ``B`` backpropagates to those leaves on the rank's
  worker and sends their gradients back. Backward is as parallel as the forward, on
  CPU too. Schedules always work this way; so does ``model(x)`` on CPU partitions.
- **One graph** (``connected=True``). The cell's input is the previous stage's output
  itself, so the caller's ``loss.backward()`` runs the whole pipeline's backward in
  PyTorch's engine. A checkpointed cell is a ``checkpoint.py`` node, and phony edges
  (``dependency.py``) keep each partition's backward in micro-batch order. This is
  ``model(x)`` where a partition is on a GPU (see ``pipeline.py`` for why), and under
  ``no_grad``, where a plain call is all a cell needs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from torchgpipe.cell import (
    StageCell,
    aliases,
    detach_all,
    detached,
    needs_per_leaf,
    stage_leaf,
    tensors_of,
    wanted,
    wanting,
)
from torchgpipe.checkpoint import checkpoint, set_flag
from torchgpipe.copy import move
from torchgpipe.dependency import fork, join
from torchgpipe.mailbox import Mailbox, add_note, real_failures, where
from torchgpipe.microbatch import device_of, flatten, map_tensors, unflatten
from torchgpipe.rng import CellRandomness, cell_seed, draw_seed
from torchgpipe.schedules import Action, Schedule
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.skip.tracker import run_cell
from torchgpipe.split_backward import backward_inputs, ones_if_none
from torchgpipe.stages import Stages
from torchgpipe.steps import LossFn
from torchgpipe.stream import (
    AnyStream,
    current_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from torchgpipe.trace import BackwardSpan, profiled
from torchgpipe.worker import ThreadState, WorkerPool

__all__ = ["Phase", "Step", "StepRun", "Workers"]

Phase = Literal["all", "forward", "backward"]
"""Which of a rank's actions a run of the workers takes: all, the F ones, the others."""


class Step(Mailbox):
    """What the actions of one step share: messages, failures, and memory counts."""

    def __init__(self, stages: int, m: int) -> None:
        super().__init__()
        self.cells: dict[tuple[int, int], StageCell] = {}
        self.held = [0] * stages
        self.peak = [0] * stages
        self.losses: list[Tensor | None] = [None] * m
        self.outputs: list[Any] = [None] * m

    def hold(self, s: int, delta: int) -> None:
        """Count ``delta`` more micro-batches held by stage ``s``; keep the peak."""
        with self._lock:
            self.held[s] += delta
            self.peak[s] = max(self.peak[s], self.held[s])


class Workers:
    """The worker threads of a pipeline's ranks, which run one :class:`StepRun` at a time.

    One worker per stage, kept from run to run (``worker.py``); a table with fewer
    ranks (interleaved) uses the first ones. A copy of the model, or a process forked
    from this one, starts workers of its own.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool: WorkerPool | None = None  # started by the first run
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]

    def run(self, run: StepRun, phase: Phase, describe: Callable[[Action], str]) -> None:
        """Run each rank's actions of ``phase`` on its worker; return when all are done.

        Raises:
            BaseException: the first failure of an action, with a note saying where
                (``describe(action)`` names its stage and device), or what a worker
                raised while reporting.
        """
        step, ranks = run.step, len(run.table.ranks)
        with self._lock:
            pool = self.pool
            if pool is None or pool.pid != os.getpid():
                pool = self.pool = WorkerPool(self.n)
            done = [threading.Event() for _ in range(ranks)]
            lost: list[BaseException] = []  # what a worker raised while reporting
            for r in range(ranks):
                job = partial(run.rank, r, phase)
                pool.submit(r, job, partial(_lost, lost, step), done[r])
            try:
                for event in done:
                    event.wait()
            except BaseException:  # KeyboardInterrupt: stop the workers, let them finish
                step.halt()
                for event in done:
                    event.wait()
                raise
            if lost:
                # A worker's messages may be missing: the others could wait on them
                # forever. Leave those threads, and start fresh ones next time.
                pool.close()
                self.pool = None
        if lost:
            add_note(lost[0], "torchgpipe: a worker failed while reporting a result")
            raise lost[0]
        real = real_failures(step)
        if real:
            error, action = real[0]
            add_note(error, where(action, describe(action), len(step.outputs)))
            raise error


def _lost(lost: list[BaseException], step: Step, error: BaseException) -> None:
    """A rank's worker raised ``error`` while reporting: stop the step; the caller raises it."""
    lost.append(error)
    step.halt()  # the other ranks stop waiting for what this one will not send


def call_stage(
    partition: nn.Module, pops: bool, outbound: tuple[SkipKey, ...] | None, packed: Any
) -> tuple[Any, dict[SkipKey, Any]]:
    """Run a stage's partition; return its output and the skips it stashed.

    ``packed`` is the input, or ``(input, inbound skips)`` where the stage pops skips or
    stashes them (``outbound`` is then not None).
    """
    if outbound is None:
        if pops:  # pops, but stashes nothing: still under a tracker
            output, _ = run_cell(partition, (), packed)
            return output, {}
        return partition(packed), {}
    output, skips = run_cell(partition, outbound, packed)
    return output, dict(skips)


class StepRun:
    """One step: the actions of the local ranks, and the messages between them.

    ``post`` carries the messages: in one process it is ``step`` itself; across
    processes it sends those for stages elsewhere. ``batches`` are needed where stage 0
    runs, ``targets`` where the last stage runs.

    Without ``loss_fn`` the run is ``model(x)``'s: the last stage's outputs are the
    step's, and their gradients, when they come, are the caller's. In a graph per stage
    they arrive in the mailbox as ``("G", n - 1, i)``, and stage 0 leaves the gradients
    of its inputs under ``("G", -1, i)``; with ``connected`` the caller's engine does it
    all (see the module's documentation).
    """

    def __init__(
        self,
        stages: Stages,
        loss_fn: LossFn | None,
        table: Schedule,
        step: Step,
        batches: list[Any],
        targets: list[Any],
        weights: list[float],
        *,
        post: Mailbox | None = None,
        connected: bool = False,
    ) -> None:
        self.loss_fn = loss_fn
        self.connected = connected
        self.table = table
        self.step = step
        self.post: Mailbox = post if post is not None else step
        self.batches = batches
        self.targets = targets
        self.weights = weights
        self.partitions = stages.partitions
        self.devices = stages.devices
        self.inbound = stages.inbound
        self.outbound = stages.outbound
        self.guards = stages.guards
        self.popped_by = {r.key: r.pop_partition for r in stages.routes}
        self.trainable = {
            s: any(p.requires_grad for p in part.parameters())
            for s, part in stages.partitions.items()
        }
        self.n = len(stages.inbound)
        self.trace = stages.tracer
        self.state = ThreadState.capture()
        self.split = table.splits_backward
        self.checkpoint_stop = stages.checkpoint_stop
        self.seed = draw_seed()
        rank_device = {table.placement[s]: device for s, device in stages.devices.items()}
        self.rank_device = rank_device
        # A rank runs its stages on one device (checked by the schedules), and on the
        # streams of the first of them.
        first = {r: min(s for s in stages.devices if table.placement[s] == r) for r in rank_device}
        self.compute = {r: stages.streams[s][0] for r, s in first.items()}
        self.copy = {r: stages.streams[s][1] for r, s in first.items()}
        # Where the caller's tensors come from; a message from another process arrives
        # ready on this one's device, so any local stream will do for it.
        given = batches or targets
        self.source = current_stream(
            device_of(given[0]) if given else next(iter(rank_device.values()))
        )
        self._home = next(iter(self.compute.values()))
        self._phony: dict[int, Tensor | None] = {}  # connected: per stage, the last cell's

    # The rank's loop.

    def rank(self, r: int, phase: Phase = "all") -> None:
        """Run rank ``r``'s actions of ``phase`` in order; a failure fails the step."""
        actions = self.table.ranks[r]
        device = self.devices[actions[0].stage] if actions else torch.device("cpu")
        if phase != "all":
            actions = tuple(a for a in actions if (a.kind == "F") == (phase == "forward"))
        for action in actions:
            if self.post.halted:
                return
            try:
                with profiled(str(action)), use_device(device), use_stream(self.compute[r]):
                    if action.kind == "F":
                        self.forward(action.stage, action.i)
                    elif action.kind == "B":
                        self.backward(action.stage, action.i)
                    else:
                        self.weight(action.stage, action.i)
            except BaseException as error:
                self.post.fail(error, action)
                return

    def hand_over(self) -> None:
        """Make the calling thread's streams wait for the step's work (CUDA only).

        The ranks computed the gradients, losses and outputs on their own compute
        streams; the caller reads them on its current streams (an optimizer step, say),
        which must not run ahead. The losses and outputs are recorded on those streams
        too, so their memory is not reused before the caller's reads have run.
        """
        for r, device in self.rank_device.items():
            wait_stream(current_stream(device), self.compute[r])
        kept = [*self.step.losses, *self.step.outputs]
        for leaf in flatten(kept)[0]:
            if isinstance(leaf, Tensor):
                record_stream(leaf, current_stream(leaf.device))

    def _span(self, s: int, i: int, kind: Any) -> AbstractContextManager[None]:
        return self.trace.span(s, i, kind) if self.trace is not None else nullcontext()

    def _stream(self, s: int) -> AnyStream:
        return self.compute.get(self.table.placement[s], self._home)

    # F

    def forward(self, s: int, i: int) -> None:
        """Action ``sFi``: stage ``s``'s forward of micro-batch ``i`` (and the loss, last)."""
        step, post, device = self.step, self.post, self.devices[s]
        r = self.table.placement[s]
        started = time.perf_counter() if self.trace is not None else 0.0
        if s == 0:
            value, source = self.batches[i], self.source
        else:
            value, source = post.take(("F", s, i)), self._stream(s - 1)
        value = move(value, device, source=source, copy=self.copy[r], target=self.compute[r])
        # A skip comes straight from the stage that stashed it: one copy, here.
        inbound = {
            route.key: move(
                post.take(("S", route.key, i)),
                device,
                source=self._stream(route.stash_partition),
                copy=self.copy[r],
                target=self.compute[r],
            )
            for route in self.inbound[s]
        }
        if self.trace is not None:
            self.trace.record(s, i, "copy", started, time.perf_counter())
        if self.connected:
            with self._span(s, i, "forward"):
                output, outbound = self._connected_forward(s, i, value, inbound)
            if s + 1 < self.n:
                post.put(("F", s + 1, i), output)
                for key, skip in outbound.items():
                    post.put(("S", key, i), skip)
            else:
                step.outputs[i] = output
            return
        with self._span(s, i, "forward"):
            cell, result = self._run_forward(s, i, value, inbound)
        step.cells[(s, i)] = cell
        step.hold(s, 1)
        output, outbound = result
        if s + 1 < self.n:
            post.put(("F", s + 1, i), detached(output))
            for key, skip in outbound.items():
                post.put(("S", key, i), detached(skip))
            return
        if self.loss_fn is None:  # model(x): the caller's gradients start the backward
            step.outputs[i] = output
            return
        # The loss is part of the last stage's cell: it draws on from the cell's generators
        # in forward, as in the recomputation.
        with self.state.apply(grad_enabled=not cell.checkpointed), cell.randomness.forward():
            loss = self._loss(self.loss_fn, output, self._target(s, i))
        step.losses[i] = loss.detach()
        step.outputs[i] = detached(output)
        if not cell.checkpointed:
            cell.outputs = [loss * self.weights[i]] if loss.requires_grad else []
        else:
            cell.outputs = []  # recomputed in backward

    def _connected_forward(
        self, s: int, i: int, value: Any, inbound: dict[SkipKey, Any]
    ) -> tuple[Any, dict[SkipKey, Any]]:
        """Cell ``(i, s)`` in the caller's graph: checkpointed or not, with its phonies."""
        packed = value if self.outbound[s] is None and not inbound else (value, inbound)
        # Not self._call: a checkpointed cell's node keeps its function, and a node that
        # held the run would make a cycle through autograd that Python cannot collect.
        function = partial(call_stage, self.partitions[s], bool(inbound), self.outbound[s])
        randomness = CellRandomness(cell_seed(self.seed, i, s))
        grad = self.state.grad_enabled
        # A phony for the next micro-batch's cell on this stage (see dependency.py).
        wants_phony = grad and i + 1 < len(self.step.outputs)
        phony = self._phony.pop(s, None)
        if i < self.checkpoint_stop:
            with self.state.apply():
                result, self._phony[s] = checkpoint(
                    function,
                    packed,
                    state=self.state,
                    randomness=randomness,
                    device=self.devices[s],
                    after=phony,
                    fork=wants_phony,
                    guard=self.guards[s],
                    record=None if self.trace is None else partial(self.trace.record, s, i),
                    name=f"{s}B{i}",
                )
            return result  # type: ignore[no-any-return]
        if s == 0 and grad:
            # Micro-batches are views of one input: when it needs grad, a layer that
            # works in place (ReLU(inplace=True)) on two of them would break autograd's
            # version checks, which the whole batch in one piece does not. Checkpointed
            # cells copy their input anyway.
            packed = map_tensors(
                lambda x: x.clone() if x.requires_grad and x._is_view() else x, packed
            )
        packed = join(packed, phony)
        span = None
        if self.trace is not None and grad:
            span = BackwardSpan(self.trace, s, i)
            packed = span.mark_input(packed, list(self.partitions[s].parameters()))
        with self.state.apply(), randomness.forward():
            result = function(packed)
        if span is not None:
            result = span.mark_output(result)
        if wants_phony:
            result, self._phony[s] = fork(result)
        return result  # type: ignore[no-any-return]

    @staticmethod
    def _loss(loss_fn: LossFn, output: Any, target: Any) -> Tensor:
        loss = loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return a tensor with one element, got "
                f"{type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)}"
                f"; use a reduction of 'mean' or 'sum' in the loss"
            )
        return loss.reshape(())

    def _run_forward(
        self, s: int, i: int, value: Any, inbound: dict[SkipKey, Any]
    ) -> tuple[StageCell, tuple[Any, dict[SkipKey, Any]]]:
        value_leaves, _ = flatten(value)
        value_tensors = sum(isinstance(x, Tensor) for x in value_leaves)
        packed = value if self.outbound[s] is None and not inbound else (value, inbound)
        leaves, spec = flatten(packed)
        checkpointed = i < self.checkpoint_stop
        needs = [x.requires_grad for x in leaves if isinstance(x, Tensor)]
        cell = StageCell(
            checkpointed=checkpointed,
            randomness=CellRandomness(cell_seed(self.seed, i, s)),
            spec=spec,
            leaves=[],
            needs=needs,
            value_tensors=value_tensors,
            skip_tensors=[
                sum(isinstance(x, Tensor) for x in flatten(skip)[0]) for skip in inbound.values()
            ],
            # The first stage hands its input gradients on into the caller's graph.
            upstream=[x for x in leaves if isinstance(x, Tensor) and x.requires_grad]
            if s == 0
            else [],
        )
        if checkpointed:
            # Keep a copy: a first layer may modify its input in place.
            cell.leaves = [x.detach().clone() if isinstance(x, Tensor) else x for x in leaves]
            with (
                torch.no_grad(),
                self.state.apply(grad_enabled=False),
                set_flag("checkpointing"),
                cell.randomness.forward(),
            ):
                output, outbound = self._call(s, unflatten(detach_all(leaves), spec))
            # Without a graph nothing says which outputs will want a gradient: all the
            # floating ones may, when an input or a weight does. (Recomputation finds
            # out; a gradient that turns out unneeded is dropped there.)
            wants = any(needs) or self.trainable[s]
            return cell, (
                wanting(output, wants),
                {k: wanting(v, wants) for k, v in outbound.items()},
            )
        cell.leaves = [stage_leaf(x, s == 0) if isinstance(x, Tensor) else x for x in leaves]
        cell.inputs = [x for x in cell.leaves if isinstance(x, Tensor)]
        with self.state.apply(grad_enabled=True), cell.randomness.forward():
            result = self._call(s, unflatten(aliases(cell.leaves), spec))
        cell.outputs = tensors_of(result)
        return cell, result

    def _call(self, s: int, packed: Any) -> tuple[Any, dict[SkipKey, Any]]:
        """Partition ``s`` on its input; return its output and the skips it stashed."""
        return call_stage(self.partitions[s], bool(self.inbound[s]), self.outbound[s], packed)

    # B

    def backward(self, s: int, i: int) -> None:
        """Action ``sBi``: the backward (input gradients only, when W is split off)."""
        cell = self.step.cells[(s, i)]
        grads = self._output_grads(s, i)
        guard = self.guards[s] if cell.checkpointed and self.guards[s] is not None else None
        with guard() if guard is not None else nullcontext():
            if cell.checkpointed:
                with self._span(s, i, "recompute"):
                    self._recompute(s, i, cell)
            with self._span(s, i, "backward"):
                pairs = [
                    (y, g)
                    for y, g in zip(cell.outputs, grads, strict=True)
                    if y.requires_grad and (g is not None or self._owns_loss(s))
                ]
                wanted = [x for x in cell.inputs if x.requires_grad]
                if not self.split:
                    if pairs:
                        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
                    self._release(s, i)
                elif pairs and wanted:
                    cell.plan = backward_inputs(pairs, wanted)
                elif pairs:  # nothing to hand back: W does all of it
                    cell.plan = [([(y, ones_if_none(y, g)) for y, g in pairs], [])]
        input_grads = [x.grad if x.requires_grad else None for x in cell.inputs]
        for x in cell.inputs:
            x.grad = None
        self._hand_back(s, i, cell, input_grads)

    def _owns_loss(self, s: int) -> bool:
        """Whether stage ``s`` computes the loss: its backward starts from it."""
        return self.loss_fn is not None and s == self.n - 1

    def _output_grads(self, s: int, i: int) -> list[Tensor | None]:
        """The gradient of each tensor the cell's forward gave out, as received."""
        if self._owns_loss(s):
            return [None]
        post, device, r = self.post, self.devices[s], self.table.placement[s]
        grads = post.take(("G", s, i))
        # The last stage's come from the caller (model(x)), where its input came from.
        source = self._stream(s + 1) if s + 1 < self.n else self.source
        grads = move(grads, device, source=source, copy=self.copy[r], target=self.compute[r])
        for key in self.outbound[s] or ():
            skip_grads = post.take(("SG", key, i))
            grads += move(
                skip_grads,
                device,
                source=self._stream(self.popped_by[key]),
                copy=self.copy[r],
                target=self.compute[r],
            )
        return list(grads)

    def _recompute(self, s: int, i: int, cell: StageCell) -> None:
        leaves = [
            x.detach().requires_grad_(need) if isinstance(x, Tensor) else x
            for x, need in zip(cell.leaves, needs_per_leaf(cell), strict=True)
        ]
        cell.inputs = [x for x in leaves if isinstance(x, Tensor)]
        with (
            self.state.apply(grad_enabled=True),
            set_flag("recomputing"),
            cell.randomness.replay(),
        ):
            result = self._call(s, unflatten(aliases(leaves), cell.spec))
            if self.loss_fn is not None and s == self.n - 1:
                loss = self._loss(self.loss_fn, result[0], self._target(s, i))
                cell.outputs = [loss * self.weights[i]] if loss.requires_grad else []
                return
        cell.outputs = tensors_of(result)

    def _target(self, s: int, i: int) -> Any:
        r = self.table.placement[s]
        device = self.devices[s]
        return move(
            self.targets[i], device, source=self.source, copy=self.copy[r], target=self.compute[r]
        )

    def _hand_back(self, s: int, i: int, cell: StageCell, grads: list[Tensor | None]) -> None:
        """Send the input gradients to the stages that produced the inputs."""
        if s == 0 and self.loss_fn is None:  # model(x): the caller's engine takes them
            self.post.put(("G", -1, i), wanted(cell, grads))
            return
        if s == 0:
            pairs = [
                (x, g)
                for x, g in zip(cell.upstream, wanted(cell, grads), strict=True)
                if g is not None
            ]
            if pairs:  # into the caller's graph, which produced the input
                torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
            return
        post = self.post
        post.put(("G", s - 1, i), grads[: cell.value_tensors])
        rest = grads[cell.value_tensors :]
        for route, count in zip(self.inbound[s], cell.skip_tensors, strict=True):
            post.put(("SG", route.key, i), rest[:count])
            rest = rest[count:]

    def _release(self, s: int, i: int) -> None:
        del self.step.cells[(s, i)]
        self.step.hold(s, -1)

    # W

    def weight(self, s: int, i: int) -> None:
        """Action ``sWi``: the weight gradients that ``sBi`` left to do."""
        cell = self.step.cells[(s, i)]
        with self._span(s, i, "weight"):
            for roots, leaves in cell.plan:
                torch.autograd.backward(
                    [root for root, _ in roots],
                    [grad for _, grad in roots],
                    inputs=leaves or None,  # None: every leaf the roots reach
                )
        self._release(s, i)
