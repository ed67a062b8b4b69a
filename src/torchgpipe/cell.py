"""A stage's cell in a step: what it keeps from its forward to its last backward action."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from torchgpipe.checkpoint import alias, differentiable
from torchgpipe.microbatch import Spec, flatten, unflatten
from torchgpipe.rng import CellRandomness
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.split_backward import Plan

__all__ = [
    "StageCell",
    "aliases",
    "detach_all",
    "detached",
    "needs_per_leaf",
    "stage_leaf",
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
    plan: Plan = field(default_factory=list)  # W's work, left by B


def needs_per_leaf(cell: StageCell) -> list[bool]:
    """Per leaf of the cell's input: whether its gradient is wanted (False for non-tensors)."""
    it = iter(cell.needs)
    return [next(it) if isinstance(x, Tensor) else False for x in cell.leaves]


def wanted(cell: StageCell, grads: list[Tensor | None]) -> list[Tensor | None]:
    """The gradients of the stage-0 inputs that the caller's graph wants, in order."""
    return [g for g, need in zip(grads, cell.needs, strict=True) if need]


def stage_leaf(x: Tensor, first: bool) -> Tensor:
    """The stage's own leaf for input ``x``, carrying a gradient if ``x`` wants one."""
    if not x.requires_grad:
        return x.detach()
    # The first stage's inputs may be views of the caller's batch; a copy keeps a layer
    # that works in place from touching the caller's tensor.
    y = x.detach().clone() if first else x.detach()
    return y.requires_grad_(True)


def aliases(leaves: list[Any]) -> list[Any]:
    """Non-leaf stand-ins for the leaves that want a gradient, which layers may modify."""
    return [alias(x) if isinstance(x, Tensor) and x.requires_grad else x for x in leaves]


def wanting(value: Any, wants: bool) -> Any:
    """``value`` with its floating tensors marked as wanting a gradient, if ``wants``."""
    if not wants or value is None:
        return value
    leaves, spec = flatten(value)
    return unflatten(
        [
            x.requires_grad_(True) if isinstance(x, Tensor) and differentiable(x) else x
            for x in leaves
        ],
        spec,
    )


def detach_all(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every tensor detached."""
    return [x.detach() if isinstance(x, Tensor) else x for x in leaves]


def detached(value: Any) -> Any:
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


def tensors_of(result: tuple[Any, dict[SkipKey, Any]]) -> list[Tensor]:
    """The tensors a cell gave out, in the order their gradients come back."""
    output, outbound = result
    tensors = [x for x in flatten(output)[0] if isinstance(x, Tensor)]
    for skip in outbound.values():
        tensors += [x for x in flatten(skip)[0] if isinstance(x, Tensor)]
    return tensors
