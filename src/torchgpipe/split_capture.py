"""Capturing a module's forward for ``split.py``: the trace, and where stages may start.

``torch.fx`` traces through the module's own forward, containers, the modules on the
way to a split point and (``stages=k``) the largest submodules it can capture until
there are enough calls; every other submodule stays one call. Each trace is made in
both modes, and refused if ``train()`` and ``eval()`` give different code. Then the
example runs once through the graph, to learn which values are tensors and devices.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from torchgpipe.split_stage import InputKind

Kind = tuple[str, torch.device]
"""What a node's value was in the example: ``("tensor", its device)`` or ``("device", it)``."""

__all__ = [
    "TORCH_DIR",
    "Kind",
    "SplitError",
    "ancestors",
    "candidates",
    "compute_nodes",
    "cuts_at",
    "inputs_of",
    "trace_forward",
    "trace_into",
    "value_kinds",
    "where_made",
]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_CALLS = ("call_module", "call_function", "call_method")
TORCH_DIR = os.path.dirname(torch.__file__)
# The machinery between a forward's line and the tracer's error: not where it failed.
_MACHINERY = (
    os.path.join(TORCH_DIR, "fx", ""),
    os.path.join(TORCH_DIR, "nn", "modules", "module.py"),
    os.path.join(TORCH_DIR, "__init__.py"),
    os.path.join(TORCH_DIR, "_tensor.py"),
    __file__,
)


class SplitError(ValueError):
    """A module cannot be split as asked; the message says where, why, and what to do."""


# Capturing the forward.


class _Tracer(fx.Tracer):
    """Traces through the root, containers and the modules in ``through``; calls the rest."""

    def __init__(self, through: set[str]) -> None:
        super().__init__()
        self.through = through
        self.record_stack_traces = True  # for errors that name the line

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not (isinstance(m, _CONTAINERS) or module_qualified_name in self.through)


def inputs_of(module: nn.Module, example: Any) -> tuple[InputKind, tuple[str, ...], dict[str, Any]]:
    """How the split model takes its input, the names it fills, and the defaults kept."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    variadic = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise SplitError(
            f"{type(module).__name__}.forward takes *{variadic[0]}; split needs named "
            f"parameters: wrap the module in one whose forward names its arguments"
        )
    kind: InputKind
    if isinstance(example, dict):
        kind, given = "kwargs", list(example)
        unknown = [name for name in given if name not in [p.name for p in parameters]]
        if unknown:
            raise TypeError(f"{type(module).__name__}.forward has no parameters {unknown}")
        given = [p.name for p in parameters if p.name in example]  # in the forward's order
    elif isinstance(example, tuple):
        kind, given = "args", [p.name for p in parameters[: len(example)]]
        if len(example) > len(parameters):
            raise TypeError(
                f"example_input gives {len(example)} positional arguments; "
                f"{type(module).__name__}.forward takes {len(parameters)}"
            )
    else:
        kind, given = "one", [p.name for p in parameters[:1]]
    concrete = {}
    for p in parameters:
        if p.name in given:
            continue
        if p.default is p.empty:
            raise TypeError(
                f"example_input does not give {type(module).__name__}.forward's argument "
                f"{p.name!r}, which has no default; give it (a tuple or dict of arguments)"
            )
        concrete[p.name] = p.default
    return kind, tuple(given), concrete


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
    modes = {m: m.training for m in module.modules()}
    try:
        for m, training in modes.items():
            m.training = not training
        other = _traced(module, through, concrete)
    finally:
        for m, training in modes.items():
            m.training = training
    ours, theirs = _code(graph), _code(other)
    if ours != theirs:
        first = next(
            (a for a, b in zip(graph.nodes, other.nodes, strict=False) if _shown(a) != _shown(b)),
            None,
        )
        where = where_made(first) if first is not None else ""
        raise SplitError(
            f"cannot split {type(module).__name__}: code that split captures{where} "
            f"depends on train() or eval() (self.training, F.dropout(..., "
            f"training=self.training)), and the stages would keep the mode they were "
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
    return graph


def _traced(module: nn.Module, through: set[str], concrete: dict[str, Any]) -> fx.Graph:
    try:
        return _Tracer(through).trace(module, concrete_args=concrete or None)
    except Exception as error:
        raise SplitError(_trace_failure(module, error)) from error


def _code(graph: fx.Graph) -> str:
    """The graph's code, up to the names fx gives the constants it keeps on the module."""
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", graph.python_code("self").src)


def _shown(node: fx.Node) -> str:
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", node.format_node() or "")


def where_made(node: fx.Node) -> str:
    """Where in the user's code ``node`` was made, as `` (file:line)``, if known."""
    frames = []
    for line in (node.stack_trace or "").splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            if not path.startswith(TORCH_DIR):
                frames.append(f"{path}:{rest.split(',')[0]}")
    return f" ({frames[-1]})" if frames else ""


def _trace_failure(module: nn.Module, error: Exception) -> str:
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_MACHINERY)
    ]
    where = ""
    if frames:  # the last line run before the tracer's machinery: a forward's
        f = frames[-1]
        where = f" at {f.filename}:{f.lineno} in {f.name} (`{(f.line or '').strip()}`)"
    return (
        f"cannot split {type(module).__name__}: torch.fx could not capture its forward{where}: "
        f"{error}. Code that branches on a tensor's value, or loops over one, cannot be "
        f"captured; move it into a submodule (split runs a submodule as one call, with "
        f"any control flow), or out of the model"
    )


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
            and not type(module.get_submodule(name)).__module__.startswith("torch.")
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
            f"stages, or name split points inside its submodules with at=[...]"
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
            raise SplitError(
                f"split point {name!r} is a submodule of {type(module).__name__} that its "
                f"forward never calls; name a submodule the forward uses"
            )
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


def value_kinds(
    module: nn.Module, graph: fx.Graph, example: Any, kind: InputKind
) -> dict[fx.Node, Kind]:
    """The nodes whose value was a tensor (and its device) or a device, in the example.

    In eval mode, without grad.

    The run changes nothing: batch norm's statistics are left alone (eval), and the
    random numbers drawn are given back (``fork_rng``).
    """
    modes = {m: m.training for m in module.modules()}
    if kind == "one":
        args: tuple[Any, ...] = (example,)
    elif kind == "args":
        args = tuple(example)
    else:
        args = tuple(example[p.target] for p in graph.nodes if p.op == "placeholder")
    kinds: dict[fx.Node, Kind] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, Tensor):
                kinds[n] = ("tensor", value.device)
            elif isinstance(value, torch.device):
                kinds[n] = ("device", value)
            return value

    devices = sorted({x.device.index or 0 for x in module.parameters() if x.is_cuda})
    try:
        module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            Record(fx.GraphModule(module, graph)).run(*args)
    finally:
        for m, training in modes.items():
            m.training = training
    return kinds
