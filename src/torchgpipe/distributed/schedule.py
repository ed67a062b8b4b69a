"""Training steps across processes, in the order of a schedule table.

The same tables and the same actions as :mod:`torchgpipe.training`, with each process
running the actions of its own rank: a step is ``schedule.step(input, target)`` in
every process, where rank 0 gives the input and the last rank the target (others may
pass None). The step goes like this on each rank::

    rank 0: scatter the input ── start(m, sizes, table) ──▶ every other rank
    every rank: its actions; messages to the ranks of other stages (exchange.py)
    every rank: end(status, losses from the last rank) ──▶ every other rank
    every rank: raise the step's failure, if any, or return its result
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgpipe.distributed.exchange import Exchange, describe
from torchgpipe.distributed.stage import PipelineStage
from torchgpipe.executor import Step, StepRun
from torchgpipe.mailbox import Stopped, add_note, real_failures, where
from torchgpipe.microbatch import gather, scatter
from torchgpipe.schedules import (
    Action,
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
]


class PipelineSchedule(TableSteps):
    """Runs training steps of a pipeline over processes in a schedule's order.

    The counterpart of :class:`torchgpipe.PipelineSchedule` for a
    :class:`~torchgpipe.distributed.PipelineStage`: build it in every process with the
    same table.

    Args:
        stage: this process's stages.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a scalar tensor; it
            runs on the last rank.
        table: a :class:`~torchgpipe.schedules.Schedule` for the number of
            micro-batches of every step, or a function from that number to one. Stage
            ``s`` must run on rank ``s % R`` of the ``R`` processes.
        reduction: ``'mean'`` (the default) or ``'sum'``, as for the single process.

    Raises:
        TypeError: ``stage`` is not a PipelineStage, or ``loss_fn`` not callable.
        ValueError: an unknown reduction, or a table that does not fit the stages.
        ScheduleError: a table that is not valid.
    """

    def __init__(
        self,
        stage: PipelineStage,
        loss_fn: LossFn,
        table: Schedule | TableFor,
        *,
        reduction: Reduction = "mean",
    ) -> None:
        self.stage = _check_stage(stage)
        self._adopt(loss_fn, table, reduction)

    def _check_table(self, table: Schedule, m: int) -> None:
        stage = self.stage
        n, world = len(stage.balance), stage.world_size
        if table.stages != n:
            raise ValueError(
                f"the schedule has {table.stages} stages but the balance {n} partitions; "
                f"each partition is one stage"
            )
        if len(table.ranks) != world:
            raise ValueError(
                f"the schedule runs on {len(table.ranks)} ranks but the pipeline has "
                f"{world} processes; with {n // world} stages per process use "
                f"{'ScheduleInterleaved1F1B' if n > world else 'a one-stage-per-rank schedule'}"
            )
        misplaced = [s for s in range(n) if table.placement[s] != s % world]
        if misplaced:
            raise ValueError(
                f"the schedule puts stages {misplaced} on ranks "
                f"{[table.placement[s] for s in misplaced]}, but stage s runs on rank "
                f"s % {world}; use a table with the default placement"
            )
        if table.micro_batches != m:
            raise ValueError(
                f"the schedule is for {table.micro_batches} micro-batches but the batch "
                f"splits into {m} (chunks={stage.chunks}); pass a function of the number "
                f"of micro-batches, or a batch of at least {table.micro_batches}"
            )
        table.validate()

    def step(self, input: Any = None, target: Any = None) -> StepResult:
        """Run one step of the pipeline: call it in every process at once.

        Rank 0 gives ``input`` and the last rank ``target`` (as in one process, each
        split into micro-batches); the others may pass None. Every rank gets the loss
        and the micro-batches' losses; ``output`` is the model's output on the last
        rank and None elsewhere; ``peak_held`` covers every stage.

        Raises:
            ValueError: rank 0 got no input or the last rank no target, or they do not
                split into the same micro-batches.
            BaseException: on the rank where a layer or ``loss_fn`` raised, that
                exception, with a note naming the action.
            RemoteError: on the other ranks, the failure of the rank where it started,
                or the loss of a process.
        """
        stage = self.stage
        exchange = stage.exchange()
        step: Step | None = None
        m: int | None = None
        sizes: list[int] = []
        failure: tuple[BaseException, Action | None] | None = None
        try:
            m, sizes, table, batches, targets = self._start(exchange, input, target)
            stage.expect_micro_batches(m)
            step = Step(len(stage.balance), m)
            weights = loss_weights(sizes, self.reduction)
            run = StepRun(
                stage.stages_for(m),
                self.loss_fn,
                table,
                step,
                batches,
                targets,
                weights,
                post=exchange,
            )
            try:
                run.rank(stage.rank)
            finally:
                run.hand_over()
            real = real_failures(exchange)
            if real:
                failure = real[0]
        except Stopped:
            pass
        except BaseException as error:
            failure = (error, None)
        losses: list[Tensor] = []
        if step is not None and stage.is_last and failure is None and not exchange.halted:
            losses = [x for x in step.losses if x is not None]
        exchange.finish(
            {
                "failed": failure is not None or exchange.halted,
                "error": None
                if failure is None
                else describe(failure[0], failure[1], stage.rank, stage.stages, m),
                "peaks": {s: step.peak[s] for s in stage.stages} if step is not None else {},
            },
            [torch.stack(losses).cpu()] if losses else [],
        )
        if failure is not None:
            raised, action = failure
            if action is not None:
                add_note(
                    raised,
                    where(
                        action, f"stage {action.stage} on rank {stage.rank}, {stage.device}", m or 0
                    ),
                )
            raise raised
        remote = exchange.remote_failure()
        if remote is not None:
            raise remote
        assert step is not None  # no failure: the step ran
        assert m is not None
        return self._result(exchange, step, sizes, m)

    def _start(
        self, exchange: Exchange, input: Any, target: Any
    ) -> tuple[int, list[int], Schedule, list[Any], list[Any]]:
        """Agree on the step's micro-batches and table; split the input and target."""
        stage = self.stage
        batches: list[Any] = []
        if stage.is_first:
            if input is None:
                raise ValueError(
                    f"rank {stage.rank} runs stage 0 and needs the input: pass it as "
                    f"schedule.step(input, target)"
                )
            batches = scatter(input, stage.chunks)
            m, sizes = len(batches), [batch_size(b) for b in batches]
            table = self.table(m)
            for peer in exchange.peers:
                exchange.send(peer, ("start",), (m, sizes, table.text()))
        else:
            m, sizes, text = exchange.take(("start",))
            table = self.table(m)
            if table.text() != text:
                raise ValueError(
                    f"rank {stage.rank} follows a different schedule from rank 0 (for "
                    f"{m} micro-batches); build the same schedule in every process"
                )
        targets: list[Any] = []
        if stage.is_last:
            if target is None:
                raise ValueError(
                    f"rank {stage.rank} runs the last stage and needs the target: pass it "
                    f"as schedule.step(input, target)"
                )
            targets = scatter(target, m)
            target_sizes = [batch_size(t) for t in targets]
            if target_sizes != sizes:
                raise ValueError(
                    f"the target splits into micro-batches of {target_sizes} samples but "
                    f"the input into {sizes}; give them the same batch size"
                )
        return m, sizes, table, batches, targets

    def _result(self, exchange: Exchange, step: Step, sizes: list[int], m: int) -> StepResult:
        stage = self.stage
        weights = loss_weights(sizes, self.reduction)
        peaks = dict.fromkeys(range(len(stage.balance)), 0)
        peaks.update({s: step.peak[s] for s in stage.stages})
        for status, _ in exchange.ends.values():
            peaks.update({int(s): p for s, p in status["peaks"].items()})
        if stage.is_last:
            losses = [x for x in step.losses if x is not None]
            output = gather(step.outputs)
        else:
            last = (len(stage.balance) - 1) % stage.world_size
            _, tensors = exchange.ends[last]
            losses = list(tensors[0].to(stage.device).unbind()) if tensors else []
            output = None
        return StepResult(
            loss=weighted(weights, losses),
            losses=losses,
            output=output,
            peak_held=tuple(peaks[s] for s in range(len(stage.balance))),
        )


class ScheduleGPipe(PipelineSchedule):
    """Fill and drain, over processes. See :class:`PipelineSchedule` for the arguments."""

    def __init__(
        self, stage: PipelineStage, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _one_stage_per_rank(stage, "ScheduleGPipe")
        super().__init__(stage, loss_fn, lambda m: gpipe(n, m), reduction=reduction)


class Schedule1F1B(PipelineSchedule):
    """1F1B over processes. See :class:`PipelineSchedule` for the arguments."""

    def __init__(
        self, stage: PipelineStage, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _one_stage_per_rank(stage, "Schedule1F1B")
        super().__init__(stage, loss_fn, lambda m: one_f_one_b(n, m), reduction=reduction)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: each process runs ``stage.virtual_stages`` stages, round robin.

    The number of micro-batches must be a multiple of the number of processes. See
    :class:`PipelineSchedule` for the arguments.

    Raises:
        ValueError: ``chunks`` is not a multiple of the number of processes.
    """

    def __init__(
        self, stage: PipelineStage, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        ranks = _check_stage(stage).world_size
        if stage.chunks % ranks:
            raise ValueError(
                f"interleaving sends micro-batches in groups of {ranks} (one per process); "
                f"use chunks a multiple of {ranks}, got {stage.chunks}"
            )
        v = stage.virtual_stages
        super().__init__(
            stage, loss_fn, lambda m: interleaved_one_f_one_b(ranks, m, v), reduction=reduction
        )


class ScheduleZeroBubble(PipelineSchedule):
    """ZB-H1 over processes: backward split into ``B`` and ``W``.

    See :class:`PipelineSchedule` for the arguments.
    """

    def __init__(
        self, stage: PipelineStage, loss_fn: LossFn, *, reduction: Reduction = "mean"
    ) -> None:
        n = _one_stage_per_rank(stage, "ScheduleZeroBubble")
        super().__init__(stage, loss_fn, lambda m: zero_bubble_h1(n, m), reduction=reduction)


def _one_stage_per_rank(given: Any, name: str) -> int:
    """The number of stages, which must be the number of processes."""
    stage = _check_stage(given)
    if stage.virtual_stages != 1:
        raise ValueError(
            f"{name} runs one stage per process, but the balance gives each of the "
            f"{stage.world_size} processes {stage.virtual_stages}; use "
            f"ScheduleInterleaved1F1B, or a balance of {stage.world_size} partitions"
        )
    return stage.world_size


def _check_stage(stage: Any) -> PipelineStage:
    if not isinstance(stage, PipelineStage):
        raise TypeError(
            f"stage must be a torchgpipe.distributed.PipelineStage, got "
            f"{type(stage).__name__}; for a model in one process use torchgpipe's own "
            f"schedules with a GPipe"
        )
    return stage
