"""A step across processes: each runs its own rank's actions of the schedule's table.

The schedule classes are :mod:`torchgpipe.training`'s, the same for one process and
for several; given a :class:`PipelineStage`, their ``step(input, target)`` comes here
(``PipelineStage.run_step``), in every process at once, where rank 0 gives the input
and the last rank the target (others may pass None). The step goes like this on each
rank::

    rank 0: scatter the input
            ── start(m, sizes, table, kind, key, static, seed, reduction) ──▶ the others
    every rank: its actions; messages to the ranks of other stages (exchange.py)
    every rank: end(status, losses from the last rank) ──▶ every other rank
    every rank: raise the step's failure, if any; else the ties' sums, the backward
                into the caller's graph, the parameters' hooks, then, if any rank's
                end said it has such work: end(status) ──▶ every other rank again
    every rank: raise the first failure, if any, or return its result

That work can fail on one rank alone (a hook that refuses a gradient that is not
finite, a caller's graph already freed): the second end (``_settle``) tells the others,
so every rank fails, the others with a ``RemoteError`` naming it. A step with no hook
and no graph before the pipeline on any rank skips it (what the ties' sum needs is made
before the first end, where a failure fails the step; the sum then only moves values).

The start names the table by its text, or None when it is the last step's; ``kind``
says a step or a forward only; ``reduction`` is the schedule's (the other ranks refuse
a step whose table or reduction is not theirs: the losses and gradients would differ).
``key`` is a digest of the layout of the step's input (empty on a GPU wire, unless
``PipelineStage(static_shapes=True)``), and ``static`` says that a step on an input so
laid out ended well: this one reuses its messages' layouts, and a value laid out
otherwise fails its action (static shapes) or moves to the side channel
(``transfers.py``). Every rank remembers those of the last :data:`LAYOUTS` layouts
(alternating batch sizes stay fast), except a layout whose step moved a value (every
rank's end says how many it moved): the next step on it sends metadata, so a value
that changes at every step costs one move every other step.

``seed`` is the step's, drawn by rank 0 from its default generator as one process's
step does (every rank's cells draw from it); every other rank draws one and drops it.

A process that makes another call meanwhile (``stage.clip_grad_norm_()``: ``collect.py``)
opens it with a value of another tag (``exchange.py``): a rank waiting for the start
stops at once; a process that finds rank 0's start instead of the value it waits for
joins the step as a rank that failed at its start (:func:`join_step`), issuing the
transfers whose metadata reached it (every planned one, frames known). Every rank then
fails, naming the other calls (``checks.mismatch``), and the group is left clean.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from torchgpipe.distributed.channel import TransportError
from torchgpipe.distributed.checks import (
    PIPELINES,
    CrossedPipelines,
    agree_with_start,
    crossed,
    mismatch,
)
from torchgpipe.distributed.errors import RemoteError, describe, rank_name
from torchgpipe.distributed.exchange import Exchange, Key
from torchgpipe.distributed.plan import RankPlan, layout_signature, parsed_table, plan
from torchgpipe.distributed.stage import PipelineStage
from torchgpipe.executor import Step, StepRun
from torchgpipe.grad_hooks import hooked, hooks_once
from torchgpipe.mailbox import Stopped, add_note, real_failures, where
from torchgpipe.microbatch import gather
from torchgpipe.rng import draw_seed
from torchgpipe.schedules import Action, Schedule
from torchgpipe.steps import (
    StepResult,
    TableSteps,
    batch_size,
    loss_weights,
    micro_batches,
    refuse_inference_mode,
    weighted,
)

__all__ = ["run_step"]

START: Key = ("start",)  # the key of rank 0's start: its tag, "start", opens a step


def run_step(stage: PipelineStage, steps: TableSteps, input: Any, target: Any) -> StepResult:
    """This process's part of one step of ``steps`` (``PipelineStage.run_step``).

    Raises:
        ValueError: rank 0 got no input or the last rank no target, or they do not
            split into the same micro-batches.
        BaseException: on the rank where a layer, ``loss_fn``, a parameter's hook or the
            backward into the caller's graph raised, that exception, with a note.
        RemoteError: on the other ranks, the failure of the rank where it started, or
            the loss of a process.
    """
    params = list(stage.parameters())
    hooks = any(hooked(p, users_only=True) for p in params)  # silenced in the step
    ran: _Ran | None = None
    what, failure = "", None
    try:
        # The parameters' own hooks run once, after the ties are summed (grad_hooks.py).
        with hooks_once(params, stage.tie_groups):
            ran = _run(stage, steps, input, target, forward_only=False, hooks=hooks)
            what = "the sum of the tied weights' gradients"
            try:  # every rank's step ended well: every holder of a tie takes part
                stage.reduce_tied(ran.tie_sums, ran.exchange.ends)  # a failed step: dropped
            except TransportError as error:
                raise _lost_in_ties(ran.exchange, error) from error
            # Only now the caller's graph (a layer before the pipeline, a target that
            # wants a gradient) gets its gradients: a failed step leaves it as it is.
            what = "the backward into the caller's graph"
            assert ran.run is not None
            ran.run.backward_upstream()
            what = "the parameters' hooks"
    except BaseException as error:
        # ran None: the step failed, as every rank knows from its end. Not settled: no
        # rank had work after the end, or this process is the pipeline's only one.
        if ran is None or not ran.settle:
            raise
        failure = error
    if ran.settle:
        _settle(stage, failure, what)
    return _result(stage, steps, ran)


def _settle(stage: PipelineStage, failure: BaseException | None, what: str) -> None:
    """End the step again with every rank; raise this rank's ``failure`` (in ``what``).

    Or another rank's, as a ``RemoteError``. Only ends travel, on the side channel.
    """
    exchange = stage.exchange()
    exchange.tag, exchange.call = "settle", "schedule.step()"
    error = None
    if isinstance(failure, RemoteError):  # a peer lost in the ties' sum: the cause
        exchange.lose(failure.rank, LOST_IN_TIES, gone=True)
    elif failure is not None:
        error = describe(failure, None, stage.rank, stage.stages, None)
        error["where"] = f" in {what}, after the step had ended well on every rank"
    exchange.finish({"failed": failure is not None, "error": error}, [])
    if failure is not None:
        where = f"in {what} on rank {stage.rank}, after the step had ended well on every rank"
        add_note(failure, f"torchgpipe: raised {where}; every other rank raises RemoteError")
        raise failure
    remote = exchange.remote_failure()
    if remote is not None:
        raise remote


def _lost_in_ties(exchange: Exchange, error: TransportError) -> RemoteError:
    """A process lost while the tied weights' gradients were summed with it."""
    peer = error.peer
    stages = exchange.stages[peer] if 0 <= peer < len(exchange.stages) else ()
    who = rank_name(peer, exchange.transport.global_ranks) if peer >= 0 else f"rank {peer}"
    return RemoteError(
        f"{who} (stages {list(stages)}) {LOST_IN_TIES}. The transport said: {error}",
        rank=peer,
        stages=stages,
    )


LOST_IN_TIES = (
    "died or cannot be reached while the tied weights' gradients were summed, after a "
    "step that ended well on every rank; see its own output for the cause"
)


def run_forward(stage: PipelineStage, steps: TableSteps, input: Any) -> Any:
    """This process's part of a forward-only step; the output on the last rank.

    The ``F`` actions of the schedule's table, under ``no_grad``, nothing checkpointed.

    Raises:
        As :func:`run_step`.
    """
    return _run(stage, steps, input, None, forward_only=True).output


@dataclass(frozen=True)
class _Ran:
    """A step that ended well on every rank, as this rank saw it."""

    exchange: Exchange
    step: Step
    sizes: list[int]
    m: int
    output: Any  # the micro-batches' outputs gathered, on the last rank; None elsewhere
    run: StepRun | None  # what hands the input's gradients back (None: nothing ran here)
    settle: bool  # a rank has work after the end that may fail there alone (_settle)
    tie_sums: list[Any]  # what the tied weights' sum needs (PipelineStage.prepare_tied)


def _run(
    stage: PipelineStage,
    steps: TableSteps,
    input: Any,
    target: Any,
    *,
    forward_only: bool,
    hooks: bool = False,
) -> _Ran:
    """Run this rank's actions, end the step with every rank, raise its failure if any.

    The last rank gathers the output before the ranks agree on how the step ended: one
    that does not gather fails the step on every rank. Its end says whether this rank
    has work after it that may fail here alone (the caller's graph, ``hooks`` of its
    parameters): then every rank settles.
    """
    exchange = stage.exchange()
    exchange.call = "schedule.forward_only()" if forward_only else "schedule.step()"
    output: Any = None
    step: Step | None = None
    m: int | None = None
    sizes: list[int] = []
    failure: tuple[BaseException, Action | None] | None = None
    ran_here: StepRun | None = None
    tie_sums: list[Any] = []
    try:
        m, sizes, table, batches, targets, seed = _start(
            stage, steps, exchange, input, target, forward_only=forward_only, shapes=stage.shapes
        )
        finish = stage.expect_micro_batches(m)
        step = Step(len(stage.balance), m)
        stages = stage.stages_for(m)
        if forward_only:  # a plain call per cell: no graph, nothing to recompute
            stages = replace(stages, checkpoint_stop=0)
        # The run captures the caller's grad mode: off, for a forward only.
        with torch.no_grad() if forward_only else nullcontext():
            run = StepRun(
                stages,
                None if forward_only else steps.loss_fn,
                table,
                step,
                batches,
                targets,
                loss_weights(sizes, steps.reduction),
                post=exchange,
                connected=forward_only,
                seed=seed,
            )
            try:
                run.rank(stage.rank, "forward" if forward_only else "all")
            finally:
                run.hand_over()
        real = real_failures(exchange)
        if real:
            failure = real[0]
        elif not exchange.halted:
            ran_here = run
            if finish is not None:  # deferred batch norm (after hand_over: on CUDA too)
                finish()
            if stage.is_last:
                output = gather(step.outputs, stack_scalars=not forward_only)
            if not forward_only:  # memory short for the ties' sum fails the step here
                tie_sums = stage.prepare_tied()
    except Stopped:
        pass
    except BaseException as error:
        failure = (error, None)
    losses: list[Tensor] = []
    if step is not None and stage.is_last and failure is None and not exchange.halted:
        losses = [x for x in step.losses if x is not None]
    after = not forward_only and (hooks or (step is not None and bool(step.upstream)))
    if step is not None and (failure is not None or exchange.halted):
        step.drop()  # the activations go before the drain makes its buffers
    exchange.finish(
        {
            "failed": failure is not None or exchange.halted,
            "error": None
            if failure is None
            else describe(failure[0], failure[1], stage.rank, stage.stages, m),
            "peaks": {s: step.peak[s] for s in stage.stages} if step is not None else {},
            "after": after,
            "frozen": [s.frozen for s in tie_sums if s.frozen is not None],
            "tie_dtypes": dict(s.held for s in tie_sums if s.held is not None),
            "abandoned": stage.transport.abandoned,  # the others give theirs up too
        },
        [torch.stack(losses).cpu()] if losses else [],
    )
    remote = mismatch(exchange) or exchange.remote_failure()
    # Known frames: what a step that ended well sent and received, for the next ones.
    ended_well = failure is None and remote is None and step is not None
    # Every rank sees a step end alike, so every rank's memory holds the same layouts
    # (but a peer lost in the drain, after the ends, is seen there alone: rebuild then).
    if not ended_well and not (failure and isinstance(failure[0], CrossedPipelines)):
        stage.shapes.clear()  # (a crossed start failed another pipeline's step: _start)
    elif exchange.signature:
        stage.shapes.pop(exchange.signature, None)
        moved = exchange.moved + sum(status.get("moved", 0) for status, _ in exchange.ends.values())
        if not moved:  # else the next step on it sends metadata: a value changed
            stage.shapes[exchange.signature] = exchange.transfers.seen  # the latest last
        while len(stage.shapes) > LAYOUTS:
            del stage.shapes[next(iter(stage.shapes))]
    if failure is not None:
        raised, action = failure
        if action is not None:
            who = rank_name(stage.rank, stage.transport.global_ranks)
            place = f"stage {action.stage} on {who}, {stage.device}"
            add_note(raised, where(action, place, m or 0))
        raise raised
    if remote is not None:
        raise remote
    assert step is not None  # no failure: the step ran
    assert m is not None
    # Every rank sees every end: all agree whether to settle (one rank has none to tell).
    settle = after or any(status.get("after") for status, _ in exchange.ends.values())
    return _Ran(
        exchange, step, sizes, m, output, ran_here, settle and bool(exchange.peers), tie_sums
    )


def _start(
    stage: PipelineStage,
    steps: TableSteps,
    exchange: Exchange,
    input: Any,
    target: Any,
    *,
    forward_only: bool = False,
    shapes: dict[bytes, dict[Any, Any]],
) -> tuple[int, list[int], Schedule, list[Any], list[Any], int]:
    """Agree on the step's micro-batches, table and seed; split the input and target.

    Knowing rank 0's table, this rank issues its share of the plan's transfers, failing or not.
    """
    batches: list[Any] = []
    n, ranks = len(stage.balance), stage.world_size  # a forward-only table's (steps.py)
    if stage.is_first:
        if input is None:
            call = "forward_only(input)" if forward_only else "step(input, target)"
            raise ValueError(
                f"rank {stage.rank} runs stage 0 and needs the input: pass it as schedule.{call}"
            )
        batches = micro_batches(input, stage.chunks)
        m, sizes = len(batches), [batch_size(b) for b in batches]
        table = steps.forward_table(m, n, ranks) if forward_only else steps.table(m, stage.chunks)
        key = b""
        if stage.static_shapes or exchange.transport.reads_marks:
            signature = layout_signature(table, forward_only, stage.training, batches)
            key = hashlib.sha256(signature).digest() if signature else b""
        text, static, name = table.text(), bool(key) and key in shapes, stage.pipeline_name
        seed = draw_seed()  # once the input is taken: a refused one draws on no rank
        start = (m, sizes, text, forward_only, key, static, seed, steps.reduction, name)
        _follow(stage, exchange, start, shapes)
        # The table's text goes once: the next starts say None while it is the same.
        brief = (m, sizes, None if text == stage.table_text else text, *start[3:])
        lost = False
        for peer in exchange.peers:  # every peer: each follows the plan once it has it
            try:
                exchange.send(peer, START, brief)
            except Stopped:
                lost = True
        stage.table_text = text
        if lost:
            raise Stopped
    else:
        # Even after a halt: if rank 0 did start, it may have sent this rank metadata,
        # whose transfers this rank must take part in. None: rank 0 was lost, or made
        # another call (collect.py) and will send no start.
        start = exchange.wait_for(START, 0)
        if start is None:
            exchange.halt()
            raise Stopped
        draw_seed()  # as rank 0 did, after it: ranks sharing a process draw in one order
        follower = _follower(stage, start)
        start = _full(follower, start)
        m, sizes, text, first_forward_only, _, _, seed, reduction, _ = start
        _follow(follower, exchange, start, follower.shapes)
        if follower is not stage:  # the other pipeline's step fails: its layouts go
            follower.shapes.clear()
            crossed(stage.rank, stage.transport, followed=True)
        if exchange.halted:
            raise Stopped
        table = steps.forward_table(m, n, ranks) if forward_only else steps.table(m, stage.chunks)
        mine = (forward_only, table.text(), steps.reduction)
        agree_with_start(stage.rank, m, (first_forward_only, text, reduction), mine)
    if not forward_only:
        refuse_inference_mode(f"rank {stage.rank}'s schedule.step()")
    targets: list[Any] = []
    if stage.is_last and not forward_only:
        if target is None:
            raise ValueError(
                f"rank {stage.rank} runs the last stage and needs the target: pass it "
                f"as schedule.step(input, target)"
            )
        targets = micro_batches(target, m, "target")
        target_sizes = [batch_size(t) for t in targets]
        if target_sizes != sizes:
            raise ValueError(
                f"the target splits into micro-batches of {target_sizes} samples but "
                f"the input into {sizes}; give them the same batch size"
            )
    return m, sizes, table, batches, targets, seed


def join_step(stage: PipelineStage, exchange: Exchange) -> bool:
    """Whether rank 0 started a step while this process made another call; if so, join it.

    Rank 0 may have sent this rank metadata (or need none: known frames), and issue
    those transfers: this rank takes part in them (following the step's plan) as a rank
    that failed at the step's start would, halted, and forgets the remembered layouts as
    every rank of a failed step does. It waits for rank 0's first value (a start, or not).
    """
    if stage.rank == 0:
        return False
    start = exchange.wait_for(START, 0)
    if start is None:  # rank 0 made this call (or another) too, or ended
        return False
    draw_seed()  # rank 0 drew for this step: the generators move on alike
    exchange.halt()
    follower = _follower(stage, start)
    _follow(follower, exchange, _full(follower, start), follower.shapes)
    follower.shapes.clear()
    return True


def _follower(stage: PipelineStage, start: tuple[Any, ...]) -> PipelineStage:
    """The stage of this process whose pipeline rank 0 started (its name, last)."""
    name = start[-1]
    other = stage if name == stage.pipeline_name else PIPELINES.get((name, stage.rank))
    if not isinstance(other, PipelineStage):
        crossed(stage.rank, stage.transport, followed=False)
    return other


def _full(stage: PipelineStage, start: tuple[Any, ...]) -> tuple[Any, ...]:
    """Rank 0's start with the table's text, which it sends only when it changes."""
    m, sizes, text, *rest = start
    if text is None:
        text = stage.table_text
    stage.table_text = text
    return (m, sizes, text, *rest)


def _follow(
    stage: PipelineStage,
    exchange: Exchange,
    start: tuple[Any, ...],
    shapes: dict[bytes, dict[Any, Any]],
) -> None:
    """Follow the plan of the table that rank 0 started (as ``start`` says).

    ``shapes``: what the last steps that ended well sent and received, by the layout of
    their input (``start``'s key: a digest of the layout, or empty: none remembered).
    """
    _, _, text, forward_only, key, static, *_ = start
    exchange.signature = key  # this step's messages are remembered under it, if it ends well
    table = parsed_table(text, len(stage.balance))
    frames = None
    if static:  # a step on an input laid out so ended well, as every rank saw
        if key not in shapes:
            raise RuntimeError(  # pragma: no cover - every rank sees a step end alike
                f"rank {stage.rank} did not see the steps end as rank 0 did; after a "
                f"lost process, build the process group and the stages anew"
            )
        frames = shapes[key]
    plan = _plan(stage, table, "F" if forward_only else "FBW")
    exchange.follow(plan, frames, strict=stage.static_shapes)


LAYOUTS = 8
"""How many input layouts a stage remembers the messages' layouts of (the latest ones)."""


def _plan(stage: PipelineStage, table: Schedule, kinds: str) -> RankPlan:
    """This rank's transfers in a step of ``table`` (``plan.py``)."""
    routes = tuple((r.stash_partition, r.pop_partition) for r in stage.skip_layout.routes)
    return plan(table, routes, stage.rank, kinds)


def _result(stage: PipelineStage, steps: TableSteps, ran: _Ran) -> StepResult:
    exchange, step = ran.exchange, ran.step
    weights = loss_weights(ran.sizes, steps.reduction)
    peaks = dict.fromkeys(range(len(stage.balance)), 0)
    peaks.update({s: step.peak[s] for s in stage.stages})
    for status, _ in exchange.ends.values():
        peaks.update({int(s): p for s, p in status["peaks"].items()})
    if stage.is_last:
        losses = [x for x in step.losses if x is not None]
        output = ran.output
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
