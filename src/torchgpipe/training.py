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
torch 2.4, whose engine cannot start from a node, ``W`` backpropagates from the stage's
outputs to its weights again.)
"""

from __future__ import annotations

from typing import Any

from torchgpipe.executor import Step, StepRun
from torchgpipe.gpipe import GPipe
from torchgpipe.microbatch import gather, scatter
from torchgpipe.schedules import (
    Schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)
from torchgpipe.steps import (
    LossFn,
    Reduction,
    StepResult,
    TableFor,
    TableSteps,
    batch_size,
    loss_weights,
    weighted,
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
        sizes = [batch_size(b) for b in batches]
        target_sizes = [batch_size(t) for t in targets]
        if target_sizes != sizes:
            raise ValueError(
                f"the target splits into micro-batches of {target_sizes} "
                f"samples but the input into {sizes}; give them the same batch size"
            )
        table = self.table(m)
        weights = loss_weights(sizes, self.reduction)
        model.expect_micro_batches(m)
        stages = model.stages_for(m)
        step = Step(len(stages.inbound), m)
        run = StepRun(stages, self.loss_fn, table, step, batches, targets, weights)
        devices = model.devices
        try:
            model.workers.run(
                run, "all", lambda action: f"stage {action.stage} on {devices[action.stage]}"
            )
        finally:
            run.hand_over()
        losses = [x for x in step.losses if x is not None]
        return StepResult(
            loss=weighted(weights, losses),
            losses=losses,
            output=gather(step.outputs),
            peak_held=tuple(step.peak),
        )


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
