"""Training steps that follow a schedule table: GPipe, 1F1B, interleaved 1F1B, ZB-H1.

``GPipe.forward`` runs the forward cells on workers and leaves the backward to
PyTorch's engine, which runs the backward of CPU partitions one after another on the
caller's thread. Here each rank's worker runs its own actions from a
:class:`~torchgpipe.schedules.Schedule`: the forward ``F`` of a stage on a micro-batch,
its backward ``B``, and, when the table splits the backward, ``B`` for the input
gradient and ``W`` for the weight gradient. Backward work is then as parallel as the
forward, on CPU partitions too, and 1F1B can start a micro-batch's backward before the
last forward has run. Since backward starts inside the step, the step owns the loss::

    model = GPipe(nn.Sequential(...), balance=[2, 2], chunks=8)
    schedule = Schedule1F1B(model, nn.CrossEntropyLoss())
    result = schedule.step(input, target)   # forward, loss and backward of the batch
    optimizer.step()

Each stage computes on leaves cut from the previous stage's output: its graph ends at
its own inputs, and the gradient of those inputs is what its ``B`` hands to the
previous stage (and to the stages that stashed the skips it popped). A checkpointed
cell runs its forward without a graph and keeps only its inputs; its ``B`` recomputes
the forward (same random numbers, :func:`~torchgpipe.is_recomputing` true) and then
backpropagates.

The loss. Micro-batch ``i`` holds ``b_i`` of the ``b`` samples. With
``reduction='mean'`` the step backpropagates ``loss_fn(out_i, target_i) * b_i / b``,
and with ``'sum'`` the plain ``loss_fn(out_i, target_i)``. So the gradients equal those
of ``loss_fn(model(input), target).backward()`` on the unwrapped model when ``loss_fn``
averages over samples (``reduction='mean'`` of the losses in ``torch.nn``, where every
sample weighs the same) or sums them. A loss whose mean weighs samples unequally
(``CrossEntropyLoss`` with ``weight`` or ignored targets) needs ``'sum'`` and a
division by the right total by hand.

Splitting the backward (``W``). ``B`` backpropagates to the stage's inputs only and
keeps the graph; on the way it records the gradient reaching each node where the path to
the inputs branches off towards weights. ``W`` resumes from those nodes with those
gradients, towards the weights only, so no part of the backward runs twice. (Before
torch 2.4, whose engine cannot start from a node, ``W`` backpropagates from the stage's
outputs to its weights again.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from torchgpipe.checkpoint import _alias, _differentiable, _flag
from torchgpipe.copy import move
from torchgpipe.gpipe import GPipe
from torchgpipe.microbatch import Spec, flatten, gather, scatter, unflatten
from torchgpipe.pipeline import _add_note, _device_of
from torchgpipe.rng import CellRandomness, cell_seed, draw_seed
from torchgpipe.schedules import (
    Action,
    Schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)
from torchgpipe.skip.layout import SkipRoute
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.skip.tracker import run_cell
from torchgpipe.stream import (
    AnyStream,
    current_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from torchgpipe.trace import Trace, profiled
from torchgpipe.worker import ThreadState, WorkerPool

__all__ = [
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble",
    "StepResult",
]

Reduction: TypeAlias = Literal["mean", "sum"]
"""How the micro-batches' losses make the batch's: weighted by size, or summed."""

LossFn: TypeAlias = Callable[[Any, Any], Tensor]
TableFor: TypeAlias = Callable[[int], Schedule]

# Whether the engine can start a backward from a node (torch >= 2.4): W then resumes
# where B left off instead of walking the stage's graph again.
_RESUMABLE = hasattr(torch.autograd.graph, "get_gradient_edge") and tuple(
    int(part) for part in torch.__version__.split(".")[:2]
) >= (2, 4)


@dataclass(frozen=True)
class StepResult:
    """What one training step gives back.

    ``loss`` is the batch's loss as ``loss_fn(model(input), target)`` would give it
    (under the step's reduction), ``losses`` each micro-batch's ``loss_fn`` value,
    ``output`` the model's output gathered from the micro-batches, all detached.
    ``peak_held[s]`` is the most micro-batches whose activations (or, when
    checkpointed, inputs) stage ``s`` held at once during the step.
    """

    loss: Tensor
    losses: list[Tensor]
    output: Any
    peak_held: tuple[int, ...]


class _Stopped(Exception):
    """Raised in a worker waiting for a message that will not come: a peer failed."""


@dataclass
class _Cell:
    """Stage ``s`` on micro-batch ``i``, from its forward to its last backward action."""

    checkpointed: bool
    randomness: CellRandomness
    spec: Spec
    leaves: list[Any]  # the packed input's leaves; tensors detached (cloned if checkpointed)
    needs: list[bool]  # per tensor leaf: whether its gradient is wanted
    value_tensors: int  # how many tensor leaves come from the previous stage
    skip_tensors: list[int]  # then how many from each inbound skip, in route order
    inputs: list[Tensor] = field(default_factory=list)  # the leaves the graph starts from
    outputs: list[Tensor] = field(default_factory=list)  # what backward starts from
    upstream: list[Tensor] = field(default_factory=list)  # stage 0: the caller's graph
    plan: _Plan = field(default_factory=list)  # W's work, left by B


class _Mailbox:
    """Messages between the actions of a step, and the failures that stop it.

    ``put`` leaves a value under a key, ``take`` waits for the value under a key and
    raises :class:`_Stopped` once the step is halted: by a failure here (``fail``) or
    one reported from elsewhere (``halt``).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[tuple[Any, ...], Any] = {}
        self.failures: list[tuple[BaseException, Action]] = []
        self.halted = False

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        with self._cond:
            self._box[key] = value
            self._cond.notify_all()

    def take(self, key: tuple[Any, ...]) -> Any:
        with self._cond:
            while key not in self._box:
                if self.halted:
                    raise _Stopped
                self._cond.wait()
            return self._box.pop(key)

    def fail(self, error: BaseException, action: Action) -> None:
        with self._cond:
            self.failures.append((error, action))
            self.halted = True
            self._cond.notify_all()

    def halt(self) -> None:
        with self._cond:
            self.halted = True
            self._cond.notify_all()


class _Step(_Mailbox):
    """What the actions of one step share: messages, failures, and memory counts."""

    def __init__(self, stages: int, m: int) -> None:
        super().__init__()
        self.cells: dict[tuple[int, int], _Cell] = {}
        self.held = [0] * stages
        self.peak = [0] * stages
        self.losses: list[Tensor | None] = [None] * m
        self.outputs: list[Any] = [None] * m

    def hold(self, s: int, delta: int) -> None:
        with self._cond:
            self.held[s] += delta
            self.peak[s] = max(self.peak[s], self.held[s])


Guard: TypeAlias = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class _Stages:
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

    @classmethod
    def of(cls, model: GPipe, m: int) -> _Stages:
        """Every stage of ``model``, for a step of ``m`` micro-batches."""
        pipeline = model._pipeline
        n = len(pipeline.partitions)
        stop = {"always": m, "except_last": m - 1, "never": 0}[model.checkpoint]
        return cls(
            partitions=dict(enumerate(pipeline.partitions)),
            devices=dict(enumerate(pipeline.devices)),
            inbound=list(pipeline._inbound),
            outbound=list(pipeline._outbound),
            routes=model.skip_layout.routes,
            guards=dict(enumerate(pipeline._guards)),
            streams={s: (pipeline.streams.compute(s), pipeline.streams.copy(s)) for s in range(n)},
            checkpoint_stop=stop if model.training else 0,
            tracer=pipeline.tracer,
        )


class _TableSteps:
    """What the schedules of one process and of several share: the loss, the table."""

    loss_fn: LossFn
    reduction: Reduction
    _table: Schedule | TableFor

    def _adopt(self, loss_fn: LossFn, table: Schedule | TableFor, reduction: Reduction) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.loss_fn = loss_fn
        self.reduction = reduction
        self._table = table
        if isinstance(table, Schedule):
            self._check_table(table, table.micro_batches)

    def table(self, m: int) -> Schedule:
        """The schedule of a step with ``m`` micro-batches, checked against the stages.

        Raises:
            ValueError: the table does not fit the stages or ``m``.
            ScheduleError: the table is not valid.
        """
        table = self._table if isinstance(self._table, Schedule) else self._table(m)
        self._check_table(table, m)
        return table

    def _check_table(self, table: Schedule, m: int) -> None:
        raise NotImplementedError


class PipelineSchedule(_TableSteps):
    """Runs training steps of a :class:`~torchgpipe.GPipe` model in a schedule's order.

    Args:
        model: the model; its partitions are the schedule's stages, its ``chunks`` the
            number of micro-batches, its ``checkpoint`` mode decides which cells
            recompute in backward (in training mode).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a scalar tensor.
        table: the schedule: a :class:`~torchgpipe.schedules.Schedule` for exactly
            the number of micro-batches each step will have, or a function from that
            number to one. Stage ``s`` is partition ``s``; the stages of one rank must
            share a device.
        reduction: ``'mean'`` (the default) or ``'sum'``: how the batch's loss is made
            of the micro-batches' (see the module's documentation).

    Raises:
        TypeError: ``model`` is not a GPipe, or ``loss_fn`` not callable.
        ValueError: an unknown reduction, or a table that does not fit the model.
        ScheduleError: a table that is not valid (see ``Schedule.validate``).
    """

    def __init__(
        self,
        model: GPipe,
        loss_fn: LossFn,
        table: Schedule | TableFor,
        *,
        reduction: Reduction = "mean",
    ) -> None:
        if not isinstance(model, GPipe):
            raise TypeError(
                f"model must be a torchgpipe.GPipe, got {type(model).__name__}; wrap the "
                f"nn.Sequential in GPipe first"
            )
        self.model = model
        self._adopt(loss_fn, table, reduction)
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()

    def _check_table(self, table: Schedule, m: int) -> None:
        n = len(self.model.partitions)
        if table.stages != n:
            raise ValueError(
                f"the schedule has {table.stages} stages but the model {n} partitions; "
                f"each partition is one stage"
            )
        if table.micro_batches != m:
            raise ValueError(
                f"the schedule is for {table.micro_batches} micro-batches but the batch "
                f"splits into {m} (chunks={self.model.chunks}); pass a function of the "
                f"number of micro-batches, or a batch of at least {table.micro_batches}"
            )
        table.validate()
        devices = self.model.devices
        for r in range(len(table.ranks)):
            mine = {devices[s] for s in range(n) if table.placement[s] == r}
            if len(mine) > 1:
                raise ValueError(
                    f"rank {r} runs stages on devices {sorted(map(str, mine))}; the stages "
                    f"of one rank must share a device (list the devices of the GPipe "
                    f"so that stage s and stage s + ranks get the same one)"
                )

    def step(self, input: Any, target: Any) -> StepResult:
        """Forward ``input``, compute the loss against ``target``, and backpropagate.

        Gradients are accumulated into ``.grad`` as ``loss.backward()`` would; zero
        them between steps as usual. The step records gradients even under
        ``torch.no_grad()``.

        Raises:
            TypeError, ValueError: the input or target cannot be split into the same
                micro-batches, or the schedule does not fit them.
            BaseException: whatever a layer or ``loss_fn`` raised, with a note naming
                the action (``"1B3"``: stage 1's backward of micro-batch 3).
        """
        model = self.model
        batches = scatter(input, model.chunks)
        m = len(batches)
        targets = scatter(target, m)
        sizes = [_batch_size(b) for b in batches]
        target_sizes = [_batch_size(t) for t in targets]
        if target_sizes != sizes:
            raise ValueError(
                f"the target splits into micro-batches of {target_sizes} "
                f"samples but the input into {sizes}; give them the same batch size"
            )
        table = self.table(m)
        weights = _loss_weights(sizes, self.reduction)
        for layer in model._deferred:
            layer.expect(m)
        pipeline = model._pipeline
        if pipeline.tracer is not None:
            pipeline.tracer.m = max(pipeline.tracer.m, m)
        stages = _Stages.of(model, m)
        step = _Step(len(stages.inbound), m)
        run = _Run(stages, self.loss_fn, table, step, batches, targets, weights)
        with self._lock:
            workers = self._workers(len(table.ranks))
            done = [threading.Event() for _ in table.ranks]
            lost: list[BaseException] = []  # what a worker raised while reporting
            for r in range(len(table.ranks)):
                workers.submit(r, _job(run, r, done[r]), partial(_lost, lost, step, done[r]))
            try:
                for event in done:
                    event.wait()
            except BaseException:  # KeyboardInterrupt: stop the workers, let them finish
                step.fail(KeyboardInterrupt(), table.ranks[0][0])
                for event in done:
                    event.wait()
                raise
        run.hand_over()
        if lost:
            _add_note(lost[0], "torchgpipe: a worker failed while reporting a result")
            raise lost[0]
        real = _real_failures(step)
        if real:
            error, action = real[0]
            _add_note(error, _where(action, f"on {model.devices[action.stage]}", m))
            raise error
        losses = [x for x in step.losses if x is not None]
        return StepResult(
            loss=_weighted(weights, losses),
            losses=losses,
            output=gather(step.outputs),
            peak_held=tuple(step.peak),
        )

    def _workers(self, ranks: int) -> WorkerPool:
        pool = self._pool
        if pool is None or pool.pid != os.getpid() or len(pool.threads) != ranks:
            if pool is not None:
                pool.close()
            pool = self._pool = WorkerPool(ranks, name="torchgpipe-schedule")
        return pool

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pool"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._lock = threading.Lock()


class ScheduleGPipe(PipelineSchedule):
    """Fill and drain: all forwards, then all backwards (each stage runs its own).

    Every stage holds all ``m`` micro-batches at the turn (fewer bytes each when
    checkpointed). See :class:`PipelineSchedule` for the arguments.
    """

    def __init__(self, model: GPipe, loss_fn: LossFn, *, reduction: Reduction = "mean") -> None:
        n = _stages(model)
        super().__init__(model, loss_fn, lambda m: gpipe(n, m), reduction=reduction)


class Schedule1F1B(PipelineSchedule):
    """1F1B: after a warm-up, each stage alternates one forward and one backward.

    The bubble is GPipe's, but stage ``s`` holds at most ``n - s`` micro-batches
    instead of ``m``. See :class:`PipelineSchedule` for the arguments.
    """

    def __init__(self, model: GPipe, loss_fn: LossFn, *, reduction: Reduction = "mean") -> None:
        n = _stages(model)
        super().__init__(model, loss_fn, lambda m: one_f_one_b(n, m), reduction=reduction)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: each rank runs ``virtual_stages`` partitions, round robin.

    With ``P`` partitions and ``v = virtual_stages``, there are ``P / v`` ranks and rank
    ``r`` runs partitions ``r, r + P / v, ...``, which must share a device. The bubble
    shrinks by ``v``; the number of micro-batches must be a multiple of the ranks.

    Raises:
        ValueError: ``virtual_stages`` does not divide the partitions, or ``chunks`` is
            not a multiple of the number of ranks.
    """

    def __init__(
        self,
        model: GPipe,
        loss_fn: LossFn,
        *,
        virtual_stages: int = 2,
        reduction: Reduction = "mean",
    ) -> None:
        stages = _stages(model)
        if not isinstance(virtual_stages, int) or virtual_stages < 1 or stages % virtual_stages:
            raise ValueError(
                f"virtual_stages must be a positive divisor of the {stages} partitions, "
                f"got {virtual_stages!r}"
            )
        ranks = stages // virtual_stages
        if model.chunks % ranks:
            raise ValueError(
                f"interleaving sends micro-batches in groups of {ranks} (one per rank); "
                f"use a GPipe with chunks a multiple of {ranks}, got {model.chunks}"
            )
        self.virtual_stages = virtual_stages

        def table(m: int) -> Schedule:
            return interleaved_one_f_one_b(ranks, m, virtual_stages)

        super().__init__(model, loss_fn, table, reduction=reduction)


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1: 1F1B with each backward split into input (``B``) and weight (``W``) parts.

    ``W`` is off the critical path, so stages run it where they would otherwise wait:
    with equal costs a third of 1F1B's idle time, within 1F1B's peak memory. See
    :class:`PipelineSchedule` for the arguments.
    """

    def __init__(self, model: GPipe, loss_fn: LossFn, *, reduction: Reduction = "mean") -> None:
        n = _stages(model)
        super().__init__(model, loss_fn, lambda m: zero_bubble_h1(n, m), reduction=reduction)


def _stages(model: GPipe) -> int:
    if not isinstance(model, GPipe):
        raise TypeError(
            f"model must be a torchgpipe.GPipe, got {type(model).__name__}; wrap the "
            f"nn.Sequential in GPipe first"
        )
    return len(model.partitions)


_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def _where(action: Action, place: str, m: int) -> str:
    """The note on an error raised in ``action``, ``place`` saying where it ran."""
    return (
        f"torchgpipe: raised in {action} (stage {action.stage} {place}, "
        f"{_KIND_NAMES[action.kind]} of micro-batch {action.i} of {m})"
    )


def _real_failures(step: _Mailbox) -> list[tuple[BaseException, Action]]:
    """The step's failures, less the actions that only stopped because of them."""
    return [(e, a) for e, a in step.failures if not isinstance(e, _Stopped)]


def _weighted(weights: Sequence[float], losses: Sequence[Tensor]) -> Tensor:
    """The batch's loss: each micro-batch's weighed by its share (or summed)."""
    return torch.stack([w * x for w, x in zip(weights, losses, strict=True)]).sum()


def _loss_weights(sizes: Sequence[int], reduction: Reduction) -> list[float]:
    total = sum(sizes)
    return [b / total if reduction == "mean" else 1.0 for b in sizes]


def _batch_size(value: Any) -> int:
    for leaf in flatten(value)[0]:
        if isinstance(leaf, Tensor):
            return int(leaf.shape[0])
    raise TypeError("a micro-batch without tensors")  # scatter() rejects such batches


def _lost(
    lost: list[BaseException], step: _Step, done: threading.Event, error: BaseException
) -> None:
    """A rank's worker raised ``error`` while reporting: stop the step; the caller raises it."""
    lost.append(error)
    try:
        step.halt()  # the other ranks stop waiting for what this one will not send
    finally:
        done.set()


def _job(run: _Run, r: int, done: threading.Event) -> Callable[[], None]:
    def job() -> None:
        try:
            run.rank(r)
        finally:
            done.set()

    return job


class _Run:
    """One step: the actions of the local ranks, and the messages between them.

    ``post`` carries the messages: in one process it is ``step`` itself; across
    processes it sends those for stages elsewhere. ``batches`` are needed where stage 0
    runs, ``targets`` where the last stage runs.
    """

    def __init__(
        self,
        stages: _Stages,
        loss_fn: LossFn,
        table: Schedule,
        step: _Step,
        batches: list[Any],
        targets: list[Any],
        weights: list[float],
        *,
        post: _Mailbox | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.table = table
        self.step = step
        self.post: _Mailbox = post if post is not None else step
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
            _device_of(given[0]) if given else next(iter(rank_device.values()))
        )
        self._home = next(iter(self.compute.values()))

    # The rank's loop.

    def rank(self, r: int) -> None:
        actions = self.table.ranks[r]
        device = self.devices[actions[0].stage] if actions else torch.device("cpu")
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
        step, post, device = self.step, self.post, self.devices[s]
        r = self.table.placement[s]
        if s == 0:
            value, source = self.batches[i], self.source
        else:
            value, source = post.take(("F", s, i)), self._stream(s - 1)
        value = move(value, device, source=source, copy=self.copy[r], target=self.compute[r])
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
        with self._span(s, i, "forward"):
            cell, result = self._run_forward(s, i, value, inbound)
        step.cells[(s, i)] = cell
        step.hold(s, 1)
        output, outbound = result
        if s + 1 < self.n:
            post.put(("F", s + 1, i), _detached(output))
            for key, skip in outbound.items():
                post.put(("S", key, i), _detached(skip))
            return
        # The loss is part of the last stage's cell: it draws on from the cell's generators
        # in forward, as in the recomputation.
        with self.state.apply(grad_enabled=not cell.checkpointed), cell.randomness.forward():
            loss = self._loss(output, self._target(s, i))
        step.losses[i] = loss.detach()
        step.outputs[i] = _detached(output)
        if not cell.checkpointed:
            cell.outputs = [loss * self.weights[i]] if loss.requires_grad else []
        else:
            cell.outputs = []  # recomputed in backward

    def _loss(self, output: Any, target: Any) -> Tensor:
        loss = self.loss_fn(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return a tensor with one element, got "
                f"{type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)}"
                f"; use a reduction of 'mean' or 'sum' in the loss"
            )
        return loss.reshape(())

    def _run_forward(
        self, s: int, i: int, value: Any, inbound: dict[SkipKey, Any]
    ) -> tuple[_Cell, tuple[Any, dict[SkipKey, Any]]]:
        value_leaves, _ = flatten(value)
        value_tensors = sum(isinstance(x, Tensor) for x in value_leaves)
        packed = value if self.outbound[s] is None and not inbound else (value, inbound)
        leaves, spec = flatten(packed)
        checkpointed = i < self.checkpoint_stop
        needs = [x.requires_grad for x in leaves if isinstance(x, Tensor)]
        cell = _Cell(
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
                _flag("checkpointing"),
                cell.randomness.forward(),
            ):
                output, outbound = self._call(s, unflatten(_detach_all(leaves), spec))
            # Without a graph nothing says which outputs will want a gradient: all the
            # floating ones may, when an input or a weight does. (Recomputation finds
            # out; a gradient that turns out unneeded is dropped there.)
            wants = any(needs) or self.trainable[s]
            return cell, (
                _wanting(output, wants),
                {k: _wanting(v, wants) for k, v in outbound.items()},
            )
        cell.leaves = [_leaf(x, s == 0) if isinstance(x, Tensor) else x for x in leaves]
        cell.inputs = [x for x in cell.leaves if isinstance(x, Tensor)]
        with self.state.apply(grad_enabled=True), cell.randomness.forward():
            result = self._call(s, unflatten(_aliases(cell.leaves), spec))
        cell.outputs = _tensors(result)
        return cell, result

    def _call(self, s: int, packed: Any) -> tuple[Any, dict[SkipKey, Any]]:
        """Partition ``s`` on its input; return its output and the skips it stashed."""
        partition, outbound = self.partitions[s], self.outbound[s]
        if outbound is None:
            if self.inbound[s]:  # pops, but stashes nothing: still under a tracker
                output, _ = run_cell(partition, (), packed)
                return output, {}
            return partition(packed), {}
        output, skips = run_cell(partition, outbound, packed)
        return output, dict(skips)

    # B

    def backward(self, s: int, i: int) -> None:
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
                    if y.requires_grad and (g is not None or s == self.n - 1)
                ]
                wanted = [x for x in cell.inputs if x.requires_grad]
                if not self.split:
                    if pairs:
                        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
                    self._release(s, i)
                elif pairs and wanted:
                    cell.plan = _backward_inputs(pairs, wanted)
                elif pairs:  # nothing to hand back: W does all of it
                    cell.plan = [([(y, _ones_if_none(y, g)) for y, g in pairs], [])]
        input_grads = [x.grad if x.requires_grad else None for x in cell.inputs]
        for x in cell.inputs:
            x.grad = None
        self._hand_back(s, i, cell, input_grads)

    def _output_grads(self, s: int, i: int) -> list[Tensor | None]:
        """The gradient of each tensor the cell's forward gave out, as received."""
        if s == self.n - 1:
            return [None]
        post, device, r = self.post, self.devices[s], self.table.placement[s]
        grads = post.take(("G", s, i))
        source = self._stream(s + 1)
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

    def _recompute(self, s: int, i: int, cell: _Cell) -> None:
        leaves = [
            x.detach().requires_grad_(need) if isinstance(x, Tensor) else x
            for x, need in zip(cell.leaves, _needs_per_leaf(cell), strict=True)
        ]
        cell.inputs = [x for x in leaves if isinstance(x, Tensor)]
        with (
            self.state.apply(grad_enabled=True),
            _flag("recomputing"),
            cell.randomness.replay(),
        ):
            result = self._call(s, unflatten(_aliases(leaves), cell.spec))
            if s == self.n - 1:
                loss = self._loss(result[0], self._target(s, i))
                cell.outputs = [loss * self.weights[i]] if loss.requires_grad else []
                return
        cell.outputs = _tensors(result)

    def _target(self, s: int, i: int) -> Any:
        r = self.table.placement[s]
        device = self.devices[s]
        return move(
            self.targets[i], device, source=self.source, copy=self.copy[r], target=self.compute[r]
        )

    def _hand_back(self, s: int, i: int, cell: _Cell, grads: list[Tensor | None]) -> None:
        """Send the input gradients to the stages that produced the inputs."""
        if s == 0:
            pairs = [
                (x, g)
                for x, g in zip(cell.upstream, _wanted(cell, grads), strict=True)
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
        cell = self.step.cells[(s, i)]
        with self._span(s, i, "weight"):
            for roots, leaves in cell.plan:
                torch.autograd.backward(
                    [root for root, _ in roots],
                    [grad for _, grad in roots],
                    inputs=leaves or None,  # None: every leaf the roots reach
                )
        self._release(s, i)


def _needs_per_leaf(cell: _Cell) -> list[bool]:
    it = iter(cell.needs)
    return [next(it) if isinstance(x, Tensor) else False for x in cell.leaves]


def _wanted(cell: _Cell, grads: list[Tensor | None]) -> list[Tensor | None]:
    """The gradients of the stage-0 inputs that the caller's graph wants, in order."""
    return [g for g, need in zip(grads, cell.needs, strict=True) if need]


def _leaf(x: Tensor, first: bool) -> Tensor:
    """The stage's own leaf for input ``x``, carrying a gradient if ``x`` wants one."""
    if not x.requires_grad:
        return x.detach()
    # The first stage's inputs may be views of the caller's batch; a copy keeps a layer
    # that works in place from touching the caller's tensor.
    y = x.detach().clone() if first else x.detach()
    return y.requires_grad_(True)


def _aliases(leaves: list[Any]) -> list[Any]:
    """Non-leaf stand-ins for the leaves that want a gradient, which layers may modify."""
    return [_alias(x) if isinstance(x, Tensor) and x.requires_grad else x for x in leaves]


def _wanting(value: Any, wants: bool) -> Any:
    """``value`` with its floating tensors marked as wanting a gradient, if ``wants``."""
    if not wants or value is None:
        return value
    leaves, spec = flatten(value)
    return unflatten(
        [
            x.requires_grad_(True) if isinstance(x, Tensor) and _differentiable(x) else x
            for x in leaves
        ],
        spec,
    )


def _detach_all(leaves: list[Any]) -> list[Any]:
    return [x.detach() if isinstance(x, Tensor) else x for x in leaves]


def _detached(value: Any) -> Any:
    """``value`` with every tensor cut from the graph, still saying if it wants a grad."""
    if value is None:
        return None
    leaves, spec = flatten(value)
    return unflatten(
        [
            x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x
            for x in leaves
        ],
        spec,
    )


def _tensors(result: tuple[Any, dict[SkipKey, Any]]) -> list[Tensor]:
    """The tensors a cell gave out, in the order their gradients come back."""
    output, outbound = result
    tensors = [x for x in flatten(output)[0] if isinstance(x, Tensor)]
    for skip in outbound.values():
        tensors += [x for x in flatten(skip)[0] if isinstance(x, Tensor)]
    return tensors


# Splitting a backward into B and W.

# W's work: engine calls, each from roots (a tensor or a node's input, with the gradient
# it starts from) to the leaves it fills.
_Plan: TypeAlias = list[tuple[list[tuple[Any, Tensor]], list[Tensor]]]


def _backward_inputs(pairs: Sequence[tuple[Tensor, Tensor | None]], inputs: list[Tensor]) -> _Plan:
    """Backpropagate ``pairs`` to ``inputs`` only; return the plan of W, which finishes.

    Where the way to the inputs branches off towards weights, the node there gets its
    gradient recorded; W resumes from each such node towards the weights of its own
    branches, one engine call per node (a call from two nodes at once would count
    twice the weights that the upper one reaches through the lower one).
    """
    outputs = [y for y, _ in pairs]
    grads = [g for _, g in pairs]
    whole: _Plan = [([(y, _ones_if_none(y, g)) for y, g in pairs], [])]
    if not _RESUMABLE:  # pragma: no cover - torch < 2.4
        torch.autograd.backward(outputs, grads, inputs=inputs, retain_graph=True)
        whole[0][1].extend(_Graph(outputs, inputs).weights)
        return whole
    from torch.autograd.graph import GradientEdge

    graph = _Graph(outputs, inputs)
    captured: dict[Any, tuple[Tensor | None, ...]] = {}
    handles = [node.register_prehook(_capture(captured, node)) for node, _ in graph.branches]
    try:
        torch.autograd.backward(outputs, grads, inputs=inputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    if graph.tangled:
        # A weight reached both from a branch and, further down, from the way to the
        # inputs (a weight used twice): resume from the outputs instead, as before 2.4.
        whole[0][1].extend(graph.weights)
        return whole
    plan: _Plan = []
    for node, own in graph.branches:
        received = captured.get(node, ())
        roots = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
        if roots:
            plan.append((roots, [leaf.variable for leaf in own]))
    direct = [
        (y, _ones_if_none(y, g))
        for (y, g), node in zip(pairs, graph.starts, strict=True)
        if not graph.reaches_input[node] and graph.below[node]
    ]
    if direct:  # outputs that do not depend on the inputs at all
        leaves = set().union(*(graph.below[node] for node in graph.starts))
        plan.append((direct, [leaf.variable for leaf in leaves]))
    return plan


def _ones_if_none(y: Tensor, g: Tensor | None) -> Tensor:
    return g if g is not None else torch.ones_like(y)


def _capture(
    captured: dict[Any, tuple[Tensor | None, ...]], node: Any
) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


class _Graph:
    """A stage's backward graph, seen from its outputs: what reaches inputs or weights.

    ``below[node]`` is the set of weight leaves (AccumulateGrad nodes, other than the
    inputs') that ``node`` leads to. ``branches`` are the nodes on the way to the inputs
    with an edge that leaves that way towards weights, each with the weights reached
    through such edges. ``tangled`` says that one of those weights is also reached
    through the edges that stay on the way to the inputs.
    """

    def __init__(self, outputs: list[Tensor], inputs: list[Tensor]) -> None:
        from torch.autograd.graph import get_gradient_edge

        self.starts = [get_gradient_edge(y).node for y in outputs]
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        self.reaches_input: dict[Any, bool] = {}
        self.below: dict[Any, frozenset[Any]] = {}
        self.branches: list[tuple[Any, frozenset[Any]]] = []
        self.tangled = False
        weights: list[Any] = []
        for node in _post_order(self.starts):
            if node in input_nodes:
                self.reaches_input[node], self.below[node] = True, frozenset()
                continue
            if hasattr(node, "variable"):  # AccumulateGrad: a leaf that is not an input
                self.reaches_input[node], self.below[node] = False, frozenset([node])
                weights.append(node)
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            on_way = [c for c in children if self.reaches_input[c]]
            off_way = [c for c in children if not self.reaches_input[c]]
            self.reaches_input[node] = bool(on_way)
            self.below[node] = frozenset().union(*(self.below[c] for c in children))
            if on_way:
                own = frozenset().union(*(self.below[c] for c in off_way))
                if own:
                    self.branches.append((node, own))
                    if own & frozenset().union(*(self.below[c] for c in on_way)):
                        self.tangled = True
        self.weights = [node.variable for node in weights]


def _post_order(starts: list[Any]) -> Iterator[Any]:
    """Every node reachable from ``starts``, each after all the nodes it leads to."""
    seen: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(node, False) for node in reversed(starts)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            yield node
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
