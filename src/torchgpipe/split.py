"""Split any module into pipeline stages: ``split(module, example_input, at=...)``.

The module's forward is captured with ``torch.fx`` into a graph of calls: calls of
submodules, of functions and of tensor methods, in the order the forward makes them.
Cutting that order at the split points gives the stages. Each stage is a
:class:`Stage`, a skippable module (:mod:`torchgpipe.skip`) that runs its piece of the
graph on the original submodules, so ``GPipe``, ``PipelineStage`` and every schedule
run a split model as they run any ``nn.Sequential``:

- a value the next stage needs is part of the output a stage hands on;
- a tensor a later stage needs is stashed as a skip and popped there: it goes straight
  from the stage that makes it to the one that uses it. Other values (numbers, tuples)
  travel with the stages' outputs through the stages between.

Why ``torch.fx`` and not ``torch.export``: export records ATen operators, so the
submodules a user names as split points are gone from the graph (only metadata says
where they were); it fixes train or eval mode and, unless told otherwise, the shapes
of the example; and its program holds the parameters as inputs, not in the user's
modules. ``torch.fx`` keeps each submodule a call of that very module: the stages hold
the original modules (no copies), their ``state_dict`` keys are the model's, Dropout
and batch norm follow ``train()`` and ``eval()`` as they do in the model, and any
batch size works. Only the forwards ``split`` traces through are captured: the model's
own, containers' (``nn.Sequential``), and those of the submodules on the way to a
split point. Every other submodule is one call, run as Python, with whatever control
flow it has. Export would add nothing where fx fails (a branch on a tensor's value
stops both), so there is no fallback: the error says which line to move into a
submodule.
"""

from __future__ import annotations

import bisect
import difflib
import inspect
import os
import traceback
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, fx, nn

from torchgpipe.skip.skippable import Namespace, Skippable
from torchgpipe.split_stage import InputKind, Stage, keep_plain_keys

__all__ = ["SplitError", "Stage", "split"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_CALLS = ("call_module", "call_function", "call_method")
_TORCH_DIR = os.path.dirname(torch.__file__)
# The machinery between a forward's line and the tracer's error: not where it failed.
_MACHINERY = (
    os.path.join(_TORCH_DIR, "fx", ""),
    os.path.join(_TORCH_DIR, "nn", "modules", "module.py"),
    os.path.join(_TORCH_DIR, "__init__.py"),
    os.path.join(_TORCH_DIR, "_tensor.py"),
    __file__,
)


class SplitError(ValueError):
    """A module cannot be split as asked; the message says where, why, and what to do."""


def split(
    module: nn.Module,
    example_input: Any,
    *,
    at: Sequence[str] | None = None,
    stages: int | None = None,
    by: Literal["time", "size"] = "time",
) -> nn.Sequential:
    """Split ``module`` into an ``nn.Sequential`` of stages that computes what it computes.

    Give the split points by name (``at``: each names the submodule a new stage starts
    with, in the order the forward calls them) or a number of ``stages``, balanced by
    :mod:`torchgpipe.balance` on ``example_input`` (``by`` time or size). Wrap the
    result in ``GPipe`` (one layer per stage: ``balance=[1] * len(stages)``), or use
    its stages in ``PipelineStage``; it also runs as it is.

    The stages hold the module's own submodules and parameters, not copies, and the
    result's ``state_dict()`` keys are the module's: a checkpoint of either loads into
    the other. A parameter used by two stages (a tied embedding and output head) is one
    tensor here; ``GPipe`` gives each partition a copy and keeps them equal.

    Args:
        module: the model; its forward is captured with ``torch.fx`` (see the module's
            documentation for what it can capture).
        example_input: an input of the model, on its device: a tensor (the forward's
            first argument), a tuple (its positional arguments) or a dict (arguments
            by name). The split model takes its input in the same form, and the
            arguments left out keep their defaults.
        at: names of submodules (``"blocks.4"``) where stages start.
        stages: a number of stages to balance instead.
        by: what ``stages`` balances: ``"time"`` or ``"size"`` (memory).

    Raises:
        SplitError: the forward cannot be captured (says which line and why), a split
            point names no submodule or is out of order, a submodule would be called
            from two stages, or the model has too few parts for ``stages``.
        TypeError: an argument has the wrong type.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"split takes an nn.Module, got {type(module).__name__}")
    if (at is None) == (stages is None):
        raise TypeError("split takes either at=[submodule names] or stages=<count>, not both")
    if any(isinstance(m, Skippable) for m in module.modules()):
        raise SplitError(
            f"{type(module).__name__} holds torchgpipe.skip layers; split makes the skips "
            f"itself: write the model as plain modules, or wrap it in GPipe as it is"
        )
    kind, names, concrete = _inputs(module, example_input)
    if at is not None:
        if isinstance(at, str) or not all(isinstance(name, str) for name in at):
            raise TypeError(f"at takes a list of submodule names, got {at!r}")
        through = _ancestors(module, at)
        graph = _trace(module, through, concrete)
        cuts = _cuts_at(module, graph, list(at))
        return _build(
            module, graph, cuts, kind, names, _tensor_nodes(module, graph, example_input, kind)
        )
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise TypeError(f"stages must be a positive int, got {stages!r}")
    if by not in ("time", "size"):
        raise TypeError(f"by is 'time' or 'size', got {by!r}")
    graph = _trace_into(module, stages, concrete)
    tensors = _tensor_nodes(module, graph, example_input, kind)
    candidates = _candidates(graph)
    units = _build(module, graph, candidates, kind, names, tensors)
    from torchgpipe import balance as balancing

    solve = balancing.balance_by_time if by == "time" else balancing.balance_by_size
    with torch.random.fork_rng(devices=[]):  # timing draws no number the user will miss
        counts = solve(stages, units, example_input)
    ends = [sum(counts[: j + 1]) for j in range(len(counts) - 1)]
    return _build(module, graph, [candidates[end - 1] for end in ends], kind, names, tensors)


# Capturing the forward.


class _Tracer(fx.Tracer):
    """Traces through the root, containers and the modules in ``through``; calls the rest."""

    def __init__(self, through: set[str]) -> None:
        super().__init__()
        self.through = through
        self.record_stack_traces = True  # for errors that name the line

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not (isinstance(m, _CONTAINERS) or module_qualified_name in self.through)


def _inputs(module: nn.Module, example: Any) -> tuple[InputKind, tuple[str, ...], dict[str, Any]]:
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


def _ancestors(module: nn.Module, at: Sequence[str]) -> set[str]:
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


def _trace(module: nn.Module, through: set[str], concrete: dict[str, Any]) -> fx.Graph:
    given = [p for p in inspect.signature(module.forward).parameters if p not in concrete]
    try:
        graph = _Tracer(through).trace(module, concrete_args=concrete or None)
    except Exception as error:
        raise SplitError(_trace_failure(module, error)) from error
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


def _trace_into(module: nn.Module, stages: int, concrete: dict[str, Any]) -> fx.Graph:
    """Trace through ever larger submodules until the forward makes ``stages`` calls."""
    through: set[str] = set()
    while True:
        graph = _trace(module, through, concrete)
        if len(_candidates(graph)) + 1 >= stages:
            return graph
        called = {n.target for n in graph.nodes if n.op == "call_module"}
        expandable = [
            (sum(p.numel() for p in module.get_submodule(name).parameters()), name)
            for name in called
            if isinstance(name, str)
            and next(module.get_submodule(name).children(), None) is not None
            and not type(module.get_submodule(name)).__module__.startswith("torch.")
        ]
        if not expandable:
            raise SplitError(
                f"cannot cut {type(module).__name__} into {stages} stages: its forward "
                f"calls {len(_candidates(graph)) + 1} modules in turn; ask for fewer "
                f"stages, or name split points inside its submodules with at=[...]"
            )
        through.add(max(expandable)[1])


def _compute(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if node.op in _CALLS]


def _candidates(graph: fx.Graph) -> list[int]:
    """Where a stage may start: at each call of a submodule but the first call."""
    return [k for k, node in enumerate(_compute(graph)) if node.op == "call_module" and k > 0]


def _belongs(node: fx.Node, name: str) -> bool:
    if node.op == "call_module" and (
        node.target == name or str(node.target).startswith(name + ".")
    ):
        return True
    stack = node.meta.get("nn_module_stack") or {}
    return any(path == name or str(path).startswith(name + ".") for path, _ in stack.values())


def _cuts_at(module: nn.Module, graph: fx.Graph, at: list[str]) -> list[int]:
    compute = _compute(graph)
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


def _tensor_nodes(
    module: nn.Module, graph: fx.Graph, example: Any, kind: InputKind
) -> set[fx.Node]:
    """The nodes whose value was a tensor when the example ran (in eval mode, no grad).

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
    tensors: set[fx.Node] = set()

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, Tensor):
                tensors.add(n)
            return value

    devices = sorted({x.device.index or 0 for x in module.parameters() if x.is_cuda})
    try:
        module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            Record(fx.GraphModule(module, graph)).run(*args)
    finally:
        for m, training in modes.items():
            m.training = training
    return tensors


# Building the stages.


def _build(
    module: nn.Module,
    graph: fx.Graph,
    cuts: list[int],
    kind: InputKind,
    names: tuple[str, ...],
    tensors: set[fx.Node],
) -> nn.Sequential:
    compute = _compute(graph)
    count = len(cuts) + 1
    stage_of: dict[fx.Node, int] = {n: bisect.bisect_right(cuts, k) for k, n in enumerate(compute)}
    _check_modules(module, compute, stage_of)
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    for node in inputs:
        stage_of[node] = 0
    output = next(node for node in graph.nodes if node.op == "output")

    # Which earlier values each stage uses, and how each travels there.
    uses: dict[fx.Node, set[int]] = {}
    for node in compute:
        for used in node.all_input_nodes:
            if used.op != "get_attr" and stage_of[used] < stage_of[node]:
                uses.setdefault(used, set()).add(stage_of[node])
    for used in output.all_input_nodes:
        if used.op != "get_attr" and stage_of[used] < count - 1:
            uses.setdefault(used, set()).add(count - 1)
    chain: list[list[fx.Node]] = [[] for _ in range(count)]  # arriving from the stage before
    pops: list[list[fx.Node]] = [[] for _ in range(count)]
    stashes: list[list[tuple[fx.Node, int]]] = [[] for _ in range(count)]
    order = {node: k for k, node in enumerate(graph.nodes)}
    for value in sorted(uses, key=order.__getitem__):
        made = stage_of[value]
        for stage in sorted(uses[value]):
            if stage > made + 1 and value in tensors:
                pops[stage].append(value)
                stashes[made].append((value, stage))
            else:
                for between in range(made + 1, stage + 1):
                    if value not in chain[between]:
                        chain[between].append(value)
    namespace = Namespace("split")
    result = []
    for j in range(count):
        piece = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for value in inputs if j == 0 else chain[j]:
            env[value] = piece.placeholder(value.name)
        for value in pops[j]:
            env[value] = piece.placeholder(f"{value.name}_skip")

        def local(
            node: fx.Node, env: dict[fx.Node, fx.Node] = env, piece: fx.Graph = piece
        ) -> fx.Node:
            if node not in env:  # a parameter or buffer: each stage reads its own
                assert node.op == "get_attr"
                env[node] = piece.get_attr(str(node.target))
            return env[node]

        for node in compute:
            if stage_of[node] == j:
                env[node] = piece.node_copy(node, local)
                env[node].meta = {}
        if j == count - 1:
            piece.output(fx.map_arg(output.args[0], local))
        else:
            passed = tuple(local(value) for value in chain[j + 1])
            piece.output((passed, tuple(local(value) for value, _ in stashes[j])))
        piece.lint()
        result.append(
            Stage(
                module,
                piece,
                index=j,
                count=count,
                input_kind=kind,
                input_names=names,
                pops=tuple(f"{value.name}@{j}" for value in pops[j]),
                stashes=tuple(f"{value.name}@{stage}" for value, stage in stashes[j]),
                namespace=namespace,
            )
        )
    sequential = nn.Sequential(*result)
    keep_plain_keys(sequential)
    return sequential


def _check_modules(module: nn.Module, compute: list[fx.Node], stage_of: dict[fx.Node, int]) -> None:
    """Refuse a submodule called from two stages: its state would live in two places."""
    called: dict[str, tuple[int, fx.Node]] = {}
    for node in compute:
        if node.op != "call_module":
            continue
        name = str(node.target)
        for other, (stage, first) in called.items():
            related = name == other or name.startswith(other + ".") or other.startswith(name + ".")
            if related and stage != stage_of[node]:
                raise SplitError(
                    f"{type(module).__name__}'s forward calls {other!r} in stage {stage}"
                    f"{_line(first)} and {name!r} in stage {stage_of[node]}{_line(node)}: "
                    f"one module would land in two stages; move the split points so both "
                    f"calls fall in one stage, or use two modules"
                )
        called.setdefault(name, (stage_of[node], node))


def _line(node: fx.Node) -> str:
    """Where in the user's code ``node`` was made, as `` (file:line)``, if known."""
    frames = []
    for line in (node.stack_trace or "").splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            if not path.startswith(_TORCH_DIR):
                frames.append(f"{path}:{rest.split(',')[0]}")
    return f" ({frames[-1]})" if frames else ""
