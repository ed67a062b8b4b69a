"""A GPipe's stages in one process: ``model(x)``, and the step of a schedule.

The schedule is data: :func:`clock_cycles` yields, tick by tick, the cells ``(i, j)``
(micro-batch ``i`` on partition ``j``) that may run together. With m = 3, n = 3::

    tick k:    0       1       2       3       4
    j = 0    (0,0)   (1,0)   (2,0)
    j = 1            (0,1)   (1,1)   (2,1)
    j = 2                    (0,2)   (1,2)   (2,2)

:func:`run` hands the ``F`` actions of the GPipe table (:func:`~torchgpipe.schedules.gpipe`)
to the executor (``executor.py``), the same one that runs every schedule's step: worker
``j`` runs cells ``(0, j), (1, j), ...`` in order, each as soon as the previous
partition's output arrives, so the cells follow the clock without a barrier per tick.

Then the backward, which ``loss.backward()`` starts. Where every partition is on the CPU,
each stage's cell has a graph of its own (a graph per stage, as in a schedule's step)
and the outputs come out of one autograd node, :class:`_StageGraphs`. Its backward puts
the outputs' gradients in the step's mailbox and runs the ``B`` actions of the GPipe
table on the workers, each partition's backward on its own thread, in parallel as the
forward was; the gradients of the input go back to the engine, and the parameters' are
accumulated into ``.grad`` on the workers, as a schedule's step does.

The parameters that want a gradient are inputs of that node too, although their
gradients do not pass through it in a plain ``loss.backward()``: otherwise the engine
would skip the node when ``backward(inputs=[a parameter])`` or ``torch.autograd.grad``
asks for a parameter alone. There the node's backward sets every ``.grad`` aside while
the workers run, and hands the gradients they leave to the engine, which then
accumulates, captures or drops each as it would for the plain model (``grad_hooks.py``).
Until the engine has taken them in, the GPipe stays held (``Workers.exclusive``):
another thread's backward or step of it waits, rather than set them aside meanwhile.

Where a partition is on a GPU, the cells are built into the caller's graph instead
(``connected``), and PyTorch's engine runs the backward: it already runs each GPU's
backward on a thread of its own. The node above must not be used there: the engine
would call its backward on the device thread of the last GPU, and that thread would
then wait for the workers, whose own ``backward`` on that GPU needs that very thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgpipe.executor import Step, StepRun
from torchgpipe.grad_hooks import Aside, Fate, fate, hooked, when_taken
from torchgpipe.microbatch import distinct_tensors, flatten, unflatten
from torchgpipe.schedules import Action, Schedule, gpipe
from torchgpipe.stages import Stages, trainable_params
from torchgpipe.steps import (
    StepResult,
    TableSteps,
    batch_size,
    loss_weights,
    micro_batches,
    refuse_inference_mode,
    weighted,
)
from torchgpipe.tied_sums import refuse_ties_named_apart, tie_groups
from torchgpipe.worker import Before, Workers

if TYPE_CHECKING:
    from torchgpipe.gpipe import GPipe

__all__ = [
    "check_table",
    "clock_cycles",
    "forward_only",
    "records",
    "run",
    "step",
    "workers_run_backward",
]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, for each clock tick ``k``, the cells ``(i, j)`` with ``i + j == k``.

    ``m`` is the number of micro-batches and ``n`` the number of partitions.
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(0, k - m + 1), min(k + 1, n))]


def records() -> bool:
    """Whether autograd records a graph on this thread: grad mode on, inference mode off.

    Under ``inference_mode()`` even ``enable_grad()`` records none, and the cells make
    inference tensors, which no graph may save.
    """
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def workers_run_backward(devices: Sequence[torch.device]) -> bool:
    """Whether ``model(x)``'s backward runs on the workers (CPU partitions only).

    See the module's documentation for why not on GPUs. Tests replace this function to
    run the engine's way on CPU partitions too.
    """
    return all(device.type == "cpu" for device in devices)


def run(
    stages: Stages,
    workers: Workers,
    batches: list[Any],
    before: Before | None = None,
) -> list[Any]:
    """Run every micro-batch through every stage; return the outputs in order.

    ``before`` is called once the workers are this run's, what it returns once the
    forwards all ended well (``Workers.run``).

    Raises:
        BaseException: the first exception that a cell raised, with a note naming the
            action, the partition and the micro-batch.
    """
    n, m = len(stages.inbound), len(batches)
    devices = stages.devices

    def describe(action: Action) -> str:
        return f"partition {action.stage} on {devices[action.stage]}"

    grad = records()
    upstream = [
        [x for x in flatten(batch)[0] if isinstance(x, Tensor) and x.requires_grad]
        for batch in (batches if grad else ())
    ]
    params = trainable_params(stages.partitions.values()) if grad else []
    wants_grad = grad and (
        any(upstream)
        or bool(params)
        or any(p.requires_grad for part in stages.partitions.values() for p in part.parameters())
    )
    stage_graphs = wants_grad and workers_run_backward(list(devices.values()))
    step = Step(n, m)
    run = StepRun(stages, None, _table(n, m), step, batches, [], [], connected=not stage_graphs)
    try:
        workers.run(run, "forward", describe, before)
    finally:  # failed too: the caller's streams must not run ahead of what was queued
        run.hand_over()
    if not stage_graphs:
        return step.outputs
    specs, tensors = [], []
    for output in step.outputs:
        leaves, spec = flatten(output)
        # A tensor returned twice (``return y, y``) comes out of the node once: one tensor
        # in both places, as the plain model's.
        mine, which = distinct_tensors(leaves)
        specs.append((leaves, spec, mine, which))
        tensors += mine
    elsewhere = sorted({str(x.device) for x in tensors if x.device.type != "cpu"})
    if elsewhere:
        step.drop()
        raise RuntimeError(
            f"the last partition is on the CPU but returned tensors on {elsewhere}; the "
            f"backward of CPU partitions runs on their own threads, which must not wait "
            f"on a GPU's engine thread: put that partition on the GPU (devices=[...]) "
            f"and let it return its output there"
        )
    whiches = [which for _, _, _, which in specs]
    backward = _Backward(run, workers, describe, whiches, upstream, tensors, params)
    flat = [x for xs in upstream for x in xs]
    # The phony makes the outputs want a gradient when only the parameters do and none
    # is a leaf here (functional_call's tensors computed from others).
    phony = torch.empty(0, requires_grad=True)
    joined = iter(_StageGraphs.apply(backward, phony, *params, *flat))  # type: ignore[no-untyped-call]  # Function.apply is unannotated
    outputs = []
    for leaves, spec, mine, which in specs:
        out = [next(joined) for _ in mine]
        each = iter(which)
        outputs.append(
            unflatten([out[next(each)] if isinstance(x, Tensor) else x for x in leaves], spec)
        )
    return outputs


def step(model: GPipe, steps: TableSteps, input: Any, target: Any) -> StepResult:
    """One step of ``steps``' schedule over ``model``'s partitions, each rank on a thread.

    The result's ``output`` is the micro-batches' outputs, a list, which the caller
    joins once the step's gradients are in place (a join that fails leaves them there).

    Raises:
        TypeError, ValueError: the input or target is missing or does not split into the
            same micro-batches; the table does not fit.
        BaseException: what an action raised, with a note naming it.
    """
    if input is None or target is None:
        raise TypeError(
            "schedule.step(input, target) needs both in one process: every stage is "
            "here, the first takes the input and the last the target"
        )
    refuse_inference_mode("schedule.step()")
    batches = micro_batches(input, model.chunks)
    m = len(batches)
    targets = micro_batches(target, m, "target")
    sizes = [batch_size(b) for b in batches]
    target_sizes = [batch_size(t) for t in targets]
    if target_sizes != sizes:
        raise ValueError(
            f"the target splits into micro-batches of {target_sizes} "
            f"samples but the input into {sizes}; give them the same batch size"
        )
    table = steps.table(m, model.chunks)
    weights = loss_weights(sizes, steps.reduction)
    stages = model.stages_for(m)
    record = Step(len(stages.inbound), m)
    run = StepRun(stages, steps.loss_fn, table, record, batches, targets, weights)
    devices = model.devices
    try:
        model.workers.run(
            run,
            "all",
            lambda action: f"stage {action.stage} on {devices[action.stage]}",
            partial(model.expect_micro_batches, m),
        )
    finally:
        run.hand_over()
    run.backward_upstream()
    losses = [x for x in record.losses if x is not None]
    return StepResult(
        loss=weighted(weights, losses),
        losses=losses,
        output=record.outputs,
        peak_held=tuple(record.peak),
    )


def forward_only(model: GPipe, input: Any) -> Any:
    """``model(input)`` under ``no_grad``, for ``schedule.forward_only(input)``."""
    if input is None:
        raise TypeError("schedule.forward_only(input) needs the input in one process")
    with torch.no_grad():
        return model(input)


def check_table(devices: Sequence[torch.device], table: Schedule) -> None:
    """Refuse a table that puts stages of different devices on one rank."""
    for r in range(len(table.ranks)):
        mine = {devices[s] for s in range(len(devices)) if table.placement[s] == r}
        if len(mine) > 1:
            raise ValueError(
                f"rank {r} runs stages on devices {sorted(map(str, mine))}; the stages "
                f"of one rank must share a device (list the devices of the GPipe "
                f"so that stage s and stage s + ranks get the same one)"
            )


@lru_cache(maxsize=64)
def _table(n: int, m: int) -> Schedule:
    """The GPipe table (a ``Schedule`` is immutable: one per shape will do)."""
    return gpipe(n, m)


class _Backward:
    """What the node of the outputs needs to run the stages' backward once."""

    def __init__(
        self,
        run: StepRun,
        workers: Workers,
        describe: Callable[[Action], str],
        whiches: list[list[int]],
        upstream: list[list[Tensor]],
        outputs: list[Tensor],
        params: list[Tensor],
    ) -> None:
        self.run: StepRun | None = run
        self.workers = workers
        self.describe = describe
        # Per micro-batch: which of its distinct output tensors each tensor leaf is.
        self.whiches = whiches
        self.devices = [[x.device for x in xs] for xs in upstream]
        self.outputs: list[Tensor] | None = outputs
        self.params = params  # the first inputs of the node, then the upstream tensors
        self.partitions = run.partitions

    def __call__(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Run every ``B``; give the engine the parameters' gradients, then the input's.

        Every refusal comes before anything changes, the run included: a backward
        refused here may be tried again, as its message says. The pipeline stays held
        (``Workers.exclusive``) until the engine has taken in what this hands it for
        the parameters (``grad_hooks.when_taken``): another thread's backward or step
        of this pipeline sets nothing aside meanwhile.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                "torchgpipe: a backward that builds a graph (create_graph=True, a "
                "gradient of a gradient) cannot go through a GPipe of CPU partitions: "
                "each partition runs its backward on its own thread. Compute the "
                "gradient penalty outside the GPipe, or train the model unwrapped"
            )
        if any(g is not None and _batched(g) for g in grads):
            raise NotImplementedError(
                "torchgpipe: batched gradients (autograd.grad(..., is_grads_batched=True), "
                "jacobian(..., vectorize=True), a vmap over a backward) cannot go through a "
                "GPipe of CPU partitions: each partition runs its backward on its own "
                "thread, out of the batching's reach. Nothing has changed: give one "
                "gradient per backward (each backward needs a forward of its own here), "
                "or compute Jacobians with the plain model"
            )
        with self.workers.exclusive() as hold:
            if self.run is None:
                raise RuntimeError(
                    "torchgpipe: backward through a GPipe's output ran twice; on CPU "
                    "partitions each stage frees its graph after its backward, as if "
                    "retain_graph were False. Run the forward again for another backward"
                )
            # A plain backward(): neither inputs= nor autograd.grad.
            plain = torch.autograd._is_checkpoint_valid()
            if not plain:
                self._check_computed()
                self._check_ties()
            run, self.run = self.run, None
            got, handed = self._backward(run, grads, plain)
            when_taken(handed, hold.keep())
        return got

    def _backward(
        self, run: StepRun, grads: Sequence[Tensor | None], plain: bool
    ) -> tuple[list[Tensor | None], list[tuple[Tensor, Fate]]]:
        """:meth:`__call__` once every check has passed; the gradients handed, set aside."""
        if plain:
            # The workers accumulate into .grad, and the engine gets None for the
            # parameters, but for those with hooks of the user's: it would call them with
            # None (see Aside). The library's own (a tied copy's, tied_sums.Record) see
            # each share as it comes, in this backward: a GPipe nested in a partition sums
            # its ties at the end of the partition's backward, not after this node.
            with_hooks = [p for p in self.params if hooked(p, users_only=True)]
            if not with_hooks:
                return [None] * len(self.params) + self._stages(run, grads, None), []
            aside = Aside(with_hooks)
            got = self._stages(run, grads, aside)
            new = aside.take()
            mine = dict(zip(map(id, with_hooks), new, strict=True))
            aside.put_back()
            handed: list[tuple[Tensor, Fate]] = [(p, "accumulate") for p in with_hooks]
            return [mine.get(id(p)) for p in self.params] + got, handed
        # inputs= or autograd.grad: the engine does with each gradient as it would with
        # the plain model's (its hooks, then it accumulates, captures or drops it).
        aside = Aside(self.params)
        got = self._stages(run, grads, aside)
        new = aside.take()
        # Every .grad back at once (the engine adds to those it accumulates into), so a
        # second node of this backward (the model called twice) sets aside the same, and
        # a failure later in the backward leaves them as they were.
        aside.put_back()
        handed = [(p, fate(p)) for p, g in zip(self.params, new, strict=True) if g is not None]
        return new + got, handed

    def _check_computed(self) -> None:
        """Refuse a backward that asks for some tensors only, with computed parameters.

        Parameters computed from other tensors (``functional_call``'s ``p * scale``) are
        not inputs of the node: the stages' backward goes through them into the caller's
        graph itself, which the engine's ``inputs=`` cannot see.

        Raises:
            RuntimeError: nothing has changed yet.
        """
        for partition in self.partitions.values():
            for name, p in partition.named_parameters():
                if p.requires_grad and not p.is_leaf:
                    raise RuntimeError(
                        f"torchgpipe: backward(inputs=...) or torch.autograd.grad through a "
                        f"GPipe of CPU partitions whose parameter {name!r} was computed "
                        f"from other tensors (given to torch.func.functional_call, say); "
                        f"use a plain backward() and read .grad"
                    )

    def _check_ties(self) -> None:
        """Refuse a backward that names some copies of a tied weight, or captures one.

        Each copy's gradient holds its partition's uses only until the ties' sum at the
        end of the backward (``tied.py``), which adds into every copy's ``.grad``.

        Raises:
            RuntimeError: nothing has changed yet.
        """
        refuse_ties_named_apart(tie_groups(self.params), self._names)

    def _stages(
        self, run: StepRun, grads: Sequence[Tensor | None], aside: Aside | None
    ) -> list[Tensor | None]:
        """Hand the outputs' gradients to the last stage; run every ``B``; give the input's."""
        n, step = len(run.table.ranks), run.step
        it = iter(grads)
        for i, which in enumerate(self.whiches):
            mine = [next(it) for _ in range(max(which, default=-1) + 1)]
            # Once per distinct tensor: the engine summed what each place gave it.
            per_leaf: list[Tensor | None] = []
            seen: set[int] = set()
            for k in which:
                per_leaf.append(None if k in seen else mine[k])
                seen.add(k)
            step.put(("G", n - 1, i), per_leaf)
        try:
            self.workers.run(run, "backward", self.describe)
        except BaseException:
            if aside is not None:
                aside.abandon()
            raise
        out: list[Tensor | None] = []
        for i, devices in enumerate(self.devices):
            got = step.take(("G", -1, i)) if devices else []
            out += [g if g is None else g.to(d) for g, d in zip(got, devices, strict=True)]
        return out

    def _names(self, params: list[Tensor]) -> str:
        """``params`` as ``'partition 1: 0.weight, ...'``."""
        ids = {id(p) for p in params}
        return ", ".join(
            f"partition {j}: {name}"
            for j, partition in self.partitions.items()
            for name, p in partition.named_parameters()
            if id(p) in ids
        )


def _batched(x: Tensor) -> bool:
    """Whether ``x`` is a batched tensor of a vmap (torch.func's, or autograd's own)."""
    functorch = torch._C._functorch
    return bool(functorch.is_legacy_batchedtensor(x) or functorch.is_batchedtensor(x))


class _StageGraphs(torch.autograd.Function):
    """The node between the caller's graph and the stages' own graphs (CPU partitions)."""

    @staticmethod
    def forward(ctx: Any, backward: _Backward, phony: Tensor, *inputs: Tensor) -> Any:
        ctx.backward = backward
        ctx.set_materialize_grads(False)
        outputs = backward.outputs
        assert outputs is not None
        backward.outputs = None  # the stages' cells hold them as long as needed
        # detach() shares the version counter: a later in-place change of an output is
        # still caught by the stage's graph that saved it.
        joined = tuple(x.detach() for x in outputs)
        ctx.mark_non_differentiable(
            *(y for x, y in zip(outputs, joined, strict=True) if not x.requires_grad)
        )
        return joined

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.backward(grads))
