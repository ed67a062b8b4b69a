"""The stages of a split model (``split.py``), and the model's keys on what holds them.

:func:`inputs_of` reads how the split model takes its input from ``split``'s example.
A :class:`Stage` is a skippable module (:mod:`torchgpipe.skip`) that runs one piece of
a module's captured forward on the module's own submodules, held at their original
paths. :func:`keep_plain_keys` makes a container of stages (the ``nn.Sequential`` that
``split`` returns, a ``GPipe``, a ``PipelineStage``) use the module's own state dict
keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Mapping
from typing import Any, Literal

from torch import fx, nn

from torchgpipe.skip.skippable import Namespace, Skippable, pop, stash

__all__ = ["InputKind", "SplitError", "Stage", "inputs_of", "keep_plain_keys"]

InputKind = Literal["one", "args", "kwargs"]


class SplitError(ValueError):
    """A module cannot be split as asked; the message says where, why, and what to do."""


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
    values = {"kwargs": example, "args": dict(zip(given, example, strict=False))}.get(kind, {})
    nones = [name for name in given if values.get(name, ...) is None]
    if nones:
        raise SplitError(
            f"example_input gives {type(module).__name__}.forward's {nones} as None; split "
            f"traces each argument it is given as a tensor, so code for None cannot be "
            f"captured: leave them out (pass a dict of the other arguments: they keep their "
            f"defaults), or give tensors"
        )
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


class Stage(Skippable):
    """One stage of a split module: a piece of its forward, run on its own submodules.

    Holds the original submodules (and parameters, buffers) the piece uses, under their
    paths in the original module, so its ``state_dict`` keys are the original's. The
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
    ) -> None:
        super().__init__()
        _install(self, source, graph)
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


def _install(stage: nn.Module, source: nn.Module, graph: fx.Graph) -> None:
    """Give ``stage`` the submodules and tensors ``graph`` uses, at their original paths."""
    # In the order of the source's own modules, so that the state dict's keys are too.
    place = {name: k for k, (name, _) in enumerate(source.named_modules(remove_duplicate=False))}

    def position(path: str) -> int:
        while path not in place:
            path = path.rpartition(".")[0]
        return place[path]

    modules = sorted({str(n.target) for n in graph.nodes if n.op == "call_module"}, key=position)

    def order(path: str) -> tuple[int, int]:  # and in its owner's order: parameters, buffers
        owner, _, name = path.rpartition(".")
        m = source.get_submodule(owner)
        names = [*m._parameters, *m._buffers]
        return position(path), names.index(name) if name in names else len(names)

    attributes = sorted({str(n.target) for n in graph.nodes if n.op == "get_attr"}, key=order)
    for path in modules:
        *parents, name = path.split(".")
        _holder(stage, source, parents).add_module(name, source.get_submodule(path))
    for path in attributes:
        *parents, name = path.split(".")
        if any(".".join(parents[:k]) in modules for k in range(1, len(parents) + 1)):
            continue  # reached through a module the stage holds already
        owner = source.get_submodule(".".join(parents))
        holder = _holder(stage, source, parents)
        value = getattr(owner, name)
        if name in owner._parameters:
            holder.register_parameter(name, value)
        elif name in owner._buffers:
            holder.register_buffer(
                name, value, persistent=name not in owner._non_persistent_buffers_set
            )
        else:
            setattr(holder, name, value)


def _holder(stage: nn.Module, source: nn.Module, parents: list[str]) -> nn.Module:
    """The module at ``parents`` inside ``stage``, made (as a plain module) where missing."""
    holder = stage
    for name in parents:
        child = holder._modules.get(name)
        if child is None:
            child = nn.Module()
            holder.add_module(name, child)
        holder = child
    return holder


def _kind_of(value: Any) -> str:
    return type(value).__name__


# The model's state_dict keys, on whatever holds the stages.


def keep_plain_keys(container: nn.Module) -> None:
    """Make ``container``'s state dict use the model's keys for the stages among its children.

    ``state_dict()`` drops each stage's index from its keys (``"3.head.weight"`` becomes
    ``"head.weight"``); ``load_state_dict`` takes the model's keys, gives each stage
    the entries it holds (a tied weight to each stage that uses it) and names missing
    or unexpected keys the model's way. The keys come stage by stage: in the model's
    order where its forward uses its modules in the order it defines them.
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
    stages = _stage_names(module)
    prefix = module.__dict__.get("_load_prefix", "")  # where the load found this module
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = list(dict.fromkeys(_plain(key, prefix, stages) for key in keys))


def _drop_stage_index(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    stages = _stage_names(module)
    mine = [(key, value) for key, value in state_dict.items() if key.startswith(prefix)]
    for key, _ in mine:
        del state_dict[key]
    for key, value in mine:  # again, in order, with each stage's index taken out
        state_dict.setdefault(_plain(key, prefix, stages), value)


def _add_stage_index(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    module.__dict__["_load_prefix"] = prefix  # for _plain_report, which is not told
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
