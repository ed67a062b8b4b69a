"""Ordering edges between cells in the autograd graph.

PyTorch's autograd engine orders ready nodes by sequence numbers that are counted per
thread, and our cells are recorded on several worker threads, so nothing in the graph
alone says that micro-batch ``i``'s backward on a partition runs before ``i - 1``'s, as
GPipe needs. :func:`fork` and :func:`join` add that edge through an empty "phony"
tensor::

    output of (i-1, j) ──fork──▶ to partition j+1           (backward of (i-1, j) ...
                          │
                        phony                                 ... waits for the phony's
                          │                                    gradient, which only
    input of (i, j) ────join──▶ cell (i, j)                    cell (i, j)'s backward
                                                               produces)

The fork node cannot run its backward until the phony's gradient arrives, and that
gradient flows out of the join only after the backward of cell ``(i, j)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchgpipe.microbatch import flatten, unflatten

__all__ = ["fork", "join"]


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        # detach() rather than the input itself: an output that is a custom Function's
        # view of its input may not be modified in place later, and layers often are.
        return x.detach(), torch.empty(0, device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _grad_phony: Tensor) -> Tensor:
        return grad


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, phony: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _anchor(leaves: list[Any]) -> int | None:
    """The index of the first floating-point leaf that wants a gradient: it carries the edge.

    Only a tensor that wants a gradient carries one back, so only it can carry the edge;
    joining into one that does not would make it want one, where the plain model's
    does not (a layer that reads ``requires_grad`` would see the difference, and the
    backward would run through layers whose input needs none).
    """
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            return index
    return None


def fork(value: Any) -> tuple[Any, Tensor | None]:
    """Return ``value`` with a phony tensor branched off its anchor (see :func:`_anchor`).

    The phony is ``None`` when no leaf wants a gradient: there is no backward to order.
    """
    leaves, spec = flatten(value)
    index = _anchor(leaves)
    if index is None:
        return value, None
    anchor = leaves[index]
    forked, phony = _Fork.apply(anchor)  # type: ignore[no-untyped-call]  # Function.apply is unannotated
    return unflatten(_replaced(leaves, anchor, forked), spec), phony


def join(value: Any, phony: Tensor | None) -> Any:
    """Return ``value`` with ``phony`` joined into its anchor (see :func:`_anchor`).

    Without an anchor no gradient leaves the cell through its input, and its
    parameters' gradients add up the same in any order: there is nothing to order.
    """
    if phony is None:
        return value
    leaves, spec = flatten(value)
    index = _anchor(leaves)
    if index is None:
        return value
    anchor = leaves[index]
    joined = _Join.apply(anchor, phony)  # type: ignore[no-untyped-call]  # Function.apply is unannotated
    return unflatten(_replaced(leaves, anchor, joined), spec)


def _replaced(leaves: list[Any], old: Tensor, new: Tensor) -> list[Any]:
    """``leaves`` with ``new`` wherever ``old`` was: a tensor there twice stays one."""
    return [new if x is old else x for x in leaves]
