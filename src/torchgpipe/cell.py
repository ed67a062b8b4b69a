"""A stage's cell: what it keeps from its forward to its last backward action.

Two kinds (see ``executor.py``): a cell with a graph of its own (:class:`StageCell`,
whose ``B`` runs on the rank's worker), and a cell in the caller's graph
(:func:`connected_forward`, whose backward the engine runs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from torchgpipe.batchnorm_tally import enter_cell, leave_cell
from torchgpipe.checkpoint import checkpoint, checkpoint_flags, differentiable
from torchgpipe.dependency import fork, join
from torchgpipe.grad_hooks import hooked
from torchgpipe.guards import Restore
from torchgpipe.mailbox import add_note
from torchgpipe.microbatch import Spec, flatten, map_tensors, per_tensor, unflatten
from torchgpipe.rng import CellRandomness, cell_seed
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.skip.tracker import run_cell
from torchgpipe.split_backward import Plan
from torchgpipe.stages import trainable_params
from torchgpipe.trace import BackwardSpan

if TYPE_CHECKING:
    from torchgpipe.executor import StepRun
    from torchgpipe.steps import LossFn

__all__ = [
    "StageCell",
    "call_loss",
    "call_stage",
    "checkpoints",
    "connected_forward",
    "cut_target",
    "detach_all",
    "detached",
    "needs_per_leaf",
    "only_wanting",
    "stage_leaf",
    "take_input_grads",
    "tensors_of",
    "wanted",
    "wanting",
]


@dataclass
class StageCell:
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
    # The loss's stage: (target tensor in the caller's graph, the cell's leaf for it).
    targets: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    plan: Plan = field(default_factory=list)  # W's work, left by B
    restore: Restore | None = None  # the buffers its recomputation starts from (guards.py)

    def release(self) -> None:
        """Let go of every tensor the cell keeps (its step failed)."""
        self.leaves, self.inputs, self.outputs, self.upstream, self.plan = [], [], [], [], []
        self.targets, self.restore = [], None


def needs_per_leaf(cell: StageCell) -> list[bool]:
    """Per leaf of the cell's input: whether its gradient is wanted (False for non-tensors)."""
    it = iter(cell.needs)
    return [next(it) if isinstance(x, Tensor) else False for x in cell.leaves]


def wanted(cell: StageCell, grads: list[Tensor | None]) -> list[Tensor | None]:
    """The gradients of the stage-0 inputs that the caller's graph wants, in order."""
    return [g for g, need in zip(grads, cell.needs, strict=True) if need]


def stage_leaf(x: Tensor, first: bool) -> Tensor:
    """The stage's own leaf for input ``x``, carrying a gradient if ``x`` wants one."""
    # The first stage's inputs are views of the caller's batch, which share its version
    # counter: a layer that works in place on one micro-batch (ReLU(inplace=True)) would
    # fail autograd's checks on what another saved, and touch the caller's tensor. A
    # copy each keeps them apart, as the whole batch in one piece is in the plain model.
    y = x.detach().clone() if first and x._is_view() else x.detach()
    return y.requires_grad_(True) if x.requires_grad else y


def wanting(value: Any) -> Any:
    """``value`` with its floating tensors marked as wanting a gradient.

    Marked are aliases (``detach()``), not the tensors themselves: a layer may return a
    buffer of its own, or its input, which must not turn into a leaf wanting a gradient.
    """
    if value is None:
        return value
    if isinstance(value, Tensor):  # the common case, on the path of every cell
        return _wanting(value)
    leaves, spec = flatten(value)
    return unflatten(per_tensor(_wanting, leaves), spec)


def _wanting(x: Tensor) -> Tensor:
    if x.requires_grad or not differentiable(x):
        return x
    return x.detach().requires_grad_(True)


def take_input_grads(inputs: list[Tensor]) -> list[Tensor | None]:
    """Each input's gradient, taken from it; None where it wants none.

    A tensor that is there twice (the previous stage returned ``(h, h)``) has one
    gradient, for both of its uses: it goes back once, in the first place. An input
    that wanted none, which a layer's in-place operation with a gradient-wanting
    operand made want one (``x.mul_(w)``), is no leaf any more: None, as before.
    """
    if len(inputs) == 1:  # the common case, on the path of every cell
        x = inputs[0]
        if not (x.requires_grad and x.is_leaf):
            return [None]
        grad, x.grad = x.grad, None
        return [grad]
    grads: list[Tensor | None] = []
    seen: set[int] = set()
    for x in inputs:
        if x.requires_grad and x.is_leaf and id(x) not in seen:
            seen.add(id(x))
            grads.append(x.grad)
            x.grad = None
        else:
            grads.append(None)
    return grads


class SkipVersions:
    """The versions of the skips a step sent, checked where they are popped.

    A skip that shares its memory with the stashing partition's output (``yield
    stash("x", x); return x``) goes to the popping partition cut from the graph of the
    partitions between. Where one of those changes that tensor in place
    (``ReLU(inplace=True)``), the plain model's pop sees the change and backpropagates
    through it; the pipeline's would see the new values without the gradient's way
    through them, a silently wrong gradient. Such a skip is refused where it is popped
    (in one process: across processes the popping rank gets a copy, made when sent).
    Not checked: a tensor that wants no gradient (nothing is lost), and a micro-batch of
    the step's input, whose version moves with the other micro-batches'.
    """

    def __init__(self, m: int, batches: list[Any]) -> None:
        self._sent: dict[tuple[SkipKey, int], list[int | None]] = {}
        self._one = m == 1  # see sent()
        self._batches = batches
        self._inputs: set[int] | None = None  # the storages of the batches, at the first skip

    def sent(self, key: SkipKey, i: int, value: Any, output: Any = None) -> Any:
        """Note skip ``key`` of micro-batch ``i`` as sent; ``value`` returned as it is.

        A tensor that is one of ``output``'s, the very object, is not checked where the
        step has one micro-batch and ``output`` is given (a cell in the caller's graph
        that was not checkpointed): it hands both on as they are (no phony joins its
        successor's input), and autograd sees a change made to it in place, as in the
        plain model.
        """
        same = {id(x) for x in flatten(output)[0] if isinstance(x, Tensor)} if self._one else ()
        tensors = [x for x in flatten(value)[0] if isinstance(x, Tensor)]
        self._sent[(key, i)] = [None if id(x) in same else self._version(x) for x in tensors]
        return value

    def check(self, key: SkipKey, i: int, value: Any) -> Any:
        """``value``, the skip popped, unless it changed in place since it was sent."""
        sent = self._sent.pop((key, i), None)
        now = [self._version(x) for x in flatten(value)[0] if isinstance(x, Tensor)]
        if sent is not None and any(
            a is not None and a != b for a, b in zip(sent, now, strict=True)
        ):
            raise RuntimeError(
                f"torchgpipe: the skip {key} of micro-batch {i} was changed in "
                f"place between its stash and its pop, by a layer of a partition between "
                f"them working on the tensor it shares with the stashing layer's output "
                f"(ReLU(inplace=True), say); the pop would get the new values but not the "
                f"gradient through that change. Make that layer work out of place, or "
                f"stash a copy (stash({key.name!r}, x.clone()), which then pops the "
                f"values from before the change)"
            )
        return value

    def _version(self, x: Tensor) -> int | None:
        if not x.requires_grad:
            return None
        if x.is_nested:  # not an input (those are dense), and no storage to compare
            return x._version
        if self._inputs is None:
            leaves = flatten(self._batches)[0]
            self._inputs = {b.untyped_storage().data_ptr() for b in leaves if isinstance(b, Tensor)}
        if x.untyped_storage().data_ptr() in self._inputs:
            return None
        return x._version


def detach_all(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every tensor detached (a tensor there twice stays one)."""
    return per_tensor(Tensor.detach, leaves)


def detached(value: Any) -> Any:
    """``value`` with every tensor cut from the graph, still saying if it wants a grad."""
    if value is None:
        return None
    leaves, spec = flatten(value)
    return unflatten(per_tensor(_cut, leaves), spec)


def _cut(x: Tensor) -> Tensor:
    return x.detach().requires_grad_(x.requires_grad)


def cut_target(cell: StageCell, target: Any) -> Any:
    """``target``, its tensors that want a gradient replaced by leaves of ``cell``'s own.

    A target in the caller's graph (``target = teacher(x)``) is cut as a stage's inputs
    are: the leaves' gradients go into the caller's graph at the end of the step, with
    the inputs' (``StepRun.backward_upstream``).
    """
    leaves, spec = flatten(target)
    if not any(isinstance(x, Tensor) and x.requires_grad for x in leaves):
        return target
    cell.targets = []
    for k, x in enumerate(leaves):
        if isinstance(x, Tensor) and x.requires_grad:
            leaves[k] = x.detach().requires_grad_(True)
            cell.targets.append((x, leaves[k]))
    return unflatten(leaves, spec)


def tensors_of(result: tuple[Any, dict[SkipKey, Any]]) -> list[Tensor]:
    """The tensors a cell gave out, in the order their gradients come back.

    One that wants no gradient starts no backward: in its place, a placeholder that
    wants none either, so that the cell does not keep it (a frozen stage's outputs).
    """
    output, outbound = result
    tensors = [x for x in flatten(output)[0] if isinstance(x, Tensor)]
    for skip in outbound.values():
        tensors += [x for x in flatten(skip)[0] if isinstance(x, Tensor)]
    return only_wanting(tensors)


def only_wanting(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors``, a placeholder in place of each that wants no gradient (not kept)."""
    return [x if x.requires_grad else _NOT_KEPT for x in tensors]


_NOT_KEPT = torch.empty(0)


def call_stage(
    partition: nn.Module, pops: bool, outbound: tuple[SkipKey, ...] | None, packed: Any
) -> tuple[Any, dict[SkipKey, Any]]:
    """Run a stage's partition; return its output and the skips it stashed.

    ``packed`` is the input, or ``(input, inbound skips)`` where the stage pops skips or
    stashes them (``outbound`` is then not None).
    """
    outer = enter_cell()  # deferred batch norm counts its calls per cell
    try:
        if outbound is None:
            if pops:  # pops, but stashes nothing: still under a tracker
                output, _ = run_cell(partition, (), packed)
                return output, {}
            return partition(packed), {}
        output, skips = run_cell(partition, outbound, packed)
        return output, dict(skips)
    finally:
        leave_cell(outer)


def _params(run: StepRun, s: int) -> tuple[list[Tensor], bool]:
    """Stage ``s``'s parameters that want a gradient, once per run (``checkpoint``'s).

    And whether some were left out: one that has a hook (a checkpointed cell's plain
    backward accumulates into ``.grad`` itself and gives the engine None for them,
    which it would hand the hooks), or is a lazy module's not made yet (its first
    forward makes it, changing its shape). The others stay inputs of the cell's node,
    so that ``backward(inputs=...)`` naming one reaches the cell (refused there).
    """
    found = run.params.get(s)
    if found is None:
        params = trainable_params([run.partitions[s]])
        kept = [p for p in params if not (hooked(p) or is_lazy(p))]
        found = run.params[s] = (kept, len(kept) < len(params))
    return found


def call_loss(loss_fn: LossFn, output: Any, target: Any, *, recomputing: bool = False) -> Any:
    """``loss_fn(output, target)``, part of the last stage's cell; notes what it raises.

    A checkpointed last stage computes its loss in its recomputation, a ``B`` action,
    whose note alone would send the reader to the backward.
    """
    try:
        return loss_fn(output, target)
    except Exception as error:
        where = " (a checkpointed last stage computes it in its recomputation)"
        add_note(error, f"torchgpipe: raised in loss_fn{where if recomputing else ''}")
        raise


def checkpoints(run: StepRun, s: int, i: int, tensors: Sequence[Tensor]) -> bool:
    """Whether cell ``(i, s)``, whose input holds ``tensors``, is checkpointed.

    Below the run's ``checkpoint_stop``, where an input or a parameter of the stage wants
    a gradient. Where none does, the cell runs in grad mode, as one that is not (its
    flags still say checkpointed): a graph, kept, only through a tensor a layer closes
    over that wants one, which a recomputation from leaves that want none, or a node
    whose inputs are those leaves and the parameters, would leave without a gradient.
    """
    wants = any(x.requires_grad for x in tensors) or run.trainable(s)
    checkpointed = i < run.checkpoint_stop and wants
    if any(x.is_nested for x in tensors):
        _refuse_nested(tensors, checkpointed, torch.is_grad_enabled() and wants)
    return checkpointed


def _refuse_nested(tensors: Sequence[Tensor], checkpointed: bool, graph: bool) -> None:
    """Refuse a nested tensor that a cell cannot take in (between partitions).

    Strided ones where the cell records a graph (it cannot alias them), jagged ones where
    it is recomputed; on the engine's path, the sending cell meets a strided one first
    (:func:`_nested_words`).
    """
    if graph and any(x.is_nested and x.layout == torch.strided for x in tensors):
        raise TypeError(_STRIDED)
    if checkpointed:
        raise TypeError(
            "torchgpipe: a jagged nested tensor reached a checkpointed cell, whose "
            "recomputation would make a new jagged dimension that the forward's gradient "
            "does not match: use checkpoint='never', or pad it (x.to_padded_tensor(0)) "
            "before it leaves the partition before"
        )


_STRIDED = (
    "torchgpipe: a nested tensor of strided layout reached a partition, which cannot take "
    "it in (torch's strided nested tensors have no sizes to alias): make it jagged "
    "(torch.nested.nested_tensor(..., layout=torch.jagged)) or pad it "
    "(x.to_padded_tensor(0)) before it leaves the partition before"
)


@contextmanager
def _nested_words() -> Iterator[None]:
    """Say our way what torch says of a strided nested tensor a cell hands on (engine's path)."""
    try:
        yield
    except RuntimeError as error:
        if "NestedTensorImpl doesn't support sizes" not in str(error):
            raise
        raise TypeError(_STRIDED) from error


def connected_forward(
    run: StepRun, s: int, i: int, value: Any, inbound: dict[SkipKey, Any]
) -> tuple[tuple[Any, dict[SkipKey, Any]], bool]:
    """Cell ``(i, s)`` in the caller's graph, with its phonies; whether it was checkpointed."""
    packed = value if run.outbound[s] is None and not inbound else (value, inbound)
    # Not StepRun._call: a checkpointed cell's node keeps its function, and a node that
    # held the run would make a cycle through autograd that Python cannot collect.
    function = partial(call_stage, run.partitions[s], bool(inbound), run.outbound[s])
    randomness = CellRandomness(cell_seed(run.seed, i, s))
    grad = run.state.grad_enabled
    # A phony for the next micro-batch's cell on this stage (see dependency.py).
    wants_phony = grad and i + 1 < len(run.step.outputs)
    phony = run.phony.pop(s, None)
    tensors = [x for x in flatten(packed)[0] if isinstance(x, Tensor)]
    if checkpoints(run, s, i, tensors):
        params, withheld = _params(run, s)
        with _nested_words():
            result, run.phony[s] = checkpoint(
                function,
                packed,
                state=run.state,
                randomness=randomness,
                device=run.devices[s],
                after=phony,
                fork=wants_phony,
                guard=run.guards[s],
                record=None if run.trace is None else partial(run.trace.record, s, i),
                name=f"{s}B{i}",
                trainable=run.trainable(s),
                params=params,
                withheld=withheld,
            )
        return result, True
    if s == 0 and grad:
        # Micro-batches are views of one input, sharing its version counter: a layer
        # that works in place (ReLU(inplace=True)) on two of them would break autograd's
        # checks on what each saved, which the whole batch in one piece does not.
        # Checkpointed cells copy their input anyway.
        packed = map_tensors(lambda x: x.clone() if x._is_view() else x, packed)
    packed = join(packed, phony)
    span = None
    if run.trace is not None and grad:
        span = BackwardSpan(run.trace, s, i)
        packed = span.mark_input(packed)
    flags = checkpoint_flags(i < run.checkpoint_stop, again=False)  # see checkpoints()
    with flags[0], flags[1], randomness.forward():
        result = function(packed)
    if span is not None:
        result = span.mark_output(result)
    if wants_phony:
        with _nested_words():
            result, run.phony[s] = fork(result)
    return result, False
