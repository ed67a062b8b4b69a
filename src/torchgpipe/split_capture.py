"""Capturing a module's forward for ``split.py``: the trace, and where stages may start.

``torch.fx`` traces through the module's own forward, containers, the modules on the
way to a split point and (``stages=k``) the largest submodules it can capture until
there are enough calls; every other submodule stays one call. Each trace is made in
both modes, and refused if ``train()`` and ``eval()`` give different code (or different
constants). Buffers are traced as attributes, so the stages read the module's own.
Then the example runs once through the graph, to learn which values are tensors and
devices, and which of the constants fx kept the graph changes in place.

What fx would capture wrongly is refused while it traces (``split_refusals.py``): a
random draw on no traced value, or from Python's ``random`` (fx runs it once and keeps
the numbers, or the branch, as constants); a value the forward stores on a module
(``self.aux_loss = ...``: the module would keep a proxy); a call made under a mode
entered inside the forward (``torch.no_grad()``, ``autocast``: fx records calls, not
modes). Code that reads the grad mode (``torch.is_grad_enabled()``) is caught as the
train/eval difference is: the second trace flips it too. A container with a forward
of its own is the user's code, called whole unless a split point lies inside it.
"""

from __future__ import annotations

import difflib
import inspect
import operator
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from torchgpipe.split_buffers import changed_inside
from torchgpipe.split_refusals import (
    TORCH_DIR,
    ConstantDraws,
    captured_as_computed,
    leaves,
    python_draws_refused,
    stored_values_refused,
    torch_class,
    trace_failure,
    user_line,
    where_made,
)
from torchgpipe.split_stage import InputKind, SplitError

Kind = tuple[str, torch.device]
"""What a node's value was in the example: ``("tensor", its device)`` or ``("device", it)``."""

__all__ = [
    "TORCH_DIR",
    "ExampleRun",
    "Kind",
    "ancestors",
    "candidates",
    "changed_in_place",
    "compute_nodes",
    "cuts_at",
    "trace_forward",
    "trace_into",
    "value_kinds",
    "where_made",
]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_CONTAINER_FORWARDS = (nn.Sequential.forward, nn.Module.forward)  # the latter: none
_CALLS = ("call_module", "call_function", "call_method")


# Capturing the forward.


class _Tracer(fx.Tracer):
    """Traces through the root, containers and the modules in ``through``; calls the rest."""

    def __init__(self, through: set[str]) -> None:
        super().__init__()
        self.through = through
        self.record_stack_traces = True  # for errors that name the line
        # A buffer is read by the stages (as the module's own tensor), not baked in: a
        # checkpoint, .to() and the forward's own updates reach it.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A container with a forward of its own is the user's code: called whole, as any
        # module, unless a split point lies inside it.
        plain = isinstance(m, _CONTAINERS) and type(m).forward in _CONTAINER_FORWARDS
        return not (plain or module_qualified_name in self.through)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.ambient = _ambient()
        self.model = type(root).__name__
        return super().trace(root, concrete_args)

    def create_node(
        self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **more: Any
    ) -> fx.Node:
        # fx records calls, not the modes they run in: code under torch.no_grad(),
        # inference_mode or autocast entered inside the forward would run without it.
        if kind in _CALLS and _ambient() != self.ambient:
            raise SplitError(
                f"cannot split {self.model}: code that split captures{user_line()} runs "
                f"under torch.no_grad(), "
                f"inference_mode, set_grad_enabled or autocast entered inside the forward, "
                f"and torch.fx records the calls but not the mode: the stages would run "
                f"them with gradients (or without autocast), and the gradients would be "
                f"wrong; keep that code inside a submodule that split calls whole (name "
                f"split points elsewhere), or enter the mode around the whole model's call"
            )
        return super().create_node(kind, target, args, kwargs, *rest, **more)

    def create_arg(self, a: Any) -> Any:
        # fx writes any dict as a dict: an OrderedDict the forward returns or passes on
        # is made again as one, by a call in the graph (a subclass too, where its class
        # makes one from pairs as OrderedDict does: not a dataclass's fields).
        kind = type(a)
        if isinstance(a, OrderedDict) and kind.__init__ is OrderedDict.__init__:
            items = self.create_arg(list(a.items()))
            return self.create_node("call_function", kind, (items,), {})
        return super().create_arg(a)


def _ambient() -> tuple[bool, bool, bool]:
    """The modes fx does not record: gradients, inference mode, autocast (any device)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch._C._is_any_autocast_enabled(),
    )


def ancestors(module: nn.Module, at: Sequence[str]) -> set[str]:
    """The modules to trace through so that each split point is a call of its own."""
    known = dict(module.named_modules())
    through: set[str] = set()
    for name in at:
        if name not in known or name == "":
            close = difflib.get_close_matches(name, [n for n in known if n], n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise SplitError(
                f"split point {name!r} names no submodule of {type(module).__name__}{hint}"
            )
        parts = name.split(".")
        through.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return through


def trace_forward(module: nn.Module, through: set[str], concrete: dict[str, Any]) -> fx.Graph:
    """The graph of ``module``'s forward, traced through the modules in ``through``.

    Raises:
        SplitError: fx cannot capture it (the message names the line).
    """
    given = [p for p in inspect.signature(module.forward).parameters if p not in concrete]
    graph = _traced(module, through, concrete)
    # Code that split captures must not depend on train() or eval(): the stages would
    # keep the mode of the moment of the split. Trace again in the other modes.
    # Gradients too: code that reads torch.is_grad_enabled() would keep its branch.
    modes = {m: m.training for m in module.modules()}
    try:
        for m, training in modes.items():
            m.training = not training
        with torch.set_grad_enabled(not torch.is_grad_enabled()):
            other = _traced(module, through, concrete)
    finally:
        for m, training in modes.items():
            m.training = training
    first = _first_difference(module, graph, other)
    if first is not None:
        raise SplitError(
            f"cannot split {type(module).__name__}: code that split captures"
            f"{where_made(first)} depends on train() or eval() (self.training, F.dropout(..., "
            f"training=self.training)) or on whether gradients are enabled "
            f"(torch.is_grad_enabled()), and the stages would keep the mode they were "
            f"split in; use modules for it (nn.Dropout), or keep that code inside a "
            f"submodule that split calls whole (name split points elsewhere)"
        )
    # The defaults kept are constants in the graph now; what is left of their
    # placeholders are fx's checks that they keep their values: drop them.
    doomed: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.target not in given) or any(
            used in doomed for used in node.all_input_nodes
        ):
            doomed.add(node)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            graph.erase_node(node)
        elif node.op == "placeholder":
            # Given, so its default is never used; and kept, a default before a
            # keyword-only argument without one makes fx write invalid Python.
            node.args = ()
    return graph


def _traced(module: nn.Module, through: set[str], concrete: dict[str, Any]) -> fx.Graph:
    name = type(module).__name__
    try:
        with stored_values_refused(module), ConstantDraws(name), python_draws_refused(name):
            return _Tracer(through).trace(module, concrete_args=concrete or None)
    except SplitError:
        raise
    except Exception as error:
        raise SplitError(trace_failure(module, error, through)) from error


def _first_difference(module: nn.Module, graph: fx.Graph, other: fx.Graph) -> fx.Node | None:
    """The first node of ``graph`` that differs in ``other`` (code, or a constant's value)."""
    ours: list[fx.Node] = list(graph.nodes)
    theirs: list[fx.Node] = list(other.nodes)
    for a, b in zip(ours, theirs, strict=False):
        if _shown(a) != _shown(b) or (a.op == "get_attr" and not _same(module, a, b)):
            return a
    return None if len(ours) == len(theirs) else ours[min(len(ours), len(theirs)) - 1]


def _same(module: nn.Module, a: fx.Node, b: fx.Node) -> bool:
    """Whether two get_attr nodes read equal values (constants are made per trace)."""
    x, y = _attribute(module, str(a.target)), _attribute(module, str(b.target))
    if x is y or not (isinstance(x, Tensor) and isinstance(y, Tensor)):
        return x is y
    return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))


def _attribute(module: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def _shown(node: fx.Node) -> str:
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", node.format_node() or "")


def trace_into(module: nn.Module, stages: int, concrete: dict[str, Any]) -> fx.Graph:
    """Trace through ever larger submodules until the forward makes ``stages`` calls.

    A submodule whose forward cannot be captured (or depends on the mode) stays whole.
    """
    through: set[str] = set()
    opaque: set[str] = set()  # submodules that cannot be traced into: called whole
    graph = trace_forward(module, through, concrete)
    while True:
        if len(candidates(graph)) + 1 >= stages:
            return graph
        called = {n.target for n in graph.nodes if n.op == "call_module"}
        expandable = [
            (sum(p.numel() for p in module.get_submodule(name).parameters()), name)
            for name in called
            if isinstance(name, str)
            and name not in opaque
            and next(module.get_submodule(name).children(), None) is not None
            and not torch_class(module.get_submodule(name))
        ]
        if expandable:
            name = max(expandable)[1]
            try:
                graph = trace_forward(module, through | {name}, concrete)
            except SplitError:
                opaque.add(name)
            else:
                through.add(name)
            continue
        whole = f" ({', '.join(sorted(opaque))} could not be traced into)" if opaque else ""
        raise SplitError(
            f"cannot cut {type(module).__name__} into {stages} stages: its forward "
            f"calls {len(candidates(graph)) + 1} modules in turn{whole}; ask for fewer "
            f"stages, or name split points inside its submodules with at=[...] (not "
            f"inside torch's own modules, such as nn.TransformerEncoder, which it calls whole)"
        )


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The calls of ``graph`` (modules, functions, methods), in order."""
    return [node for node in graph.nodes if node.op in _CALLS]


def candidates(graph: fx.Graph) -> list[int]:
    """Where a stage may start: at each call of a submodule, but not the graph's first.

    Not between two calls of one module (or of a module and one inside it): the
    module would land in two stages.
    """
    compute = compute_nodes(graph)
    called = {str(n.target) for n in compute if n.op == "call_module"}
    spans: dict[str, list[int]] = {}  # per outermost called module: first and last call
    for k, node in enumerate(compute):
        if node.op == "call_module":
            parts = str(node.target).split(".")
            root = next(
                ".".join(parts[:d])
                for d in range(1, len(parts) + 1)
                if ".".join(parts[:d]) in called
            )
            span = spans.setdefault(root, [k, k])
            span[1] = k
    inside = {k for first, last in spans.values() for k in range(first + 1, last + 1)}
    return [
        k
        for k, node in enumerate(compute)
        if node.op == "call_module" and k > 0 and k not in inside
    ]


def _belongs(node: fx.Node, name: str) -> bool:
    if node.op == "call_module" and (
        node.target == name or str(node.target).startswith(name + ".")
    ):
        return True
    stack = node.meta.get("nn_module_stack") or {}
    return any(path == name or str(path).startswith(name + ".") for path, _ in stack.values())


def cuts_at(module: nn.Module, graph: fx.Graph, at: list[str]) -> list[int]:
    """Where each stage after the first starts: the first call into each of ``at``.

    Raises:
        SplitError: a split point is never called, starts the forward, or is out of order.
    """
    compute = compute_nodes(graph)
    cuts: list[int] = []
    for name in at:
        k = next((k for k, node in enumerate(compute) if _belongs(node, name)), None)
        if k is None:
            sub = module.get_submodule(name)
            why = (
                f"an empty {type(sub).__name__}, which leaves no call in the traced graph, "
                f"called or not: no stage can start there; name the next submodule the "
                f"forward calls"
                if isinstance(sub, (nn.Sequential, nn.Identity)) and not len(sub._modules)
                else f"a submodule of {type(module).__name__} that its forward never "
                f"calls; name a submodule the forward uses"
            )
            raise SplitError(f"split point {name!r} is {why}")
        if k == 0:
            raise SplitError(
                f"split point {name!r} is where {type(module).__name__}'s forward starts: "
                f"the first stage would be empty; leave it out"
            )
        if cuts and k <= cuts[-1]:
            raise SplitError(
                f"split points must follow the order of the forward, but {name!r} runs "
                f"before (or with) {at[len(cuts) - 1]!r}; list them in the order they run"
            )
        cuts.append(k)
    return cuts


@dataclass(frozen=True)
class ExampleRun:
    """What the example's run through the graph showed."""

    kinds: dict[fx.Node, Kind]
    """The nodes whose value was a tensor (and its device) or a device."""
    changed: frozenset[str]
    """The constants fx kept (``_tensor_constant*``) that the graph changes in place."""
    aliased: dict[fx.Node, tuple[fx.Node, frozenset[fx.Node]]]
    """For each change in place (:func:`changed_in_place`): the value that first held
    the memory it changed, and the other values still to be read when it ran that held
    that memory too (a view of it, it as a view of another, the same tensor passed on
    by ``nn.Identity``, its ``detach()``)."""
    inside: dict[fx.Node, tuple[str, ...]]
    """For each call of a submodule split calls whole: the buffers it changed (names in
    the module), which no change in place in the graph shows."""


def value_kinds(module: nn.Module, graph: fx.Graph, example: Any, kind: InputKind) -> ExampleRun:
    """Run the example through the graph, in eval mode, without grad: what its values are.

    The run changes nothing: batch norm's statistics are left alone (eval), the random
    numbers come from generators of the run's own (``own_generators``), and the
    constants it changes in place are put back (``split`` keeps the module's buffers).
    """
    modes = {m: m.training for m in module.modules()}
    if kind == "one":
        args: tuple[Any, ...] = (example,)
    elif kind == "args":
        args = tuple(example)
    else:
        args = tuple(example[p.target] for p in graph.nodes if p.op == "placeholder")
    kinds: dict[fx.Node, Kind] = {}
    constants: dict[str, tuple[Tensor, int, Tensor]] = {}  # as they were: version, value
    aliased: dict[fx.Node, tuple[fx.Node, frozenset[fx.Node]]] = {}
    holders: dict[int, list[fx.Node]] = {}  # a memory: the values that held it, in order
    origin: dict[int, fx.Node] = {}  # a memory: the value that first held it, while held

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            changed = changed_in_place(module, n)
            if changed is not None and isinstance(self.env.get(changed), Tensor):
                mine = _memory(self.env[changed])  # against the values alive now: to be read
                alive = frozenset(m for m in holders.get(mine, ()) if m in self.env)
                aliased[n] = (origin.get(mine, changed), alive - {changed})
            value = super().run_node(n)
            for memory in {_memory(x) for x in _tensors(value)}:
                held = holders.setdefault(memory, [])
                if not any(m in self.env for m in held):  # fresh memory (or reused)
                    held.clear()
                    origin[memory] = n
                held.append(n)
            if isinstance(value, Tensor):
                kinds[n] = ("tensor", value.device)
                target = str(n.target)
                if n.op == "get_attr" and target.startswith("_tensor_constant"):
                    constants.setdefault(target, (value, value._version, value.clone()))
            elif isinstance(value, torch.device):
                kinds[n] = ("device", value)
            return value

    graph_run = fx.GraphModule(module, graph)
    try:
        module.eval()
        with torch.no_grad():
            recorded = lambda: Record(graph_run).run(*args)  # noqa: E731
            captured_as_computed(module, recorded, lambda: graph_run(*args), example, kind)
        inside = changed_inside(module, graph_run, args)
    finally:
        for m, training in modes.items():
            m.training = training
        changed = frozenset(t for t, (v, version, _) in constants.items() if v._version != version)
        with torch.no_grad():
            for target in changed:
                constants[target][0].copy_(constants[target][2])
    return ExampleRun(kinds, changed, aliased, inside)


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in ``value``: as the pipeline sees them (dataclasses too), or pytree's."""
    return [x for x in leaves(value) if isinstance(x, Tensor)]


def _memory(tensor: Tensor) -> int:
    """Which memory ``tensor`` is in: its storage, or (meta, empty, sparse) its base's id."""
    try:
        pointer = 0 if tensor.is_meta else tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # sparse and others without a storage
        pointer = 0
    return pointer or id(tensor._base if tensor._base is not None else tensor)


_IN_PLACE_OPERATORS = {
    getattr(operator, f"i{name}")
    for name in [
        *("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
        *("and", "or", "xor", "lshift", "rshift"),
    ]
} | {operator.setitem}
_FLAGS = {"requires_grad_", "share_memory_"}  # in place, but on no values


def changed_in_place(module: nn.Module, node: fx.Node) -> fx.Node | None:
    """The value ``node`` changes in place, if it is an in-place operation on one.

    An operation named so (``relu_``, ``+=``, ``inplace=True``), or a call of a module
    that says it works in place (``nn.ReLU(inplace=True)``: torch's own set ``inplace``).
    """
    if isinstance(node.kwargs.get("out"), fx.Node):
        return node.kwargs["out"]  # type: ignore[return-value]  # checked just above
    if node.op == "call_module":
        works_in_place = getattr(module.get_submodule(str(node.target)), "inplace", False)
        target = node.args[0] if works_in_place is True and node.args else None
        return target if isinstance(target, fx.Node) else None
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and str(getattr(node.target, "__module__", "")).startswith(
        "torch"
    ):
        name = getattr(node.target, "__name__", "")
    else:
        name = ""
    in_place = (
        node.target in _IN_PLACE_OPERATORS
        or (name.endswith("_") and not name.endswith("__") and name not in _FLAGS)
        or node.kwargs.get("inplace") is True
    )
    target = node.args[0] if in_place and node.args else None
    return target if isinstance(target, fx.Node) else None
