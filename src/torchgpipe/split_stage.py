"""The stages of a split model (``split.py``), and the model's keys on what holds them.

A :class:`Stage` is a skippable module (:mod:`torchgpipe.skip`) that runs one piece of
a module's captured forward on the module's own submodules, held at their original
paths; :func:`held_apart` gives every module and tensor that no piece uses a stage that
holds it, so the stages hold all of the module. :func:`keep_plain_keys` makes a
container of stages (the ``nn.Sequential`` that ``split`` returns, a ``GPipe``, a
``PipelineStage``) use the module's own state dict keys, in its order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Literal

from torch import Tensor, fx, nn
from torch.nn.parameter import is_lazy

from torchgpipe.resets import join, own_tensors
from torchgpipe.skip.skippable import Namespace, Skippable, pop, stash
from torchgpipe.versions import put_versions_back, set_version, start_versions

__all__ = [
    "InputKind",
    "Placeholder",
    "SplitError",
    "Stage",
    "held_apart",
    "keep_plain_keys",
]

InputKind = Literal["one", "args", "kwargs"]


class SplitError(ValueError):
    """A module cannot be split as asked; the message says where, why, and what to do."""


class Stage(Skippable):
    """One stage of a split module: a piece of its forward, run on its own submodules.

    Holds the original submodules (and parameters, buffers) the piece uses, and those
    :func:`held_apart` gives it (``apart``: their paths), under their paths in the
    original module, so its ``state_dict`` keys are the original's. The
    first stage takes the model's input as ``split`` was given it (a tensor, a tuple of
    positional arguments, or a dict of keyword arguments); the last returns the
    model's output, with its structure; the stages between take and return tuples.
    Skips (``stash_names``, ``pop_names``) carry the tensors that skip stages.
    """

    def __init__(
        self,
        source: nn.Module,
        graph: fx.Graph,
        *,
        index: int,
        count: int,
        input_kind: InputKind,
        input_names: tuple[str, ...],
        pops: tuple[str, ...],
        stashes: tuple[str, ...],
        namespace: Namespace,
        apart: Sequence[str] = (),
        order: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        _install(self, source, graph, apart)
        order = order if order is not None else {}
        # Where each key of this stage is in the source's state dict: keep_plain_keys
        # puts the stages' keys in the source's order.
        self.key_order = {
            key: order[key] for key in self.state_dict(keep_vars=True) if key in order
        }
        # The source's keys that no stage holds (held_apart left them out): split sets them.
        self.left_out: tuple[str, ...] = ()
        self.index, self.count = index, count
        self.input_kind, self.input_names = input_kind, input_names
        self.stash_names, self.pop_names = stashes, pops  # this stage's own, not its class's
        self.isolate(namespace)
        self.graph = graph

    def forward(self, value: Any) -> Generator[Any, Any, Any]:
        """Pop the skips, run the piece, stash the skips, and hand the output on."""
        popped = []
        for name in self.pop_names:
            popped.append((yield pop(name)))
        result = self._function()(self, *self._arguments(value), *popped)
        if self.index == self.count - 1:
            return result
        passed, stashed = result
        for name, tensor in zip(self.stash_names, stashed, strict=True):
            yield stash(name, tensor)
        return passed

    def _arguments(self, value: Any) -> tuple[Any, ...]:
        if self.index > 0:
            return tuple(value)
        if self.input_kind == "one":
            return (value,)
        names = self.input_names
        if self.input_kind == "args":
            if not isinstance(value, tuple | list) or len(value) != len(names):
                raise TypeError(
                    f"the split model takes a tuple of {len(names)} positional arguments "
                    f"({', '.join(names)}), as split() was given, got {_kind_of(value)}"
                )
            return tuple(value)
        if not isinstance(value, Mapping):
            raise TypeError(
                f"the split model takes a dict of its arguments {list(names)}, as split() "
                f"was given, got {_kind_of(value)}"
            )
        missing = [name for name in names if name not in value]
        if missing:
            raise TypeError(f"the split model's input lacks {missing}; it takes {list(names)}")
        extra = [name for name in value if name not in names]
        if extra:
            raise TypeError(
                f"the split model's input has {extra}, but it was split with an example of "
                f"the arguments {list(names)} (the others keep their defaults, fixed in the "
                f"stages); split again with an example that passes {extra} too, or leave "
                f"them out"
            )
        return tuple(value[name] for name in names)

    def _function(self) -> Callable[..., Any]:
        function = self.__dict__.get("_compiled")
        if function is None:
            code = self.graph.python_code(root_module="self")
            scope = dict(code.globals)
            exec(compile(code.src, f"<torchgpipe stage {self.index}>", "exec"), scope)
            function = self.__dict__["_compiled"] = scope["forward"]
        return function  # type: ignore[no-any-return]  # exec'd code

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_compiled", None)  # compiled again where it is loaded
        return state

    def extra_repr(self) -> str:
        """Which stage this is, in ``repr()``."""
        return f"stage {self.index} of {self.count}"


def _install(stage: nn.Module, source: nn.Module, graph: fx.Graph, apart: Sequence[str]) -> None:
    """Give ``stage`` what ``graph`` calls and reads, and ``apart``, at their original paths.

    In the order of the source's own modules, and in each module of its parameters and
    buffers, so that the state dict's keys are too.
    """
    named = dict(source.named_modules(remove_duplicate=False))
    place = {name: k for k, name in enumerate(named)}

    def order(path: str) -> tuple[int, int]:
        if path in named:  # a module
            return place[path], -1
        owner, _, name = path.rpartition(".")
        while owner not in place:  # an attribute of an attribute (fx's constants)
            owner = owner.rpartition(".")[0]
        names = [*named[owner]._parameters, *named[owner]._buffers]
        return place[owner], names.index(name) if name in names else len(names)

    used = {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}
    paths = sorted(used | set(apart), key=order)
    modules = {path for path in paths if path in named}
    for path in paths:
        *parents, name = path.split(".")
        if any(".".join(parents[:k]) in modules for k in range(1, len(parents) + 1)):
            continue  # reached through a module the stage holds already
        holder = _holder(stage, named, parents)
        if path in modules:
            holder.add_module(name, named[path])
            continue
        owner = source.get_submodule(".".join(parents))
        value = getattr(owner, name)
        if name in owner._parameters:
            holder.register_parameter(name, value)
        elif name in owner._buffers:
            holder.register_buffer(
                name, value, persistent=name not in owner._non_persistent_buffers_set
            )
        else:
            setattr(holder, name, value)


class Placeholder(nn.Module):
    """Where a stage holds parts of one of the source's modules, but not the module.

    Some of its tensors the stage reads directly (``self.proj.weight`` of a module that
    another stage calls), or the submodules of a container that ``split`` traced
    through. ``kind`` names the module's type, for messages. It has no forward: the
    stage's piece reads what it holds.
    """

    def __init__(self, kind: str, version: int | None = None, converts: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.converts = converts  # the module converts what it loads: _refuse_unconverted
        # The module's own version, which its state dict records (``_metadata``): a
        # load that converts older versions reads it.
        self._version = version  # type: ignore[assignment]  # torch's, typed int there

    def extra_repr(self) -> str:
        """The type of the source's module it stands for, in ``repr()``."""
        return f"parts of a {self.kind}"


def _holder(stage: nn.Module, named: Mapping[str, nn.Module], parents: list[str]) -> nn.Module:
    """The module at ``parents`` inside ``stage``, a :class:`Placeholder` where missing."""
    holder = stage
    for k, name in enumerate(parents):
        child = holder._modules.get(name)
        if child is None:
            source = named[".".join(parents[: k + 1])]
            converts = own_method(source, "_load_from_state_dict")
            child = Placeholder(type(source).__name__, source._version, converts)
            holder.add_module(name, child)
        holder = child
    return holder


def own_method(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class has a method ``name`` of its own: not nn.Module's, nor torch's."""
    owner = next(c for c in type(module).__mro__ if name in vars(c))
    return owner is not nn.Module and not owner.__module__.startswith("torch.")


def held_apart(source: nn.Module, graphs: Sequence[fx.Graph]) -> list[tuple[str, ...]]:
    """Per stage, the paths of what it holds of ``source`` that its piece does not use.

    ``graphs`` are the stages' pieces. So that the stages hold every module and tensor of
    the source (the split model's state dict has every key of the source's; a meta
    model's modules keep their own resets), each that no piece calls, nor reads under
    that name, goes to one stage:

    - a submodule that no stage calls, nor anything inside it, whole (its type, its
      reset, every key under it): to the stage that holds one of its modules already
      (one module under two names); else the first stage that reads one of its tensors
      directly (``F.linear(h, self.proj.weight, self.proj.bias)``), where it is then its
      tensors' first holder, which its own reset fills; else the first that holds one of
      its tensors (``head.weight = emb.weight`` with ``head`` unused: no copy of the
      embedding for another partition); else the last stage;
    - a tensor that a module split traces through holds itself (the model's own, a
      container's) and that no piece reads under that name (a tie's other name, or an
      unused tensor): to the first stage that reads it directly, else the first that
      holds it, else the last stage.

    The last stage for what no stage uses: under 1F1B schedules it keeps the fewest
    micro-batches in flight, so it has the most room for weights that do no work. Such
    weights get no gradient, as in the source.

    What cannot be placed with the stage's others is left out of the stages, and its
    keys are then missing from the split model's state dict: a module or tensor that
    holds an uninitialized (lazy) tensor, which nothing could fill, or whose tensors
    are on the meta device where the stage's are not, or the other way round (an
    unused head moved to meta to save memory): a layer must be all meta or all values.
    """
    named = dict(source.named_modules(remove_duplicate=False))
    calls = [{str(n.target) for n in g.nodes if n.op == "call_module"} for g in graphs]
    reads = [{str(n.target) for n in g.nodes if n.op == "get_attr"} for g in graphs]
    holders: dict[int, set[int]] = {}  # the id of a module or a tensor: stages holding it
    readers: dict[int, set[int]] = {}  # the id of a tensor: stages that read it directly
    covered: set[str] = set()  # the paths inside the modules the stages hold
    metas: list[set[bool]] = [set() for _ in graphs]  # per stage: is_meta of what it uses

    def hold(path: str, stage: int) -> None:
        for sub, module in named[path].named_modules(prefix=path, remove_duplicate=False):
            covered.add(sub)
            for held in (module, *(tensor for _, tensor in own_tensors(module))):
                holders.setdefault(id(held), set()).add(stage)

    def home(tensors: list[Tensor]) -> int:
        for table in (readers, holders):
            stages = {s for tensor in tensors for s in table.get(id(tensor), ())}
            if stages:
                return min(stages)
        return len(graphs) - 1

    def fits(tensors: list[Tensor], s: int) -> bool:  # see the docstring's last paragraph
        if any(is_lazy(tensor) for tensor in tensors):
            return False
        kinds = metas[s] or set().union(*metas)  # a stage that uses no tensor: the others'
        return len(kinds) != 1 or {tensor.is_meta for tensor in tensors} <= kinds

    for s, (called, read) in enumerate(zip(calls, reads, strict=True)):
        for path in called:
            hold(path, s)
            metas[s].update(t.is_meta for m in named[path].modules() for _, t in own_tensors(m))
        for path in read:
            owner, _, name = path.rpartition(".")
            tensor = dict(own_tensors(named[owner])).get(name) if owner in named else None
            if tensor is not None:
                readers.setdefault(id(tensor), set()).add(s)
                holders.setdefault(id(tensor), set()).add(s)
                metas[s].add(tensor.is_meta)
    through = {prefix for path in covered for prefix in _prefixes(path)}  # traced through
    apart: list[list[str]] = [[] for _ in graphs]
    every_read = set().union(*reads)
    for path, module in named.items():
        if path in covered:
            continue
        if path and path not in through:  # nothing inside it is called
            inside = list(module.modules())
            owners = {s for m in inside for s in holders.get(id(m), ())}
            if len(owners) <= 1:
                tensors = [t for m in inside for _, t in own_tensors(m)]
                s = min(owners) if owners else home(tensors)
                if fits(tensors, s):
                    apart[s].append(path)
                    hold(path, s)
                else:  # left out, with all inside it
                    covered.update(sub for sub, _ in module.named_modules(prefix=path))
                continue
        for name, tensor in own_tensors(module):  # traced through, or held in pieces
            slot = join(path, name)
            if slot in every_read or name in module._non_persistent_buffers_set:
                continue
            s = home([tensor])
            if not fits([tensor], s):
                continue  # left out
            apart[s].append(slot)
            holders.setdefault(id(tensor), set()).add(s)
    return [tuple(paths) for paths in apart]


def _prefixes(path: str) -> list[str]:
    """The paths of the modules above ``path``: ``'a.b.c'`` gives ``'', 'a', 'a.b'``."""
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(len(parts))]


def _kind_of(value: Any) -> str:
    return type(value).__name__


# The model's state_dict keys, on whatever holds the stages.


def keep_plain_keys(container: nn.Module) -> None:
    """Make ``container``'s state dict use the model's keys for the stages among its children.

    ``state_dict()`` drops each stage's index from its keys (``"3.head.weight"`` becomes
    ``"head.weight"``) and puts them in the model's order (:attr:`Stage.key_order`);
    ``load_state_dict`` takes the model's keys, gives each stage the entries it holds
    (a tied weight to each stage that uses it) and names missing or unexpected keys the
    model's way.
    """
    container._register_state_dict_hook(_drop_stage_index)
    container._register_load_state_dict_pre_hook(_add_stage_index, with_module=True)
    container.register_load_state_dict_post_hook(_plain_report)


def _stage_names(module: nn.Module) -> set[str]:
    return {name for name, child in module.named_children() if isinstance(child, Stage)}


def _plain(key: str, prefix: str, stages: set[str]) -> str:
    """``key`` without the index of the stage it is under (if under ``prefix`` + one)."""
    if not key.startswith(prefix):
        return key
    head, _, rest = key[len(prefix) :].partition(".")
    return prefix + rest if head in stages and rest else key


def _plain_report(module: nn.Module, incompatible: Any) -> None:
    """Name the missing and unexpected keys of a load by the model's keys too."""
    put_versions_back(module)
    stages = _stage_names(module)
    prefix = module.__dict__.get("_load_prefix", "")  # where the load found this module
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = list(dict.fromkeys(_plain(key, prefix, stages) for key in keys))


def _drop_stage_index(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    put_versions_back(module)  # of a load that raised
    stages = {name: c for name, c in module.named_children() if isinstance(c, Stage)}
    mine = [(key, value) for key, value in state_dict.items() if key.startswith(prefix)]
    for key, _ in mine:
        del state_dict[key]
    # The stages' entries in the model's order, in the places they took among the others.
    places: dict[int, float] = {}  # an entry's index in ``mine``: its place in the model's
    for k, (key, _) in enumerate(mine):
        head, _, rest = key[len(prefix) :].partition(".")
        if head in stages:
            places[k] = stages[head].key_order.get(rest, math.inf)  # unknown: last
    entries = list(mine)
    for slot, k in zip(places, sorted(places, key=lambda k: (places[k], k)), strict=True):
        entries[slot] = mine[k]
    for key, value in entries:  # again, with each stage's index taken out
        state_dict.setdefault(_plain(key, prefix, set(stages)), value)
    metadata: dict[str, Any] | None = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # the modules' versions, by path: the stages' too, in one pass
        inside = {p: d for p, d in metadata.items() if p.startswith(prefix)}
        for path in inside:
            del metadata[path]
        for path, data in inside.items():
            head, _, rest = path[len(prefix) :].partition(".")
            if head not in stages:
                metadata.setdefault(path, data)
            elif rest:  # under its path in the model (a stage itself has none)
                metadata.setdefault(prefix + rest, data)


def _add_stage_index(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    module.__dict__["_load_prefix"] = prefix  # for _plain_report, which is not told
    # The modules' versions under the stages' paths, which the load reads (only where the
    # load began here or above: torch hands a child's load no versions), taken out again
    # by _plain_report: the caller's state dict is left as it came.
    metadata: dict[str, Any] | None = getattr(state_dict, "_metadata", None)
    for stage in (c for c in module.children() if isinstance(c, Stage)):
        _refuse_unconverted(stage, state_dict, prefix)
    start_versions(module, metadata)
    given = dict(metadata or {})  # read from as given: a stage's path may be a model's too
    for name, child in module.named_children():
        if metadata is None or not isinstance(child, Stage):
            continue
        for path, _ in child.named_modules(remove_duplicate=False):
            if path:  # None: not the model's module that the stage's path names otherwise
                set_version(module, f"{prefix}{name}.{path}", given.get(prefix + path))
    owners: dict[str, list[str]] = {}
    for name, child in module.named_children():
        if isinstance(child, Stage):
            for key in child.state_dict(keep_vars=True):
                owners.setdefault(key, []).append(name)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        plain = key[len(prefix) :]
        if plain in owners:
            value = state_dict.pop(key)
            for name in owners[plain]:
                state_dict[f"{prefix}{name}.{plain}"] = value


def _refuse_unconverted(stage: Stage, state_dict: Mapping[str, Any], prefix: str) -> None:
    """Refuse a load that a module cut in parts would convert (``refuse_lost_state``).

    Where the state dict records that module at another version than its own and holds
    keys of it; one without versions (safetensors' files) is taken as of its own.
    """
    metadata: Mapping[str, Any] = getattr(state_dict, "_metadata", None) or {}
    for path, part in stage.named_modules():
        where = prefix + path
        version = (metadata.get(where) or {}).get("version", part._version)
        if not (isinstance(part, Placeholder) and part.converts and version != part._version):
            continue
        if any(key.startswith(where + ".") for key in state_dict):
            raise RuntimeError(
                f"torchgpipe: the state dict holds {where!r} at version {version}, which "
                f"its {part.kind} converts (to {part._version}) in a _load_from_state_dict "
                f"of its own; split cut that module in parts, which load without it. Load "
                f"the state dict into the plain model, then split it (or save it again "
                f"from there)"
            )
