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
own, containers' (``nn.Sequential``), those of the submodules on the way to a split
point, and for ``stages=k`` the largest submodules until there are enough calls to
cut between. Every other submodule is one call, run as Python, with whatever control
flow it has. Captured code must not depend on the mode (``self.training``): it is
traced in both and refused if it does. Export would add nothing where fx fails (a
branch on a tensor's value stops both), so there is no fallback: the error says which
line to move into a submodule.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

from torch import fx, nn

from torchgpipe.materialize import on_meta
from torchgpipe.skip.skippable import Namespace, Skippable
from torchgpipe.split_buffers import kept_buffers
from torchgpipe.split_capture import (
    ExampleRun,
    Kind,
    ancestors,
    candidates,
    changed_in_place,
    compute_nodes,
    cuts_at,
    trace_forward,
    trace_into,
    value_kinds,
    where_made,
)
from torchgpipe.split_inputs import inputs_of
from torchgpipe.split_refusals import refuse_lost_state
from torchgpipe.split_stage import (
    InputKind,
    Placeholder,
    SplitError,
    Stage,
    held_apart,
    keep_plain_keys,
)

__all__ = ["SplitError", "Stage", "split"]

_SPLITTING = threading.RLock()  # see split(); a forward split runs may split (its own child)


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

    The stages hold the module's own submodules and parameters, not copies, all of
    them (what the forward never uses too: ``split_stage.held_apart``), and the
    result's ``state_dict()`` keys are the module's, in its order: a checkpoint of
    either loads into the other. A parameter used by two stages (a tied embedding and
    output head) is one tensor here; ``GPipe`` gives each partition a copy and keeps
    them equal.

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
        ValueError: ``by`` is neither ``"time"`` nor ``"size"``, ``stages`` is not
            positive, or ``stages`` is given for a model on the meta device (balancing
            runs it).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"split takes an nn.Module, got {type(module).__name__}")
    if (at is None) == (stages is None):
        given = "neither" if at is None else "both"
        raise TypeError(
            f"split takes exactly one of at=[submodule names] or stages=<count>; got {given}"
        )
    kinds = ("forward", "forward_pre", "backward", "backward_pre")
    hooked = [kind.replace("_", " ") for kind in kinds if getattr(module, f"_{kind}_hooks")]
    if hooked:
        raise SplitError(
            f"{type(module).__name__} has {' and '.join(hooked)} hooks, which split cannot "
            f"keep: torch.fx captures its forward alone, so the stages would run without "
            f"them; remove them, and register them on what runs the stages (the GPipe), "
            f"or on a submodule that split calls whole"
        )
    if any(isinstance(m, Skippable) for m in module.modules()):
        again = any(isinstance(m, Stage) for m in module.modules())  # split's own output
        raise SplitError(
            f"{type(module).__name__} holds torchgpipe.skip layers; split makes the skips "
            f"itself: write the model as plain modules, or wrap it in GPipe as it is"
            + (" (split's output: split the original model again)" if again else "")
        )
    refuse_lost_state(module, "")
    if taken := [n for n in (*module._modules, *module._parameters, *module._buffers) if _taken(n)]:
        raise SplitError(f"cannot split {type(module).__name__}: its attributes {taken} are "
                         f"named as the stages' (or torch.fx's) own: rename them")  # fmt: skip
    kind, names, concrete = inputs_of(module, example_input)
    # One split at a time: fx patches nn.Module.__call__ process-wide while it traces.
    with _SPLITTING, _kept(module):  # _kept drops the tensors fx keeps on the module too
        return _split(module, example_input, at, stages, by, kind, names, concrete)


@contextmanager
def _kept(module: nn.Module) -> Iterator[None]:
    """Leave ``module`` as it was: its attributes, and its buffers' values.

    Split runs the example through the forward (and, for ``stages=k``, each stage to
    time it): a running mean or a step counter the forward updates in place would
    count those runs. The buffers are copied first, and put back.
    """
    attributes = {m: dict(vars(m)) for m in module.modules()}
    versions = {name: p._version for name, p in module.named_parameters()}
    try:
        with kept_buffers(module):
            yield
    finally:
        for m, attrs in attributes.items():
            for name in [n for n in vars(m) if n not in attrs]:
                del m.__dict__[name]
            m.__dict__.update(attrs)
    changed = [name for name, p in module.named_parameters() if p._version != versions[name]]
    if changed:
        raise SplitError(
            f"{type(module).__name__}'s forward changed its parameters {changed} in place "
            f"when split ran the example through it, and split cannot undo that; keep "
            f"state a forward updates in buffers (register_buffer), not in parameters "
            f"(nn.Embedding(max_norm=...) does so: split it with max_norm None, then set it)"
        )


def _split(
    module: nn.Module,
    example_input: Any,
    at: Sequence[str] | None,
    stages: int | None,
    by: str,
    kind: InputKind,
    names: tuple[str, ...],
    concrete: dict[str, Any],
) -> nn.Sequential:
    if by not in ("time", "size"):
        raise ValueError(f"by is 'time' or 'size', got {by!r}")
    if at is not None:
        if isinstance(at, str) or not all(isinstance(name, str) for name in at):
            raise TypeError(f"at takes a list of submodule names, got {at!r}")
        through = ancestors(module, at)
        graph = trace_forward(module, through, concrete)
        run = value_kinds(module, graph, example_input, kind)
        kinds = _fresh_constants(graph, run)
        cuts = cuts_at(module, graph, list(at))
        return _build(module, graph, cuts, kind, names, kinds, run=run)
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise TypeError(f"stages must be a positive int, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be a positive int, got {stages}")
    if on_meta(module):
        raise ValueError(
            "split(stages=...) balances the stages by running them, and this model is on "
            "the meta device, where nothing runs; give the split points by name "
            "(at=[...]), or split a copy of the model built with values"
        )
    graph = trace_into(module, stages, concrete)
    run = value_kinds(module, graph, example_input, kind)
    kinds = _fresh_constants(graph, run)
    starts = candidates(graph)
    units = _build(module, graph, starts, kind, names, kinds)
    from torchgpipe import balance as balancing

    solve = balancing.balance_by_time if by == "time" else balancing.balance_by_size
    counts = solve(stages, units, example_input)  # own generators: balance/profile.py
    ends = [sum(counts[: j + 1]) for j in range(len(counts) - 1)]
    cuts = [starts[end - 1] for end in ends]
    return _build(module, graph, cuts, kind, names, kinds, run=run)


def _fresh_constants(graph: fx.Graph, run: ExampleRun) -> dict[fx.Node, Kind]:
    """Give each call a copy of the constants the graph changes in place.

    fx makes ``torch.zeros(4)`` once, at trace time, and keeps it: changed in place
    (``acc += ...``), it would carry each call's changes to the next. One copy for all
    the uses of one constant (fx reads it anew at each): the change reaches them all.
    """
    kinds = dict(run.kinds)
    fresh: dict[str, fx.Node] = {}  # one copy per constant, which all its uses read
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in run.changed:
            copy = fresh.get(str(node.target))
            if copy is None:
                with graph.inserting_after(node):
                    copy = fresh[str(node.target)] = graph.call_method("clone", (node,))
                kinds[copy] = kinds[node]
            node.replace_all_uses_with(copy, delete_user_cb=partial(operator.is_not, copy))
    return kinds


# Building the stages.


def _build(
    module: nn.Module,
    graph: fx.Graph,
    cuts: list[int],
    kind: InputKind,
    names: tuple[str, ...],
    kinds: dict[fx.Node, Kind],
    *,
    run: ExampleRun | None = None,
) -> nn.Sequential:
    """The stages of ``graph`` cut before the calls at ``cuts``.

    ``run``: the example's (``ExampleRun``), to check changes in place across the
    cuts; None: the pieces
    ``stages=k`` profiles, cut at every candidate, where a change across their cuts is
    refused only if the stages chosen keep it.
    """
    compute = compute_nodes(graph)
    count = len(cuts) + 1
    stage_of: dict[fx.Node, int] = {n: bisect.bisect_right(cuts, k) for k, n in enumerate(compute)}
    _check_modules(module, compute, stage_of)
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    for node in inputs:
        stage_of[node] = 0
    output = next(node for node in graph.nodes if node.op == "output")
    if run is not None:
        _check_in_place(module, compute, stage_of, run)

    # Which earlier values each stage uses, and how each travels there.
    tensors = {node for node, (kind, _) in kinds.items() if kind == "tensor"}
    uses: dict[fx.Node, set[int]] = {}
    devices: dict[int, set[fx.Node]] = {}  # per stage: the devices made before it
    for node, stage in [*((n, stage_of[n]) for n in compute), (output, count - 1)]:
        for used in node.all_input_nodes:
            if used.op == "get_attr" or stage_of[used] >= stage:
                continue
            if used in kinds and kinds[used][0] == "device":
                devices.setdefault(stage, set()).add(used)
            else:
                uses.setdefault(used, set()).add(stage)
    chain: list[list[fx.Node]] = [[] for _ in range(count)]  # arriving from the stage before
    pops: list[list[fx.Node]] = [[] for _ in range(count)]
    stashes: list[list[tuple[fx.Node, int]]] = [[] for _ in range(count)]

    def along(value: fx.Node, stage: int) -> None:  # with every stage's output till there
        for between in range(stage_of[value] + 1, stage + 1):
            if value not in chain[between]:
                chain[between].append(value)

    order = {node: k for k, node in enumerate(graph.nodes)}
    for value in sorted(uses, key=order.__getitem__):
        for stage in sorted(uses[value]):
            if stage > stage_of[value] + 1 and value in tensors:
                pops[stage].append(value)
                stashes[stage_of[value]].append((value, stage))
            else:
                along(value, stage)
    # A device made by an earlier stage (``x.device``) is read again from a tensor the
    # stage receives, which is on this stage's device: the stages may run on others.
    anchors: dict[tuple[int, fx.Node], fx.Node] = {}  # (stage, device): read from this
    for stage, made in devices.items():
        arrived = [v for v in [*chain[stage], *pops[stage]] if v in tensors]
        for value in sorted(made, key=order.__getitem__):
            read_from = value.args[0] if value.op == "call_function" and value.args else None
            # On the same device in the example; made by the model rather than given to
            # it (an input may be kept elsewhere on purpose: lengths on the CPU).
            same = [v for v in arrived if kinds[v][1] == kinds[value][1]]
            same.sort(key=lambda v: v.op == "placeholder")
            anchor = read_from if read_from in arrived else (same[0] if same else None)
            if isinstance(anchor, fx.Node):
                anchors[(stage, value)] = anchor
            else:  # nothing here to read it from: it travels as it is
                along(value, stage)
    pieces = []
    for j in range(count):
        piece = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for value in inputs if j == 0 else chain[j]:
            env[value] = piece.placeholder(value.name)
        for value in pops[j]:
            env[value] = piece.placeholder(f"{value.name}_skip")

        def local(
            node: fx.Node, env: dict[fx.Node, fx.Node] = env, piece: fx.Graph = piece, j: int = j
        ) -> fx.Node:
            if node in env:
                return env[node]
            if node.op == "get_attr":  # a parameter or buffer: each stage reads its own
                env[node] = piece.get_attr(str(node.target))
            else:  # a device made earlier, read from a tensor that arrived here
                env[node] = piece.call_function(getattr, (env[anchors[(j, node)]], "device"))
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
        pieces.append(piece)
    namespace = Namespace("split")
    order = {key: k for k, key in enumerate(module.state_dict(keep_vars=True))}
    result = [
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
            apart=apart,
            order=order,
        )
        for j, (piece, apart) in enumerate(zip(pieces, held_apart(module, pieces), strict=True))
    ]
    # What held_apart left out (lazy, or meta where the rest has values): its keys are
    # the module's, so a state dict of the module may hold them (materialize skips them).
    if run is not None:  # the stages chosen, not the pieces stages=k times
        for path, held_part in (p for part in result for p in part.named_modules()):
            if isinstance(held_part, Placeholder):
                refuse_lost_state(module.get_submodule(path), path)
    held = {key for piece_stage in result for key in piece_stage.key_order}
    for piece_stage in result:
        piece_stage.left_out = tuple(key for key in order if key not in held)
    sequential = nn.Sequential(*result)
    keep_plain_keys(sequential)
    return sequential


def _check_modules(module: nn.Module, compute: list[fx.Node], stage_of: dict[fx.Node, int]) -> None:
    """Refuse a module that two stages call: its state would live in two places.

    By identity: the same submodule called again, a submodule inside another that a
    later stage calls, or one module held under two names (``b.norm = a.norm``).
    """
    seen: dict[int, tuple[int, fx.Node, str]] = {}  # a module's id: where it is first called
    for node in compute:
        if node.op != "call_module":
            continue
        target = str(node.target)
        held = module.get_submodule(target).named_modules(prefix=target, remove_duplicate=False)
        for path, sub in held:
            stage, first, name = seen.setdefault(id(sub), (stage_of[node], node, path))
            if stage != stage_of[node]:
                raise SplitError(
                    f"{type(module).__name__}'s forward calls {name!r} in stage {stage}"
                    f"{where_made(first)} and {path!r} in stage {stage_of[node]}"
                    f"{where_made(node)}"
                    f"{', one module under two names' if name != path else ''}: one module "
                    f"would land in two stages; move the split points so both calls fall "
                    f"in one stage, or use two modules (they may share parameters)"
                )


def _check_in_place(
    module: nn.Module,
    compute: list[fx.Node],
    stage_of: dict[fx.Node, int],
    run: ExampleRun,
) -> None:
    """Refuse a value changed in place by a later stage than the one that makes it.

    A stage gets its own handle on a value from an earlier one (its input, a skip, a
    tensor received from another process): a change made there would not reach the
    stages that read the value as a skip, and the gradients would follow the value as
    it was. So is a change of memory an earlier stage's value still to be read shares
    (a view of ``h``, ``h.detach()``, ``h`` passed on by ``nn.Identity``, in the
    example run), wherever the changed value was made. A change nothing else sees is
    fine (the value's one use): the pipeline gives a stage inputs it may change, as it
    does for a partition that starts with ``nn.ReLU(inplace=True)``. Nor may a buffer
    that a submodule split calls whole changes be read in another stage.
    """
    problems, shared, aliased = [], [], run.aliased
    readers: dict[str, set[int]] = {}  # per parameter, buffer or module: the stages reading it
    for node in compute:
        if node.op == "call_module":  # its own parameters and buffers
            readers.setdefault(f"{node.target}.", set()).add(stage_of[node])
        for used in node.all_input_nodes:
            if used.op == "get_attr":
                readers.setdefault(str(used.target), set()).add(stage_of[node])
    # Buffers changed: by a submodule split calls whole, or in place in the graph.
    changes = [(n, t, f"by {n.target!r}") for n in compute for t in run.inside.get(n, ())]
    for node in compute:
        value = changed_in_place(module, node)
        if value is None:
            continue
        # A buffer, or a view of one (buf[:2].add_, buf.data), as the example run saw.
        held = value if value.op == "get_attr" else aliased.get(node, (value,))[0]
        if held.op == "get_attr":
            # A constant fx kept is made anew at each call (_fresh_constants): no buffer.
            if not str(held.target).startswith("_tensor_constant"):
                changes.append((node, str(held.target), f"in place by {_name(node)}"))
            continue
        # Seen elsewhere: a value of an earlier stage read again, or memory an earlier stage
        # made that a value still to be read holds (a view, detach()); not a one use.
        first, others = aliased.get(node, (value, frozenset({value})))  # not run: the worst
        if first.op == "get_attr":
            continue  # a buffer is the module's own, the same tensor in every stage
        if stage_of[value] < stage_of[node] and set(value.users) != {node}:
            pass
        elif not (others and stage_of.get(first, 0) < stage_of[node]):
            continue
        value = first if stage_of.get(first, 0) < stage_of[value] else value
        problems.append(
            f"the value {value.name!r} made in stage {stage_of[value]}{where_made(value)} is "
            f"changed in place by {_name(node)} in stage {stage_of[node]}{where_made(node)}"
        )
    for node, target, how in changes:
        stages = {k for name, ks in readers.items() if _reads(name, target) for k in ks}
        if elsewhere := sorted(stages - {stage_of[node]}):
            shared.append(
                f"{target!r} is changed {how} in stage {stage_of[node]}{where_made(node)} "
                f"and read in stage(s) {elsewhere}"
            )
    if shared:
        raise SplitError(
            f"cannot split {type(module).__name__}: {'; '.join(shared)}. In a pipeline each "
            f"partition that reads a buffer (or parameter) holds its own copy, so the "
            f"change would not reach the others (nor the state dict, which holds the first "
            f"one's); move the split points so that it is read and changed in one stage, "
            f"or make it a submodule's, called in one stage"
        )
    if problems:
        raise SplitError(
            f"cannot split {type(module).__name__}: {'; '.join(problems)}. A stage gets its "
            f"own handle on a value from an earlier stage, so the change would not reach "
            f"the others and the gradients would be wrong; use an out-of-place operation "
            f"(h = h * 2 for h.mul_(2)), or move the split points so that the value is "
            f"made and changed in one stage"
        )


def _taken(name: str) -> bool:
    """Whether a stage, or fx's graph module, has an attribute ``name`` of its own."""
    own = {"key_order", "left_out", "index", "count", "input_kind", "input_names", "meta"}
    own |= {"_graph", "_code", "_tracer_cls", "_tracer_extras", "_lineno_map"}
    return name in own or hasattr(Stage, name) or hasattr(fx.GraphModule, name)


def _name(node: fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _reads(name: str, target: str) -> bool:
    """Whether a read of ``name`` (a tensor, or a module: ``"bn."``) reads ``target``."""
    return name == target or (name.endswith(".") and target.startswith(name))
