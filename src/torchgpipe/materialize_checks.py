"""What fills a meta model's tensors, checked before any of them is allocated.

:mod:`torchgpipe.materialize` says what fills what (its module docstring) and fills it;
this module refuses up front, each kind of problem all at once, what it could not fill
or would fill wrongly: ``init`` and ``state_dict`` of the wrong type, a state dict with
keys the model lacks or without keys it has, lazy layers (their shapes are unknown), and
tensors nothing is known to fill. What only running the fill can tell (whether a reset,
or ``init``, wrote every element) it finds the tensors of (:attr:`Fill.watched`), which
:mod:`torchgpipe.resets` marks before and checks after.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from torchgpipe.resets import legacy_hooks, own_tensors, reset_of, tensor_holders, under
from torchgpipe.rng import cell_seed, draw_seed
from torchgpipe.split_stage import Placeholder, Stage

__all__ = [
    "Fill",
    "Init",
    "check_materializable",
    "check_meta_arguments",
    "key_prefix",
    "loads_into",
    "meta_layers",
    "on_meta",
]

Init = Callable[[nn.Module], None]
"""Fills one layer's tensors, already allocated on its device (``init(layer)``)."""

_EXTRA_STATE = "_extra_state"
"""The last part of the key ``state_dict()`` saves a module's ``get_extra_state()`` under."""


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def key_prefix(name: str, layer: nn.Module) -> str:
    """What a layer's keys start with in the plain model's state dict.

    A layer's name, except for a stage of a split model (:mod:`torchgpipe.split`), whose
    keys are the model's own.
    """
    return "" if isinstance(layer, Stage) else f"{name}."


def check_meta_arguments(
    module: nn.Sequential, init: Init | None, state_dict: Mapping[str, Tensor] | None
) -> None:
    """Refuse ``init`` or ``state_dict`` of the wrong type, or for a model with no meta layer.

    Called first, by ``GPipe`` and ``PipelineStage`` alike: nothing has read them yet
    (a path or a bound method would fail deep inside, with torch's words).

    Raises:
        TypeError: ``init`` is not a function of one layer; ``state_dict`` is not a
            mapping, has a key that is not a ``str``, or something other than a tensor
            where ``module`` holds a parameter or buffer (``None``, say).
        ValueError: either is given, and no layer of ``module`` is on the meta device.
    """
    if init is not None:
        _check_init(init)
    if state_dict is not None:
        _check_state_dict_types(module, state_dict)
    if (init is not None or state_dict is not None) and not on_meta(module):
        raise ValueError(
            "init= and state_dict= fill layers built on the meta device (with "
            "torch.device('meta'): model = ...), and this model has none; load a state "
            "dict into a model with values by its load_state_dict"
        )


def _received(value: object) -> str:
    """A value as errors show it: its type, and its name or the start of its ``repr``."""
    name = getattr(value, "__qualname__", None)
    shown = name if callable(value) and isinstance(name, str) else repr(value)
    shown = " ".join(shown.split())  # a module's repr spans lines
    return f"{type(value).__name__} {shown[:60]}{'...' if len(shown) > 60 else ''}"


def _check_init(init: object) -> None:
    """Refuse an ``init`` that cannot be called with one layer."""
    if not callable(init):
        raise TypeError(
            f"init must be a function that fills the tensors of the layer it is given, "
            f"init(layer), but got {_received(init)}; pass one (e.g. def init(layer): "
            f"...), or state_dict= to load the plain model's values"
        )
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): its call will tell
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            f"init is called with each layer, init(layer), but {_received(init)} takes "
            f"{signature}; give it one parameter, the layer"
        ) from None


def _check_state_dict_types(module: nn.Sequential, state_dict: object) -> None:
    """Refuse a state dict that is not a mapping of ``str`` to tensors (where tensors go)."""
    if not isinstance(state_dict, Mapping):
        if isinstance(state_dict, (str, bytes, os.PathLike)):
            fix = "load the file first: state_dict=torch.load(path)"
        elif callable(state_dict):
            fix = "call it: state_dict=model.state_dict()"
        else:
            fix = "pass the plain model's state_dict(), or torch.load() of one"
        raise TypeError(
            f"state_dict must be a mapping of str to Tensor, as a model's state_dict() "
            f"returns, but got {_received(state_dict)}; {fix}"
        )
    keys = [_received(key) for key in state_dict if not isinstance(key, str)]
    tensors = {
        key
        for key, value in _model_keys(list(module.named_children())).items()
        if isinstance(value, Tensor) and key.rpartition(".")[2] != _EXTRA_STATE
    }
    values = [
        f"{key} ({_received(value)})"
        for key, value in state_dict.items()
        if key in tensors and not isinstance(value, Tensor)
    ]
    problems = []
    if keys:
        problems.append(
            f"the state dict's keys must be str ('<layer>.<name>'), not {', '.join(keys[:10])}"
        )
    if values:
        problems.append(
            f"the state dict must hold a Tensor at the key of each parameter and buffer, "
            f"but holds {', '.join(values[:10])}{' ...' if len(values) > 10 else ''}; give "
            f"the plain model's state_dict() (a checkpoint saved from it, with its values)"
        )
    if problems:
        raise TypeError("\n".join(problems))


def _model_keys(whole: list[tuple[str, nn.Module]]) -> dict[str, object]:
    """Every key of the model's state dict, with the model's value (a tensor, extra state).

    A split model's stage answers to the model's keys and to its own in the
    ``nn.Sequential`` (what ``keep_plain_keys`` makes of them).
    """
    return {
        prefix + key: value
        for name, layer in whole
        for prefix in dict.fromkeys([key_prefix(name, layer), f"{name}."])
        for key, value in layer.state_dict(keep_vars=True).items()
    }


@dataclass
class Fill:
    """What fills the layers of a model built on the meta device: the checks' findings.

    Made by :func:`check_materializable`, used by ``materialize.materialize`` for each part.
    """

    init: Init | None = None
    state_dict: Mapping[str, Tensor] | None = None
    seeds: dict[str, int] = field(default_factory=dict)
    """Per layer name, the seed of the generators its resets (or ``init``) draw from."""

    def loaded(self, layers: list[tuple[str, nn.Module]]) -> list[nn.Module]:
        """The layers among ``layers`` with values that the state dict loads into."""
        if self.state_dict is None:
            return []
        return [layer for _, layer in layers if not on_meta(layer)]

    watched: dict[int, tuple[int, Tensor]] = field(default_factory=dict)
    """The meta tensors a reset (or ``init``) is to fill, by ``id``, with the ``id`` of
    the layer whose fill must fill it (its first holder's): checked once it ran."""


def check_materializable(
    layers: list[tuple[str, nn.Module]],
    *,
    init: Init | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    model: nn.Sequential | None = None,
) -> Fill:
    """What fills the meta layers among ``layers``, once checked that they can be filled.

    ``model`` is the whole ``nn.Sequential`` that ``layers`` are part of (by default
    ``layers`` are all of it): a parameter tied to one of its earlier layers (a buffer,
    to one among ``layers``) needs no fill here, and the state dict's keys are checked
    against all of it. What fills what is :mod:`torchgpipe.materialize`'s docstring's;
    ``state_dict`` is read as given (its types checked by :func:`check_meta_arguments`),
    so pass it through ``tied_state_dict`` first.

    Raises:
        ValueError: ``init`` and ``state_dict`` both given; a layer mixes meta and real
            tensors; a lazy layer on the meta device (or, with ``state_dict``, one
            among ``layers``); ``state_dict`` holds a meta tensor, a key the model
            lacks, lacks a key of ``layers`` (extra state included), or has a shape
            that does not fit; or, without ``init``, a tensor that nothing fills
            (every one named, with the reason), among them those of a module under a
            hook that keeps its values in tensors its reset does not fill
            (``torch.nn.utils.prune``, and the legacy ``spectral_norm`` and
            ``weight_norm``: ``weight_orig``, ``weight_u``, ...).
    """
    if init is not None and state_dict is not None:
        raise ValueError("pass init or state_dict, not both: either fills the layers")
    todo = meta_layers(layers)
    _check_lazy(layers if state_dict is not None else todo)
    whole = layers if model is None else list(model.named_children())
    fill = Fill(init=init, state_dict=state_dict)
    if meta_layers(whole):
        # One draw, in every process alike, whichever layers it fills (materialize.py).
        seed = draw_seed()
        fill.seeds = {name: cell_seed(seed, k, 0) for k, (name, _) in enumerate(whole)}
    if state_dict is not None:
        _check_keys(state_dict, whole)
    first = _first_holders(whole)
    if init is None:
        fill.watched = _check_fillable(todo, layers, state_dict, first)
    else:
        fill.watched = _init_fills(todo, {id(layer) for _, layer in layers}, first)
    return fill


def _check_lazy(layers: list[tuple[str, nn.Module]]) -> None:
    """Refuse lazy layers among those to allocate or load: their shapes are not known."""
    lazy = [
        f"{name} ({type(layer).__name__})"
        for name, layer in layers
        if any(is_lazy(t) for t in chain(layer.parameters(), layer.buffers()))
    ]
    if lazy:
        which = f"layers {', '.join(lazy)} hold" if len(lazy) > 1 else f"layer {lazy[0]} holds"
        raise ValueError(
            f"{which} uninitialized (lazy) parameters or buffers, whose shapes are known "
            f"only once they run, so they can be neither allocated "
            f"nor checked against a state dict; build them with their shapes (nn.Linear("
            f"in_features, out_features) for nn.LazyLinear), or run the model once on an "
            f"example input on its device before (model(example.to('meta')) sets the "
            f"shapes of a meta model, without memory)"
        )


def _check_keys(state_dict: Mapping[str, Tensor], whole: list[tuple[str, nn.Module]]) -> None:
    """Refuse a state dict with keys the model lacks, or with meta tensors."""
    known = set(_model_keys(whole))
    # What split left out of the stages: the plain model's state dict has it; skipped.
    known |= {key for _, layer in whole if isinstance(layer, Stage) for key in layer.left_out}
    unknown = sorted(key for key in state_dict if key not in known)
    empty = sorted(k for k, v in state_dict.items() if isinstance(v, Tensor) and v.is_meta)
    problems = []
    if unknown:
        problems.append(
            f"the state dict has keys the model does not: {', '.join(unknown[:10])}"
            f"{' ...' if len(unknown) > 10 else ''}; give the plain model's state dict "
            f"(its keys are the nn.Sequential's: '<layer>.<name>')"
        )
    if empty:
        problems.append(
            f"the state dict's {', '.join(empty[:10])} are on the meta device, with no "
            f"values to load; save the state dict of a model with values"
        )
    if problems:
        raise ValueError("\n".join(problems))


def meta_layers(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The layers with a tensor on the meta device; refuses one that mixes them."""
    todo = []
    for name, layer in layers:
        meta = [t.is_meta for t in chain(layer.parameters(), layer.buffers())]
        if not any(meta):
            continue
        if not all(meta):
            raise ValueError(
                f"layer {name} holds tensors on the meta device and others with values; "
                f"build every tensor of a layer on the meta device, or none"
            )
        todo.append((name, layer))
    return todo


def _first_holders(layers: list[tuple[str, nn.Module]]) -> dict[int, int]:
    """Each parameter's and buffer's first holder in the model: the ``id`` of its layer.

    In the order of the state dict, of ``materialize``'s holders and of ``Ties.untie``:
    layers in order, each module before its children.
    """
    first: dict[int, int] = {}
    for _, layer in layers:
        for _, module in layer.named_modules(remove_duplicate=False):  # modules() has it from 2.11
            for _, tensor in own_tensors(module):
                first.setdefault(id(tensor), id(layer))
    return first


def _later(tensor: Tensor, layer: nn.Module, here: set[int], first: dict[int, int]) -> bool:
    """Whether ``tensor`` of ``layer`` takes its first holder's values: it needs no fill.

    A parameter tied to an earlier layer anywhere in the model (its values travel), a
    buffer tied to an earlier layer among those given (``here``: buffers do not travel).
    """
    owner = first.get(id(tensor))
    return owner not in (None, id(layer)) and (isinstance(tensor, nn.Parameter) or owner in here)


def _init_fills(
    meta: list[tuple[str, nn.Module]], here: set[int], first: dict[int, int]
) -> dict[int, tuple[int, Tensor]]:
    """What ``init`` must fill (:attr:`Fill.watched`): every tensor of the meta layers.

    But those a tie fills (:func:`_later`) and empty ones.
    """
    watched: dict[int, tuple[int, Tensor]] = {}
    for _, layer in meta:
        for _, module in layer.named_modules(remove_duplicate=False):  # modules() has it from 2.11
            for _, tensor in own_tensors(module):
                if tensor.numel() and not _later(tensor, layer, here, first):
                    watched.setdefault(id(tensor), (id(layer), tensor))
    return watched


def _check_fillable(
    meta: list[tuple[str, nn.Module]],
    layers: list[tuple[str, nn.Module]],
    state_dict: Mapping[str, Tensor] | None,
    first: dict[int, int],
) -> dict[int, tuple[int, Tensor]]:
    """Refuse, all at once, every tensor that nothing fills (no ``init``).

    ``meta``: the layers to allocate; ``layers``: all those given, whose keys a state
    dict must hold. Returns the tensors a reset is to fill (:attr:`Fill.watched`).
    """
    missing: list[str] = []
    shapes: list[str] = []
    legacy: dict[str, list[str]] = {}
    unfilled: list[str] = []
    elsewhere: list[str] = []
    unsaved: list[str] = []  # as elsewhere, registered with persistent=False
    watched: dict[int, tuple[int, Tensor]] = {}
    allocated = {id(layer) for _, layer in meta}
    here = {id(layer) for _, layer in layers}
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        saved = {} if state_dict is None else layer.state_dict(prefix=prefix, keep_vars=True)
        # Modules with a reset, by path: a parent's may fill its children (each reset
        # above a tensor allocated runs, and what it should fill is checked: resets.py).
        resets = {
            path for path, m in layer.named_modules(prefix=prefix.removesuffix(".")) if reset_of(m)
        }
        holding = tensor_holders(layer, prefix.removesuffix("."))
        if state_dict is not None:
            missing.extend(_no_extra_state(saved, holding, state_dict))
        for tensor, holders in holding.items():
            key = holders[0][0]
            keys = [k for k, _, _ in holders if k in saved]
            if state_dict is not None:  # every name, a tie's later ones too: loaded alike
                shapes += [
                    m for k in keys if k in state_dict for m in _misfit(k, state_dict[k], tensor)
                ]
            if _later(tensor, layer, here, first):
                continue  # a later holder of a tie: it takes the first's values
            if keys and state_dict is not None:
                present = [k for k in keys if k in state_dict]
                if present or not _counts_batches(holders):
                    missing.extend([] if present else keys[:1])
                    continue  # else a batch count the reset zeroes, as load_state_dict allows
            if id(layer) not in allocated or tensor.numel() == 0:
                continue  # keeps its values; or nothing to fill
            if first.get(id(tensor)) not in (None, id(layer)):  # a buffer, first held elsewhere
                names = layer.state_dict(prefix=prefix, keep_vars=True)
                persistent = any(k in names for k, _, _ in holders)
                (elsewhere if persistent else unsaved).append(key)
                continue
            hooks = [(p, m, hook) for _, m, p in holders for hook in legacy_hooks(m)]
            for path, module, hook in hooks:
                legacy.setdefault(f"{path} ({type(module).__name__}", []).append(hook)
            if hooks:
                continue
            if any(under(path, resets) for _, _, path in holders):
                watched[id(tensor)] = (id(layer), tensor)
            else:
                unfilled.append(_unfilled(key, holders[0][1]))
    problems = []
    if missing:
        problems.append(
            f"the state dict has no {', '.join(sorted(missing))}; give the plain model's "
            f"state dict (its keys are the nn.Sequential's: '<layer>.<name>'; one name of "
            f"a tied weight is enough)"
        )
    problems.extend(shapes)
    if legacy:
        where = ", ".join(f"{m} under {' and '.join(sorted(set(h)))})" for m, h in legacy.items())
        problems.append(
            f"{where} cannot be made on its device: the hook keeps its values in tensors "
            f"that reset_parameters() does not fill; pass init= (a function of each "
            f"layer) or state_dict= (the plain model's) to fill them "
            f"(torch.nn.utils.parametrizations' norms, which replace the deprecated "
            f"norm hooks, need one of them too)"
        )
    if unfilled:
        problems.append(
            f"nothing is known to fill {', '.join(unfilled)}, so each would keep whatever "
            f"memory it was given; pass init= (a function of each layer, which must then "
            f"fill every tensor of it), state_dict= holding them (the plain model's; a "
            f"buffer registered with persistent=False is never in one), or build those "
            f"layers outside torch.device('meta') (a layer with values is kept as it is)"
        )
    if elsewhere:
        problems.append(  # a key once: two of a split model's stages here may hold it
            f"{', '.join(dict.fromkeys(elsewhere))}: each a buffer whose first holder is a "
            f"layer of another process, whose values it must end with, and buffers do not "
            f"travel between processes; pass state_dict= (the plain model's) or init= to "
            f"fill it here"
        )
    if unsaved:
        problems.append(
            f"{', '.join(dict.fromkeys(unsaved))}: each a buffer whose first holder is a "
            f"layer of another process and which no state dict holds (registered with "
            f"persistent=False); buffers do not travel between processes: give each layer "
            f"a buffer of its own, or pass init= to fill every tensor of this process's "
            f"layers"
        )
    if problems:
        raise ValueError("\n".join(problems))
    return watched


def _no_extra_state(
    saved: Mapping[str, object],
    holding: Mapping[Tensor, list[tuple[str, nn.Module, str]]],
    state_dict: Mapping[str, Tensor],
) -> list[str]:
    """The keys of a layer's extra state (``get_extra_state()``) that the state dict lacks.

    Refused as ``load_state_dict`` refuses them: the module would keep the extra state
    it was built with, not the one saved.
    """
    tensors = {key for holders in holding.values() for key, _, _ in holders}
    return [
        key
        for key in saved
        if key.rpartition(".")[2] == _EXTRA_STATE and key not in tensors and key not in state_dict
    ]


def _unfilled(key: str, module: nn.Module) -> str:
    """Why nothing fills the tensor ``key`` that ``module`` holds, for the refusal."""
    if isinstance(module, Placeholder):  # a split model's stage: see split_stage.py
        return (
            f"{key} (a {module.kind}'s, which a stage of the split model reads directly "
            f"while it holds neither the {module.kind} nor so its reset_parameters(); "
            f"split points that put a call of it in that stage would give it both)"
        )
    if isinstance(module, Stage):  # the split model's own tensor (not a submodule's)
        return (
            f"{key} (the split model's own, not a submodule's: its model's "
            f"reset_parameters(), if any, is not a stage's to run)"
        )
    return f"{key} ({type(module).__name__}: it has no reset_parameters())"


def _counts_batches(holders: list[tuple[str, nn.Module, str]]) -> bool:
    """Whether a tensor is a batch norm's ``num_batches_tracked``, which may be unsaved."""
    return any(
        isinstance(module, _NormBase) and key.rpartition(".")[2] == "num_batches_tracked"
        for key, module, _ in holders
    )


def _misfit(key: str, value: Any, tensor: Tensor) -> list[str]:
    """Why ``value``, under ``key`` in a state dict, cannot fill ``tensor`` (none if it can)."""
    if isinstance(value, Tensor) and not loads_into(value, tensor):  # others: a TypeError
        shape, model = tuple(value.shape), tuple(tensor.shape)
        return [f"{key} has shape {shape} in the state dict but {model} in the model"]
    return []


def loads_into(value: Tensor, tensor: Tensor) -> bool:
    """Whether a load takes ``value`` into ``tensor``: the same shape, as torch's load wants.

    Or a 0-dim tensor saved as one element (shape ``(1,)``), which torch's load takes too.
    """
    return value.shape == tensor.shape or (tensor.dim() == 0 and tuple(value.shape) == (1,))
