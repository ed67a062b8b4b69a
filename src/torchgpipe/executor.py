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

import time
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor

from torchgpipe.cell import (
    SkipVersions,
    StageCell,
    call_loss,
    call_stage,
    checkpoints,
    connected_forward,
    cut_target,
    detach_all,
    detached,
    needs_per_leaf,
    only_wanting,
    stage_leaf,
    take_input_grads,
    tensors_of,
    wanted,
    wanting,
)
from torchgpipe.checkpoint import aliases, checkpoint_flags, fresh_leaves, output_pairs, recomputing
from torchgpipe.copy import move
from torchgpipe.guards import RunGuards
from torchgpipe.mailbox import Mailbox
from torchgpipe.microbatch import count_tensors, flatten, map_tensors, per_tensor, unflatten
from torchgpipe.rng import CellRandomness, cell_seed, draw_seed
from torchgpipe.schedules import Schedule
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.split_backward import HookWatch, backward_inputs
from torchgpipe.stages import Stages
from torchgpipe.steps import LossFn, one_number, refuse_cached_parametrizations, untrained
from torchgpipe.stream import (
    AnyStream,
    caller_streams,
    current_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from torchgpipe.trace import profiled
from torchgpipe.worker import Phase, ThreadState

__all__ = ["Step", "StepRun"]


class Step(Mailbox):
    """What the actions of one step share: messages, failures, and memory counts."""

    def __init__(self, stages: int, m: int) -> None:
        super().__init__()
        self.cells: dict[tuple[int, int], StageCell] = {}
        self.held = [0] * stages
        self.peak = [0] * stages
        self.losses: list[Tensor | None] = [None] * m
        self.outputs: list[Any] = [None] * m
        self.untrained = 0  # losses that do not require grad
        self.cut_off = False  # one of them from outputs that do, or a trained stage
        # Stage 0's inputs in the caller's graph, with their gradients (a schedule's step).
        self.upstream: list[tuple[Tensor, Tensor]] = []

    def drop(self) -> None:
        """Let go of every cell and message of a step that failed.

        The exception raised holds the step through its traceback's frames, and so, until
        Python collects that cycle, every activation the unfinished cells kept.
        """
        for cell in self.cells.values():
            cell.release()  # a failed action's frame may still hold the cell itself
        self.cells.clear()
        with self._lock:
            self._box.clear()

    def hold(self, s: int, delta: int) -> None:
        """Count ``delta`` more micro-batches held by stage ``s`` (no lock: one thread)."""
        held = self.held[s] = self.held[s] + delta
        if held > self.peak[s]:
            self.peak[s] = held


class StepRun:
    """One step: the actions of the local ranks, and the messages between them.

    ``post`` carries the messages: in one process it is ``step`` itself; across
    processes it sends those for stages elsewhere. ``batches`` are needed where stage 0
    runs, ``targets`` where the last stage runs. ``seed`` seeds the cells' generators:
    by default drawn from the default CPU generator; across processes, rank 0's.

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
        seed: int | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.connected = connected
        self.table = table
        self.step = step
        self.post: Mailbox = post if post is not None else step
        self.batches, self.targets, self.weights = batches, targets, weights
        self.partitions = stages.partitions
        self.devices = stages.devices
        self.inbound = stages.inbound
        self.outbound = stages.outbound
        self.guards = RunGuards(stages.guards)  # made at the run's first use of a stage
        layout = stages.layout(table.placement)
        self.popped_by = layout.popped_by
        self._trainable: dict[int, bool] = {}  # per stage, read when first needed
        self.n = len(stages.inbound)
        self.trace = stages.tracer
        self.state = ThreadState.capture()
        self.split, self.hooked = table.splits_backward, set[int]()  # stages W must not split
        self.checkpoint_stop = stages.checkpoint_stop
        graphs = self.state.grad_enabled or loss_fn is not None  # a step records them
        refuse_cached_parametrizations(stages.partitions.values(), graphs)
        self.seed = draw_seed() if seed is None else seed
        self.rank_device, self.compute, self.copy = layout.devices, layout.compute, layout.copy
        # The caller's streams, which the ranks' wait for first (stream.caller_streams).
        self.source = caller_streams(layout.devices.values(), [*batches[:1], *targets[:1]])
        self._home = next(iter(self.compute.values()))
        self._cpu = layout.cpu
        self.phony: dict[int, Tensor | None] = {}  # connected: per stage, the last cell's
        self.params: dict[int, tuple[list[Tensor], bool]] = {}  # connected (cell._params)
        self.skips = SkipVersions(len(step.outputs), batches)

    # The rank's loop.

    def rank(self, r: int, phase: Phase = "all") -> None:
        """Run rank ``r``'s actions of ``phase`` in order; a failure fails the step.

        The rank's device, stream and the caller's thread state are entered once for
        all its actions: what runs between two cells is on the critical path, and a
        worker that just woke runs it many times slower than a busy one.
        """
        actions = self.table.ranks[r]
        if phase != "all":
            actions = tuple(a for a in actions if (a.kind == "F") == (phase == "forward"))
        if not actions:
            return
        device = self.devices[actions[0].stage]
        # A schedule's step records gradients even under no_grad; a graph per stage
        # needs them; a cell in the caller's graph runs in the caller's grad mode.
        grad = None if self.connected else True
        action = actions[0]
        try:
            with (
                use_device(device),
                use_stream(self.compute[r]),
                self.state.apply(grad_enabled=grad),
            ):
                for stream in (self.compute[r], self.copy[r]):  # the caller's work first
                    wait_stream(stream, self.source.get(device))
                for position, action in enumerate(actions):
                    if self.post.halted:
                        return
                    self.post.begin(position)
                    with profiled(action):
                        if action.kind == "F":
                            self.forward(action.stage, action.i)
                        elif action.kind == "B":
                            self.backward(action.stage, action.i)
                        else:
                            self.weight(action.stage, action.i)
        except BaseException as error:
            self.post.fail(error, action)

    def hand_over(self) -> None:
        """Make the calling thread's streams wait for the step's work (CUDA only).

        The caller reads the gradients, losses and outputs (an optimizer step) on its
        current streams, which must not run ahead of the ranks' compute streams; those
        tensors are recorded on them too, so their memory is not reused before then.
        """
        if self._cpu:
            return
        for r, device in self.rank_device.items():
            wait_stream(current_stream(device), self.compute[r])
        kept = [*self.step.losses, *self.step.outputs, *(g for _, g in self.step.upstream)]
        for leaf in flatten(kept)[0]:
            if isinstance(leaf, Tensor):
                record_stream(leaf, current_stream(leaf.device))

    def backward_upstream(self) -> None:
        """Hand the step's input gradients into the caller's graph (after :meth:`hand_over`).

        One backward from all the micro-batches, pieces of one input, walks the graph that
        made it (an embedding before the pipeline) once: a second would find it freed.
        """
        pairs, self.step.upstream = self.step.upstream, []
        if pairs:
            torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])

    def _span(self, s: int, i: int, kind: Any) -> AbstractContextManager[None]:
        return self.trace.span(s, i, kind) if self.trace is not None else nullcontext()

    def _stream(self, s: int) -> AnyStream:
        return self.compute.get(self.table.placement[s], self._home)

    # F

    def forward(self, s: int, i: int) -> None:
        """Action ``sFi``: stage ``s``'s forward of micro-batch ``i`` (and the loss, last)."""
        step, post, device = self.step, self.post, self.devices[s]
        r = self.table.placement[s]
        source: AnyStream | dict[torch.device, AnyStream] = self.source
        if s == 0:
            value = self.batches[i]
        else:
            value, source = post.take(("F", s, i)), self._stream(s - 1)
        started = time.perf_counter() if self.trace is not None else 0.0
        value = move(value, device, source=source, copy=self.copy[r], target=self.compute[r])
        # A skip comes straight from the stage that stashed it: one copy, here.
        inbound = {
            route.key: move(
                self.skips.check(route.key, i, post.take(("S", route.key, i))),
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
                (output, outbound), wrapped = connected_forward(self, s, i, value, inbound)
            if s + 1 < self.n:  # the skips' versions noted before the next stage may change them
                whole = None if wrapped else output  # handed on as it is
                sent = {k: self.skips.sent(k, i, skip, whole) for k, skip in outbound.items()}
                post.put(("F", s + 1, i), output)
                for key, skip in sent.items():
                    post.put(("S", key, i), skip)
            else:
                step.outputs[i] = output
            return
        loss: Any = None  # the last stage's, in a step
        with self._span(s, i, "forward"):
            cell, result = self._run_forward(s, i, value, inbound)
            if self.loss_fn is not None and s + 1 == self.n and not cell.checkpointed:
                # Part of the last stage's cell (and span), drawing on from its generators;
                # a checkpointed cell's is computed once, in its recomputation (B).
                target = self._target(s, i, cell)
                with cell.randomness.forward():
                    loss = call_loss(self.loss_fn, result[0], target)
        step.cells[(s, i)] = cell
        step.hold(s, 1)
        output, outbound = result
        if s + 1 < self.n:
            # A checkpointed cell's outputs were made without a graph: nothing to cut. Cut
            # together, a tensor both output and skip stays one, as in the plain model.
            cut: Any = (lambda value: value) if cell.checkpointed else detached
            output, outbound = cut((output, outbound)) if outbound else (cut(output), outbound)
            sent = {key: self.skips.sent(key, i, skip) for key, skip in outbound.items()}
            post.put(("F", s + 1, i), output)  # once the skips' versions are noted
            for key, skip in sent.items():
                post.put(("S", key, i), skip)
            return
        if self.loss_fn is None:  # model(x): the caller's gradients start the backward
            step.outputs[i] = output
            return
        step.outputs[i] = map_tensors(Tensor.detach, output)  # the step's result: no graph
        if cell.checkpointed:
            cell.outputs = []  # its loss comes in its recomputation
            return
        self._record_loss(i, cell, loss)

    def _run_forward(
        self, s: int, i: int, value: Any, inbound: dict[SkipKey, Any]
    ) -> tuple[StageCell, tuple[Any, dict[SkipKey, Any]]]:
        packed = value if self.outbound[s] is None and not inbound else (value, inbound)
        leaves, spec = flatten(packed)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        flagged = i < self.checkpoint_stop  # is_checkpointing() in its forward
        needs = [x.requires_grad for x in tensors]
        checkpointed = checkpoints(self, s, i, tensors)
        cell = StageCell(
            checkpointed=checkpointed,
            randomness=CellRandomness(cell_seed(self.seed, i, s)),
            spec=spec,
            leaves=[],
            needs=needs,
            value_tensors=len(tensors) if packed is value else count_tensors(value),
            skip_tensors=[count_tensors(skip) for skip in inbound.values()] if inbound else [],
            # The first stage hands its input gradients on into the caller's graph.
            upstream=[x for x in tensors if x.requires_grad] if s == 0 else [],
        )
        if checkpointed:
            guard = self.guards[s]
            # Grad mode off by hand, not `with torch.no_grad()`: this runs once per cell on
            # the pipeline's critical path, where the context manager's layers cost more.
            grad_was = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                # Keep a copy: a first layer may modify its input in place.
                cell.leaves = per_tensor(Tensor.clone, leaves)
                kept = guard.before_forward() if guard is not None else None
                flags = checkpoint_flags(True, again=True)
                inputs = unflatten(detach_all(leaves), spec)  # not each through the mode below
                with flags[0], flags[1], cell.randomness.forward():
                    output, outbound = self._call(s, inputs)
            finally:
                torch._C._set_grad_enabled(grad_was)
            cell.restore = guard.after_forward(kept) if guard is not None else None
            # All floating outputs may want a gradient (no graph says which); marked
            # together, a tensor both output and skip stays one.
            return cell, wanting((output, outbound)) if outbound else (wanting(output), {})
        leaves = per_tensor(partial(stage_leaf, first=s == 0), leaves)
        cell.inputs = only_wanting([x for x in leaves if isinstance(x, Tensor)])
        inputs = unflatten(aliases(leaves), spec)
        flags = checkpoint_flags(flagged, again=False)
        with flags[0], flags[1], cell.randomness.forward():
            result = self._call(s, inputs)
        cell.outputs = tensors_of(result)
        return cell, result

    def trainable(self, s: int) -> bool:
        """Whether a parameter of stage ``s`` wants a gradient."""
        trainable = self._trainable.get(s)
        if trainable is None:
            part = self.partitions[s]
            trainable = self._trainable[s] = any(p.requires_grad for p in part.parameters())
        return trainable

    def _call(self, s: int, packed: Any) -> tuple[Any, dict[SkipKey, Any]]:
        """Partition ``s`` on its input; return its output and the skips it stashed."""
        with HookWatch(self.hooked, s) if self.split and s not in self.hooked else nullcontext():
            return call_stage(self.partitions[s], bool(self.inbound[s]), self.outbound[s], packed)

    # B

    def backward(self, s: int, i: int) -> None:
        """Action ``sBi``: the backward (input gradients only, when W is split off)."""
        cell = self.step.cells[(s, i)]
        grads = self._output_grads(s, i)
        guard = self.guards[s] if cell.checkpointed else None
        with guard.recomputing(cell.restore) if guard is not None else nullcontext():
            if cell.checkpointed:
                with self._span(s, i, "recompute"):
                    self._recompute(s, i, cell)
            with self._span(s, i, "backward"):
                if grads is None:  # the loss's gradient: its weight in the batch's loss
                    grads = [torch.full_like(y, self.weights[i]) for y in cell.outputs]
                pairs = output_pairs(cell.outputs, grads)
                # Not an input a layer made want one in place (x.mul_(w)): no leaf.
                wanted = [x for x in cell.inputs if x.requires_grad and x.is_leaf]
                wanted += [leaf for _, leaf in cell.targets]
                if not self.split:
                    if pairs:
                        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
                    self._release(s, i)
                elif pairs and wanted:
                    cell.plan = backward_inputs(pairs, wanted, unsplit=s in self.hooked)
                elif pairs:  # nothing to hand back: W does all of it
                    cell.plan = [(pairs, [])]
        input_grads = take_input_grads(cell.inputs)
        self._hand_back(s, i, cell, input_grads)

    def _owns_loss(self, s: int) -> bool:
        """Whether stage ``s`` computes the loss: its backward starts from it."""
        return self.loss_fn is not None and s == self.n - 1

    def _output_grads(self, s: int, i: int) -> list[Tensor | None] | None:
        """The gradient of each tensor the cell's forward gave out, as received.

        None for the stage that computes the loss: its backward starts from the loss.
        """
        if self._owns_loss(s):
            return None
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
        loss_fn = self.loss_fn if s == self.n - 1 else None  # the loss is part of the cell
        target = self._target(s, i, cell) if loss_fn is not None else None
        loss = None
        with recomputing(cell.randomness, loss=loss_fn is not None):  # (state: the loop's)
            leaves, aliased = fresh_leaves(cell.leaves, needs_per_leaf(cell))
            cell.inputs = [x for x in leaves if isinstance(x, Tensor)]
            result = self._call(s, unflatten(aliased, cell.spec))
            if loss_fn is not None:
                loss = call_loss(loss_fn, result[0], target, recomputing=True)
        if loss_fn is not None:
            self._record_loss(i, cell, loss)
        else:
            cell.outputs = tensors_of(result)

    def _record_loss(self, i: int, cell: StageCell, loss: Any) -> None:
        """Keep micro-batch ``i``'s loss; its cell's backward starts from it."""
        loss = one_number(loss, self.targets)
        self.step.losses[i] = loss.detach()
        if not loss.requires_grad:
            self.step.untrained += 1
            self.step.cut_off |= any(cell.needs) or self.trainable(self.n - 1)
            untrained(self.step.untrained, len(self.step.losses), wanted=self.step.cut_off)
        cell.outputs = [loss] if loss.requires_grad else []

    def _target(self, s: int, i: int, cell: StageCell) -> Any:
        """Micro-batch ``i``'s target on stage ``s``'s device, cut for the cell's loss."""
        r = self.table.placement[s]
        device = self.devices[s]
        target = move(
            self.targets[i], device, source=self.source, copy=self.copy[r], target=self.compute[r]
        )
        return cut_target(cell, target)

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
            self.step.upstream += pairs  # into the caller's graph, at the end of the step
            return
        post = self.post
        post.put(("G", s - 1, i), grads[: cell.value_tensors])
        rest = grads[cell.value_tensors :]
        for route, count in zip(self.inbound[s], cell.skip_tensors, strict=True):
            post.put(("SG", route.key, i), rest[:count])
            rest = rest[count:]

    def _release(self, s: int, i: int) -> None:
        cell = self.step.cells.pop((s, i))
        self.step.hold(s, -1)
        if cell.targets:  # the target's gradients, into the caller's graph after the step
            self.step.upstream += [(x, t.grad) for x, t in cell.targets if t.grad is not None]

    # W

    def weight(self, s: int, i: int) -> None:
        """Action ``sWi``: the weight gradients that ``sBi`` left to do."""
        cell = self.step.cells[(s, i)]
        with self._span(s, i, "weight"):
            last = len(cell.plan) - 1
            for k, (roots, leaves) in enumerate(cell.plan):  # leaves None: all they reach
                ys, grads = [y for y, _ in roots], [g for _, g in roots]
                # Two branches may share a node below them (exp(w) used twice): kept for
                # the next call, which walks it again; the graph goes with the cell.
                torch.autograd.backward(ys, grads, inputs=leaves or None, retain_graph=k < last)
        self._release(s, i)
