"""Splitting a stage's backward in two: B for the input gradients, W for the weights'.

``B`` backpropagates to the stage's inputs only and keeps the graph; on the way it records
the gradient reaching each node where the path to the inputs branches off towards
weights. ``W`` resumes from those nodes with those gradients, towards the weights only, so
no part of the backward runs twice. (Before torch 2.10, ``W`` backpropagates from the
stage's outputs to its weights again: see :data:`RESUMABLE`.)

A node written in Python (a custom ``torch.autograd.Function``) computes all its
gradients in one call, whichever the engine asks for: resumed from, it would run again
(twice the work, twice its side effects, and a second call a backward that frees its
context cannot make). And torch's reentrant checkpoint refuses a backward given
``inputs=``. Where the stage's graph has such a node at a branch, or that checkpoint
anywhere, ``B`` runs the stage's whole backward, weights included, and leaves ``W``
nothing: the split is lost for that stage's cell, not the gradients. So too for a stage
whose forward hooks its tensors (:class:`HookWatch`): W would run the hooks again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointFunction

__all__ = ["RESUMABLE", "HookWatch", "Plan", "backward_inputs"]


# Whether W resumes where B left off instead of walking the stage's graph again: the
# engine starts a backward from a node since torch 2.4, but there the resumed W failed
# the suite's tests; 2.10 is the oldest release seen to pass them (2.5 to 2.9 not run).
RESUMABLE = hasattr(torch.autograd.graph, "get_gradient_edge") and tuple(
    int(part) for part in torch.__version__.split(".")[:2]
) >= (2, 10)


# Splitting a backward into B and W.


class HookWatch(TorchFunctionMode):
    """Notes, in ``hooked``, stage ``s`` when its forward hooks a tensor of its graph.

    A hook on a tensor (``register_hook``, ``retain_grad``) is one on the node that made
    it, which the engine runs each time it starts from that node: where W resumes from
    it, the hook would run twice (a gradient reversal reversing the weights' gradients
    back). A stage that hooks its tensors, or reads a tensor's ``grad_fn`` (to hook the
    node itself), is not split (:func:`backward_inputs`'s ``unsplit``).
    """

    def __init__(self, hooked: set[int], s: int) -> None:
        super().__init__()
        self._hooked, self._s = hooked, s

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _HOOKS:
            self._hooked.add(self._s)
        return func(*args, **kwargs) if kwargs else func(*args)


# Reading a tensor's grad_fn too: hooks put on the node itself (y.grad_fn.register_hook).
_HOOKS = (Tensor.register_hook, Tensor.retain_grad, getattr(Tensor, "grad_fn").__get__)  # noqa: B009


# W's work: engine calls, each from roots (a tensor or a node's input, with the gradient
# it starts from) to the leaves it fills.
Plan: TypeAlias = list[tuple[list[tuple[Any, Tensor]], list[Tensor]]]


def backward_inputs(
    pairs: Sequence[tuple[Tensor, Tensor]], inputs: list[Tensor], unsplit: bool = False
) -> Plan:
    """Backpropagate ``pairs`` to ``inputs`` only; return the plan of W, which finishes.

    Or, where the graph cannot be split (see the module's documentation) or ``unsplit``
    says so (:class:`HookWatch`), backpropagate all of it and return an empty plan.

    Where the way to the inputs branches off towards weights, the node there gets its
    gradient recorded; W resumes from each such node towards the weights of its own
    branches, one engine call per node (a call from two nodes at once would count
    twice the weights that the upper one reaches through the lower one).
    """
    outputs = [y for y, _ in pairs]
    grads = [g for _, g in pairs]
    graph = _Graph(outputs, inputs)
    if unsplit or graph.unsplittable:  # see the module's documentation: all now, W nothing
        torch.autograd.backward(outputs, grads)
        return []
    whole: Plan = [(list(pairs), [])]
    if not RESUMABLE:  # pragma: no cover - torch < 2.10
        torch.autograd.backward(outputs, grads, inputs=inputs, retain_graph=True)
        whole[0][1].extend(graph.weights)
        return whole
    from torch.autograd.graph import GradientEdge

    captured: dict[Any, tuple[Tensor | None, ...]] = {}
    handles = [node.register_prehook(_capture(captured, node)) for node, _ in graph.branches]
    try:
        torch.autograd.backward(outputs, grads, inputs=inputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    if graph.tangled:
        # A weight reached both from a branch and, further down, from the way to the
        # inputs (a weight used twice): resume from the outputs instead, as before 2.10.
        whole[0][1].extend(graph.weights)
        return whole
    plan: Plan = []
    for node, own in graph.branches:
        received = captured.get(node, ())
        roots = [(GradientEdge(node, k), g) for k, g in enumerate(received) if g is not None]
        if roots:
            plan.append((roots, [leaf.variable for leaf in own]))
    direct = [
        (y, g)
        for (y, g), node in zip(pairs, graph.starts, strict=True)
        if not graph.reaches_input[node] and graph.below[node]
    ]
    if direct:  # outputs that do not depend on the inputs at all
        leaves = set().union(*(graph.below[node] for node in graph.starts))
        plan.append((direct, [leaf.variable for leaf in leaves]))
    return plan


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
    through the edges that stay on the way to the inputs. ``unsplittable`` says that a
    node W would run again is written in Python (a branch; with ``tangled``, any node on
    the way), or that the graph holds torch's reentrant checkpoint.
    """

    def __init__(self, outputs: list[Tensor], inputs: list[Tensor]) -> None:
        from torch.autograd.graph import get_gradient_edge

        self.starts = [get_gradient_edge(y).node for y in outputs]
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        self.reaches_input: dict[Any, bool] = {}
        self.below: dict[Any, frozenset[Any]] = {}
        self.branches: list[tuple[Any, frozenset[Any]]] = []
        self.tangled = False
        python_branch = python_on_way = reentrant = False
        weights: list[Any] = []
        for node in _post_order(self.starts):
            reentrant = reentrant or getattr(node, "_forward_cls", None) is CheckpointFunction
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
                python = isinstance(node, BackwardCFunction)
                python_on_way = python_on_way or python
                own = frozenset().union(*(self.below[c] for c in off_way))
                if own:
                    self.branches.append((node, own))
                    python_branch = python_branch or python
                    if own & frozenset().union(*(self.below[c] for c in on_way)):
                        self.tangled = True
        self.weights = [node.variable for node in weights]
        self.unsplittable = reentrant or python_branch or (self.tangled and python_on_way)


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
