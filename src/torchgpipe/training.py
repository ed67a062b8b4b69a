"""Training steps that follow a schedule table: GPipe, 1F1B, interleaved 1F1B, ZB-H1.

``GPipe.forward`` runs the ``F`` actions of the GPipe table and leaves the backward to
``loss.backward()``. Here each rank's worker runs all its actions from a
:class:`~torchgpipe.schedules.Schedule`: the forward ``F`` of a stage on a micro-batch,
its backward ``B``, and, when the table splits the backward, ``B`` for the input
gradient and ``W`` for the weight gradient, so 1F1B can start a micro-batch's backward
before the last forward has run. Since backward starts inside the step, the step owns
the loss::

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
torch 2.10, ``W`` backpropagates from the stage's outputs to its weights again:
``split_backward.RESUMABLE``.)
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

from torchgpipe.schedules import (
    Schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)
from torchgpipe.stages import StageHolder
from torchgpipe.steps import (
    LossFn,
    Reduction,
    StepResult,
    TableFor,
    TableSteps,
)

__all__ = [
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble",
    "StepResult",
]


class PipelineSchedule(TableSteps):
    """Runs training steps over the stages of a pipeline, in a schedule's order.

    One class for one process and for several: ``pipe`` is a
    :class:`~torchgpipe.GPipe` (every stage here, each rank on a worker thread) or a
    :class:`~torchgpipe.distributed.PipelineStage` (this process's stages; build the
    same schedule in every process).

    Args:
        pipe: the stages: a GPipe's partitions, or a PipelineStage's. Its ``chunks`` is
            the number of micro-batches, its ``checkpoint`` mode decides which cells
            recompute in backward (in training mode).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a scalar tensor; it runs
            where the last stage runs.
        table: the schedule: a :class:`~torchgpipe.schedules.Schedule` for exactly the
            number of micro-batches each step will have, or a function from that number
            to one (``lambda m: one_f_one_b(n, m)``). Stage ``s`` is partition ``s``. In
            one process the stages of one rank must share a device; across processes
            stage ``s`` runs on rank ``s % R`` of the ``R`` processes.
        reduction: ``'mean'`` (the default) or ``'sum'``: how the batch's loss is made
            of the micro-batches' (see the module's documentation).

    Raises:
        TypeError: ``pipe`` is neither, ``loss_fn`` not callable, or ``table`` neither a
            Schedule nor a function of one argument (its text: ``Schedule.parse``).
        ValueError: an unknown reduction, or a table that does not fit the stages
            (another number of stages or micro-batches, a rank that runs no stage).
        ScheduleError: a table that is not valid (see ``Schedule.validate``).
    """

    def __init__(
        self,
        pipe: StageHolder,
        loss_fn: LossFn,
        table: Schedule | TableFor,
        *,
        reduction: Reduction = "mean",
    ) -> None:
        self.pipe = _check_pipe(pipe)
        self._adopt(loss_fn, _check_table_arg(table), reduction)

    def _check_table(self, table: Schedule, m: int) -> None:
        if not isinstance(table, Schedule):  # what a table function returned
            raise TypeError(
                f"the table function returned {type(table).__name__} {table!r:.60} for "
                f"m = {m} micro-batches, not a Schedule; return one, such as "
                f"one_f_one_b(n, m) or Schedule.parse(text)"
            )
        n = len(self.pipe.balance)
        if table.stages != n:
            raise ValueError(
                f"the schedule has {table.stages} stages but the balance {n} partitions; "
                f"each partition is one stage"
            )
        _check_every_rank_runs_a_stage(table)
        k, chunks = table.micro_batches, self.pipe.chunks
        if k != m:
            # m is chunks, or the batch size where the batch is smaller than chunks.
            fix = (
                f"a batch of at least {k} samples"
                if k == chunks
                # m < chunks: the batch, of m samples, is what gave fewer micro-batches.
                else f"chunks={k}"
                + (f" and a batch of at least {k} samples" if m < min(k, chunks) else "")
            )
            raise ValueError(
                f"the schedule is for {k} micro-batches but the batch splits into {m} "
                f"(chunks={chunks}); pass a function of the number of micro-batches "
                f"(such as lambda m: one_f_one_b(n, m)), or use {fix}"
            )
        table.validate()
        self.pipe.check_table(table)

    def step(self, input: Any = None, target: Any = None) -> StepResult:
        """Forward ``input``, compute the loss against ``target``, and backpropagate.

        Gradients are accumulated into ``.grad`` as ``loss.backward()`` would; zero
        them between steps as usual. The step records gradients even under
        ``torch.no_grad()``. Across processes, call it in every process at once: rank 0
        gives ``input`` and the last rank ``target`` (the others may pass None); every
        rank gets the loss, and the output is the last rank's (None elsewhere).

        Raises:
            TypeError, ValueError: the input or target is missing, cannot be split into
                the same micro-batches, or the schedule does not fit them.
            BaseException: whatever a layer or ``loss_fn`` raised, with a note naming
                the action (``"1B3"``: stage 1's backward of micro-batch 3). Across
                processes, on the other ranks a
                :class:`~torchgpipe.distributed.RemoteError` naming it.
        """
        return self.pipe.run_step(self, input, target)

    def forward_only(self, input: Any = None) -> Any:
        """The forward of ``input``, for validation or serving: no loss, no backward.

        Nothing is kept for a backward (the forward runs under ``torch.no_grad()``,
        nothing is checkpointed). In one process it returns the output, as
        ``model(input)`` under ``no_grad`` does; across processes, call it in every
        process at once: rank 0 gives ``input``, the last rank gets the output (gathered
        from the micro-batches) and the others None. Put the model in ``eval()`` mode
        for dropout and batch norm to act as in evaluation.

        Raises:
            TypeError, ValueError: the input is missing, or cannot be split.
            BaseException: what a layer raised, with a note naming the action; across
                processes, a :class:`~torchgpipe.distributed.RemoteError` on the others.
        """
        return self.pipe.run_forward(self, input)


class ScheduleGPipe(PipelineSchedule):
    """Fill and drain: all forwards, then all backwards (each stage runs its own).

    Every stage holds all ``m`` micro-batches at the turn (fewer bytes each when
    checkpointed). See :class:`PipelineSchedule` for the arguments.
    """

    def __init__(
        self, pipe: StageHolder, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _check_pipe(pipe).schedule_ranks(1, "ScheduleGPipe")
        super().__init__(pipe, loss_fn, lambda m: gpipe(n, m), reduction=reduction)


class Schedule1F1B(PipelineSchedule):
    """1F1B: after a warm-up, each stage alternates one forward and one backward.

    The bubble is GPipe's, but stage ``s`` holds at most ``n - s`` micro-batches
    instead of ``m``. See :class:`PipelineSchedule` for the arguments.
    """

    def __init__(
        self, pipe: StageHolder, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _check_pipe(pipe).schedule_ranks(1, "Schedule1F1B")
        super().__init__(pipe, loss_fn, lambda m: one_f_one_b(n, m), reduction=reduction)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: each rank runs ``virtual_stages`` partitions, round robin.

    With ``P`` partitions and ``v = virtual_stages``, there are ``P / v`` ranks and rank
    ``r`` runs partitions ``r, r + P / v, ...`` (in one process they must share a
    device). The bubble shrinks by ``v``; the number of micro-batches must be a
    multiple of the ranks. ``virtual_stages`` defaults to 2 for a GPipe, and to the
    stages each process holds for a PipelineStage (which is the only value it takes).

    Raises:
        ValueError: ``virtual_stages`` does not fit the stages, or ``chunks`` is not a
            multiple of the number of ranks.
    """

    def __init__(
        self,
        pipe: StageHolder,
        loss_fn: LossFn,
        *,
        virtual_stages: int | None = None,
        reduction: Reduction = "mean",
    ) -> None:
        pipe = _check_pipe(pipe)
        v = pipe.default_virtual_stages() if virtual_stages is None else virtual_stages
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            v = int(v)  # a NumPy integer, as the table builders take
        n = len(pipe.balance)
        if virtual_stages is None and n and n % v:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"ScheduleInterleaved1F1B: virtual_stages defaults to {v} partitions per "
                f"rank, which does not divide the {n} partitions; pass virtual_stages= one "
                f"of {divisors}, or a balance of a multiple of {v} partitions"
            )
        ranks = pipe.schedule_ranks(v, "ScheduleInterleaved1F1B")
        if pipe.chunks % ranks:
            raise ValueError(
                f"interleaving sends micro-batches in groups of {ranks} (one per rank); "
                f"use chunks a multiple of {ranks}, got {pipe.chunks}"
            )
        self.virtual_stages = v

        def table(m: int) -> Schedule:
            if m >= pipe.chunks and m % ranks:  # chunks changed since (else a short batch)
                raise ValueError(
                    f"interleaving sends micro-batches in groups of {ranks} (one per rank), "
                    f"but chunks is now {pipe.chunks}; set chunks to a multiple of {ranks}"
                )
            return interleaved_one_f_one_b(ranks, m, v)

        super().__init__(pipe, loss_fn, table, reduction=reduction)


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1: 1F1B with each backward split into input (``B``) and weight (``W``) parts.

    ``W`` is off the critical path, so stages run it where they would otherwise wait:
    with equal costs a third of 1F1B's idle time, within 1F1B's peak memory. See
    :class:`PipelineSchedule` for the arguments.
    """

    def __init__(
        self, pipe: StageHolder, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _check_pipe(pipe).schedule_ranks(1, "ScheduleZeroBubble")
        super().__init__(pipe, loss_fn, lambda m: zero_bubble_h1(n, m), reduction=reduction)


def _check_table_arg(table: object) -> Schedule | TableFor:
    """``table`` if it is a Schedule or a function of one argument, else a TypeError."""
    if isinstance(table, Schedule):
        return table
    if isinstance(table, str):
        raise TypeError(
            f"table is text ({table!r:.40}); read it with "
            f"torchgpipe.schedules.Schedule.parse(text) and pass the Schedule"
        )
    if not callable(table):
        raise TypeError(
            f"table must be a torchgpipe.schedules.Schedule or a function from the number "
            f"of micro-batches to one (lambda m: one_f_one_b(n, m)), got "
            f"{type(table).__name__} {table!r:.40}"
        )
    try:
        inspect.signature(table).bind(1)
    except TypeError:  # not callable with m alone: a builder of several arguments?
        name = getattr(table, "__name__", type(table).__name__)
        raise TypeError(
            f"table is called with one argument, the number of micro-batches m, but "
            f"{name}{inspect.signature(table)} cannot be; pass a function of m alone, "
            f"such as lambda m: one_f_one_b(n, m)"
        ) from None
    except ValueError:  # no signature to read (some built-ins): trust it
        pass
    return table


def _check_every_rank_runs_a_stage(table: Schedule) -> None:
    """Refuse a table with a rank that runs no stage (as any with more ranks than stages).

    Such a table is valid as a table (``Schedule.validate``: an empty rank waits for
    nothing), but a rank is something of the holder's: a worker of a GPipe, one per
    partition (none for a rank past the last), or a process of the PipelineStages.
    Refused here, before the table reaches the holder's check or any worker.

    Raises:
        ValueError: naming the idle ranks, the counts and what to do.
    """
    busy = set(table.placement)
    idle = [r for r in range(len(table.ranks)) if r not in busy]
    if idle:
        n, ranks = table.stages, len(table.ranks)
        raise ValueError(
            f"the schedule has {ranks} ranks but places its {n} stages on only "
            f"{len(busy)} of them (placement {table.placement}): rank"
            f"{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} "
            f"run{'' if len(idle) > 1 else 's'} no stage. Each rank of a table is a "
            f"worker of the GPipe or a process of the PipelineStages, and must run a stage "
            f"(so at most {n} ranks for {n} stages); drop the ranks without actions, or pass "
            f"Schedule(..., placement=...) that puts a stage on each"
        )


def _check_pipe(pipe: Any) -> StageHolder:
    if not isinstance(pipe, StageHolder):
        raise TypeError(
            f"a schedule steps a torchgpipe.GPipe (one process) or a "
            f"torchgpipe.distributed.PipelineStage (several), got {type(pipe).__name__}; "
            f"wrap the nn.Sequential in one of them first"
        )
    return pipe
