"""Layers built on the meta device, made real only where they run.

A model too large for one process is built without memory, then each process (or, in
``GPipe``, each partition's device) allocates and fills only its own layers::

    with torch.device("meta"):
        model = build()                                   # shapes and dtypes, no memory
    stage = PipelineStage(model, balance)                 # its layers' reset_parameters()
    stage = PipelineStage(model, balance, init=my_init)   # or a function of each layer
    stage = PipelineStage(model, balance, state_dict=sd)  # or the plain model's keys

What fills a tensor, checked for every layer before any is changed where it can be (a
tensor that nothing is known to fill is refused, by name: ``torch.empty`` would leave
it garbage):

- ``init`` fills every tensor of a layer; that is the caller's promise.
- ``state_dict`` fills each tensor saved under a key it holds, and must hold every key
  of the layers (a buffer registered with ``persistent=False`` is never saved, so
  never filled this way; a batch norm's ``num_batches_tracked`` may be missing, as
  ``load_state_dict`` allows), and no key the model lacks. One name of a tied
  parameter (or buffer) is enough: the meta path reads the state dict as ``load_state_dict`` would
  (:func:`tied_state_dict`), and loads it by each layer's
  ``load_state_dict`` (its hooks and extra state included). Layers built with values
  among meta ones are loaded from it too.
- Otherwise, a module's own reset: ``reset_parameters()`` (or ``_reset_parameters()``,
  as ``nn.MultiheadAttention`` names it), children before parents, the order in which
  their constructors ran. A tensor held by a module that has one may be filled by it;
  whether it was is known once the resets ran: every such tensor is first marked (NaN,
  or a sentinel for integers) and one that no reset replaced, wrote in place (its
  version counter) nor through ``.data`` is refused then (see :func:`torchgpipe.resets.reset`). So a
  parameter a subclass adds to ``nn.Linear``, a buffer added to a torch layer, or a
  pruned weight (``weight_orig``) is refused, not left as garbage. An empty tensor
  needs nothing.
- A parameter or buffer that an earlier layer of the model holds too needs nothing of
  its own: every holder ends with its first holder's values (:func:`_retie` inside a
  partition, :mod:`torchgpipe.tied` across them). Only the first holder must be
  filled. Holders inside one layer (a module and its parent) share one tensor from the
  start, which any of their resets may fill. Across processes only parameters travel:
  a buffer whose first holder is another process's layer is filled here by ``init`` or
  ``state_dict``, or refused (a reset here is not its first holder's, whose values it
  must end with).

The values drawn differ from a model built on the CPU under the same seed (each process
draws only its own layers); load a state dict where they must be equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from torchgpipe.resets import (
    Holder,
    legacy_hooks,
    own_tensors,
    reset,
    reset_of,
    tensor_holders,
    under,
)
from torchgpipe.split_stage import Placeholder, Stage

__all__ = [
    "Fill",
    "Init",
    "check_materializable",
    "check_meta_arguments",
    "loaded_value",
    "materialize",
    "named_tensors",
    "on_meta",
    "state_names",
    "tied_state_dict",
]

Init = Callable[[nn.Module], None]
"""Fills one layer's tensors, already allocated on its device (``init(layer)``)."""


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def check_meta_arguments(
    module: nn.Sequential, init: Init | None, state_dict: Mapping[str, Tensor] | None
) -> None:
    """Refuse ``init`` or ``state_dict`` for a model with no layer on the meta device."""
    if (init is not None or state_dict is not None) and not on_meta(module):
        raise ValueError(
            "init= and state_dict= fill layers built on the meta device (with "
            "torch.device('meta'): model = ...), and this model has none; load a state "
            "dict into a model with values by its load_state_dict"
        )


@dataclass
class Fill:
    """What fills the layers of a model built on the meta device: the checks' findings.

    Made by :func:`check_materializable`, used by :func:`materialize` for each part.
    """

    init: Init | None = None
    state_dict: Mapping[str, Tensor] | None = None

    def loaded(self, layers: list[tuple[str, nn.Module]]) -> list[nn.Module]:
        """The layers among ``layers`` with values that the state dict loads into."""
        if self.state_dict is None:
            return []
        return [layer for _, layer in layers if not on_meta(layer)]

    watched: dict[int, tuple[int, Tensor]] = field(default_factory=dict)
    """The meta tensors a reset is to fill, by ``id``, with the ``id`` of the layer whose
    resets must fill it (its first holder's): checked once they ran."""


def materialize(layers: list[tuple[str, nn.Module]], device: torch.device, fill: Fill) -> None:
    """Allocate the meta layers among ``layers`` on ``device``, and fill them.

    ``layers`` are ``(name, layer)`` pairs, ``name`` the layer's in the plain
    ``nn.Sequential`` (its keys in the state dict start with ``name + "."``, but for a
    split model's stages, :func:`key_prefix`). Layers with no meta tensor keep their
    values, but for the keys ``fill.state_dict`` holds, which are loaded into them.

    ``fill`` comes from :func:`check_materializable`, called on every layer this
    process will fill and with the whole model: it refuses what cannot be filled
    before anything changes, and it alone sees ties to layers outside ``layers``. This
    fills what that check found: ``init``, each module's reset, then the state dict's
    keys. A tensor that none of them fills here is a later holder of a tied parameter,
    left as allocated until its first holder's values reach it.

    A tensor that several modules of ``layers`` hold (a head tied to an embedding of
    the same partition, layers that share one weight, a module registered twice) stays
    one tensor, with the values its first holder's layer gave it; what a later holder's
    layer filled is dropped. Ties across partitions are :mod:`torchgpipe.tied`'s.

    Raises:
        ValueError: a layer mixes meta and real tensors, or a module's reset left a
            tensor it was trusted with as allocated (the layer is allocated by then).
    """
    made: dict[int, Tensor] = {}  # a meta tensor's id: the one tensor that replaces it
    meta = {id(layer) for _, layer in _meta_layers(layers)}
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        if id(layer) not in meta:
            if fill.state_dict is not None:
                _load(layer, prefix, fill.state_dict)
            continue
        held = _holders(layer)  # before it is allocated
        layer.to_empty(device=device)
        with torch.no_grad():
            if fill.init is not None:
                _retie(held, {})  # holders inside the layer share one tensor
                fill.init(layer)
            else:
                reset(layer, held, fill.watched, prefix)  # and ties inside the layer
                if fill.state_dict is not None:
                    _load(layer, prefix, fill.state_dict)  # the state dict's values win
        _retie(held, made)


def _load(layer: nn.Module, prefix: str, state_dict: Mapping[str, Tensor]) -> None:
    """Load the keys of ``layer`` that ``state_dict`` holds, as ``load_state_dict`` does."""
    keys = layer.state_dict(keep_vars=True)
    mine = {key: state_dict[prefix + key] for key in keys if prefix + key in state_dict}
    layer.load_state_dict(mine, strict=False)  # what is missing was checked, or reset


def _holders(layer: nn.Module) -> list[Holder]:
    """Every ``(id, module, name)`` that holds a meta tensor of ``layer``, in order.

    One id held twice or more is a tie inside the partition (two layers' weights, two
    names in one module, a module registered twice), which ``to_empty`` would cut: it
    gives each holder a tensor of its own.
    """
    holders, seen = [], set()
    for module in layer.modules(remove_duplicate=False):
        for name, tensor in own_tensors(module):
            if tensor.is_meta and (id(module), name) not in seen:
                seen.add((id(module), name))
                holders.append((id(tensor), module, name))
    return holders


def _retie(holders: list[Holder], made: dict[int, Tensor]) -> None:
    """Give every holder of each meta tensor the one that replaced it first.

    With an empty ``made``, right after allocation: the holders inside one layer share
    its first holder's tensor, so whichever of their resets fills it fills it for all.
    With the partition's ``made``, once the layer is filled: the first layer's tensor,
    as its fill left it, is kept; a later layer's, filled by its own reset (or
    ``init``, or the state dict), is dropped. So each tied tensor is filled once, as
    its first holder fills it, and a module that two layers share is not filled anew
    by the second.
    """
    for key, module, name in holders:
        table = module._parameters if name in module._parameters else module._buffers
        kept = made.setdefault(key, table[name])  # type: ignore[arg-type]  # a holder holds a tensor
        if table[name] is not kept:
            table[name] = kept  # type: ignore[assignment]  # a parameter's holder keeps a parameter


def key_prefix(name: str, layer: nn.Module) -> str:
    """What a layer's keys start with in the plain model's state dict.

    A layer's name, except for a stage of a split model (:mod:`torchgpipe.split`), whose
    keys are the model's own.
    """
    return "" if isinstance(layer, Stage) else f"{name}."


# A state dict's names of a tensor that several layers hold, as load_state_dict reads them.


def state_names(module: nn.Sequential) -> dict[int, list[str]]:
    """Every name each parameter and buffer of ``module`` has in its state dict, in order.

    For a split model's stage, both its key in the ``nn.Sequential`` and the model's
    own (what ``keep_plain_keys`` makes of it).
    """
    names: dict[int, list[str]] = {}
    for index, layer in module.named_children():
        for name, tensor in named_tensors(layer):
            keys = names.setdefault(id(tensor), [])
            keys.append(f"{index}.{name}")
            if isinstance(layer, Stage):
                keys.append(name)
    return names


V = TypeVar("V")


def loaded_value(state_dict: Mapping[str, V], keys: Sequence[str]) -> V | None:
    """What a tied weight holds once ``state_dict`` is loaded, its names ``keys`` in order.

    The plain model loads each name into its one tensor, in the order of its state
    dict: the last name present wins. A name the state dict lacks ends with that value
    too, as checkpoints that keep one name of a tied weight expect. None: no name is
    there. The one rule for both paths: ``load_state_dict`` (``tied.Ties.watch_loads``)
    and a meta model's ``state_dict=`` (:func:`tied_state_dict`).
    """
    present = [key for key in keys if key in state_dict]
    return state_dict[present[-1]] if present else None


def tied_state_dict(
    module: nn.Sequential, state_dict: Mapping[str, Tensor] | None
) -> dict[str, Tensor] | None:
    """``state_dict`` with every name of each tie (parameter or buffer) of ``module`` as loaded.

    Each name holds the value :func:`loaded_value` gives, as if the plain model had
    loaded ``state_dict``: what a model built on the meta device fills its layers from
    (``state_dict=``), so that every holder of a tied weight, in any partition or
    process, starts with that value. Call it while ``module``'s ties are whole (before
    ``tied.Ties.untie``). The tensors are ``state_dict``'s own, not copies; None stays
    None.
    """
    if state_dict is None:
        return None
    holders: dict[int, int] = {}  # a stage's tensor has two names, yet one holder
    for _, layer in module.named_children():
        for _, tensor in named_tensors(layer):
            holders[id(tensor)] = holders.get(id(tensor), 0) + 1
    loaded = dict(state_dict)
    for key, keys in state_names(module).items():
        value = loaded_value(state_dict, keys)
        if value is not None and holders[key] > 1:
            loaded.update(dict.fromkeys(keys, value))
    return loaded


def named_tensors(layer: nn.Module) -> list[tuple[str, Tensor]]:
    """Every name of every parameter and buffer of ``layer``, as its state dict names them."""
    every = [
        layer.named_parameters(remove_duplicate=False),
        layer.named_buffers(remove_duplicate=False),
    ]
    return [pair for named in every for pair in named]


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
    against all of it. What fills what is the module docstring's; ``state_dict`` is
    read as given, so pass it through :func:`tied_state_dict` first.

    Raises:
        ValueError: ``init`` and ``state_dict`` both given; a layer mixes meta and real
            tensors; ``state_dict`` holds a meta tensor, a key the model lacks, lacks
            a key of ``layers``, or has a shape that does not fit; or, without
            ``init``, a tensor that nothing fills (every one named, with the reason),
            among them those of a module under a hook that keeps its values in tensors
            its reset does not fill (``torch.nn.utils.prune``, and the legacy
            ``spectral_norm`` and ``weight_norm``: ``weight_orig``, ``weight_u``, ...).
    """
    if init is not None and state_dict is not None:
        raise ValueError("pass init or state_dict, not both: either fills the layers")
    todo = _meta_layers(layers)
    whole = layers if model is None else list(model.named_children())
    fill = Fill(init=init, state_dict=state_dict)
    if state_dict is not None:
        _check_keys(state_dict, whole)
    if init is None:
        fill.watched = _check_fillable(todo, layers, state_dict, _first_holders(whole))
    return fill


def _check_keys(state_dict: Mapping[str, Tensor], whole: list[tuple[str, nn.Module]]) -> None:
    """Refuse a state dict with keys the model lacks, or with meta tensors."""
    known = {  # a split model's stage answers to the model's keys and to its own
        prefix + key
        for name, layer in whole
        for prefix in {key_prefix(name, layer), f"{name}."}
        for key in layer.state_dict(keep_vars=True)
    }
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


def _meta_layers(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
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

    In the order of the state dict, of :func:`_holders` and of ``Ties.untie``: layers in
    order, each module before its children.
    """
    first: dict[int, int] = {}
    for _, layer in layers:
        for module in layer.modules(remove_duplicate=False):
            for _, tensor in own_tensors(module):
                first.setdefault(id(tensor), id(layer))
    return first


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
    watched: dict[int, tuple[int, Tensor]] = {}
    allocated = {id(layer) for _, layer in meta}
    here = {id(layer) for _, layer in layers}
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        saved = {} if state_dict is None else layer.state_dict(prefix=prefix, keep_vars=True)
        # Modules with a reset, by path: a parent's may fill its children (every reset
        # runs, and what each should fill is checked once they ran: resets.py).
        resets = {
            path for path, m in layer.named_modules(prefix=prefix.removesuffix(".")) if reset_of(m)
        }
        for tensor, holders in tensor_holders(layer, prefix.removesuffix(".")).items():
            key = holders[0][0]
            owner = first.get(id(tensor))
            later = owner not in (None, id(layer))
            if later and (isinstance(tensor, nn.Parameter) or owner in here):
                continue  # a later holder of a tie: it takes the first's values
            keys = [k for k, _, _ in holders if k in saved]
            if keys and state_dict is not None:
                present = [k for k in keys if k in state_dict]
                if present and state_dict[present[-1]].shape != tensor.shape:
                    shapes.append(
                        f"{present[-1]} has shape {tuple(state_dict[present[-1]].shape)} in "
                        f"the state dict but {tuple(tensor.shape)} in the model"
                    )
                if present or not _counts_batches(holders):
                    missing.extend([] if present else keys[:1])
                    continue  # else a batch count the reset zeroes, as load_state_dict allows
            if id(layer) not in allocated or tensor.numel() == 0:
                continue  # keeps its values; or nothing to fill
            if later:  # a buffer whose first holder is in another process
                elsewhere.append(key)
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
    if problems:
        raise ValueError("\n".join(problems))
    return watched


def _unfilled(key: str, module: nn.Module) -> str:
    """Why nothing fills the tensor ``key`` that ``module`` holds, for the refusal."""
    if isinstance(module, Placeholder):  # a split model's stage: see split_stage.py
        return (
            f"{key} (a {module.kind}'s, which a stage of the split model reads directly "
            f"while it holds neither the {module.kind} nor so its reset_parameters(); "
            f"split points that put a call of it in that stage would give it both)"
        )
    return f"{key} ({type(module).__name__}: it has no reset_parameters())"


def _counts_batches(holders: list[tuple[str, nn.Module, str]]) -> bool:
    """Whether a tensor is a batch norm's ``num_batches_tracked``, which may be unsaved."""
    return any(
        isinstance(module, _NormBase) and key.rpartition(".")[2] == "num_batches_tracked"
        for key, module, _ in holders
    )
