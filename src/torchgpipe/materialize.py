"""Layers built on the meta device, made real only where they run.

A model too large for one process is built without memory, then each process (or, in
``GPipe``, each partition's device) allocates and fills only its own layers::

    with torch.device("meta"):
        model = build()                                   # shapes and dtypes, no memory
    stage = PipelineStage(model, balance)                 # its layers' reset_parameters()
    stage = PipelineStage(model, balance, init=my_init)   # or a function of each layer
    stage = PipelineStage(model, balance, state_dict=sd)  # or the plain model's keys

What fills a tensor, checked for every layer before any is changed where it can be
(:mod:`torchgpipe.materialize_checks`; a tensor that nothing is known to fill is
refused, by name: ``torch.empty`` would leave it garbage). Lazy layers are refused:
their shapes are unknown.

- ``init`` fills every tensor of a layer it is given: a parameter, a buffer (a batch
  norm's running statistics too), whatever ``init`` is written for. Whether it did is
  known once it ran, as for resets below: a tensor it left marked is refused.
- ``state_dict`` fills each tensor saved under a key it holds, and must hold every key
  of the layers, extra state included (a buffer registered with ``persistent=False``
  is never saved, so never filled this way; a batch norm's ``num_batches_tracked``
  may be missing, as ``load_state_dict`` allows), and no key the model lacks. One name
  of a tied parameter (or buffer) is enough: the meta path reads the state dict as
  ``load_state_dict`` would (:func:`tied_state_dict`), and loads it by each layer's
  ``load_state_dict`` (its hooks, extra state, and the versions ``_metadata`` records
  for its modules included). Layers built with values among meta ones are loaded too.
  Its keys are checked as given: a key a load hook of the model renames is not known.
- Otherwise, a module's own reset: ``reset_parameters()`` (or ``_reset_parameters()``,
  as ``nn.MultiheadAttention`` names it), children before parents, the order in which
  their constructors ran. A tensor held by a module that has one may be filled by it;
  whether it was is known once the resets ran: every such tensor is first marked (NaN,
  or a sentinel for integers) and one the resets left marked is refused then (see
  :func:`torchgpipe.resets.reset`). So a parameter a subclass adds to ``nn.Linear``, a
  buffer added to a torch layer, or a pruned weight (``weight_orig``) is refused, not
  left as garbage. An empty tensor needs nothing.
- A parameter or buffer that an earlier layer of the model holds too needs nothing of
  its own: every holder ends with its first holder's values (:func:`_retie` inside a
  partition, :mod:`torchgpipe.tied` across them). Only the first holder must be
  filled. Holders inside one layer (a module and its parent) share one tensor from the
  start, which any of their resets may fill. A module two layers of a partition hold
  is allocated and filled with the first; the later layer's resets and ``init`` leave
  it as the first left it. Across processes only parameters travel: a buffer whose
  first holder is another process's layer is filled here by ``init`` or
  ``state_dict``, or refused (a reset here is not its first holder's, whose values it
  must end with).

What a layer's resets (or ``init``) draw comes from generators of the layer's own
(:func:`torchgpipe.rng.own_generators`), seeded from one draw of the default CPU
generator, made once per model in every process alike, and from the layer's place in the
model: a layer gets the same values whatever the balance and whichever process fills it,
and every process's default generator moves on by that one draw, however many layers it
fills (a loop that shuffles its data in each process under one seed stays in step). The
values differ from a model built on the CPU under the same seed; load a state dict where
they must be equal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from torchgpipe.materialize_checks import (
    Fill,
    Init,
    check_materializable,
    check_meta_arguments,
    key_prefix,
    loads_into,
    meta_layers,
    on_meta,
)
from torchgpipe.resets import Holder, initialize, own_tensors, reset
from torchgpipe.rng import own_generators
from torchgpipe.split_stage import Stage

__all__ = [
    "Fill",
    "Init",
    "check_materializable",
    "check_meta_arguments",
    "every_name_fits",
    "key_prefix",
    "loaded_value",
    "materialize",
    "named_tensors",
    "on_meta",
    "partition",
    "state_names",
    "tied_state_dict",
]


def partition(
    layers: list[tuple[str, nn.Module]], device: torch.device, fill: Fill
) -> nn.Sequential:
    """The partition of ``layers`` (``(name, layer)`` pairs) on ``device``.

    An ``nn.Sequential`` of the layers under their names in the plain model, as
    torchgpipe 0.0.7's partitions were (``partitions[1].fc``; keys ``fc.weight``), its
    meta layers allocated and filled first (:func:`materialize`).
    """
    materialize(layers, device, fill)
    return nn.Sequential(OrderedDict(layers)).to(device)


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
    the same partition, layers that share one weight or one module, a module
    registered twice) stays one tensor, with the values its first holder's layer gave
    it; what a later holder's layer filled is dropped. A layer's tensors that are real
    already (a module an earlier layer holds too, allocated and filled with it) are not
    allocated again, and what its resets or ``init`` write to them is undone. Ties
    across partitions are :mod:`torchgpipe.tied`'s.

    Raises:
        ValueError: a layer mixes meta and real tensors, or a module's reset (or
            ``init``) left a tensor it was trusted with as allocated (the layer is
            allocated by then).
    """
    made: dict[int, Tensor] = {}  # a meta tensor's id: the one tensor that replaces it
    meta = {id(layer) for _, layer in meta_layers(layers)}
    versions = _by_layer(getattr(fill.state_dict, "_metadata", None))
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        if id(layer) not in meta:
            if fill.state_dict is not None:
                _load(layer, prefix, fill.state_dict, versions)
            continue
        held = _holders(layer)  # before it is allocated
        _allocate(layer, device)
        with torch.no_grad(), own_generators(fill.seeds[name]):
            if fill.init is not None:
                _retie(held, {})  # holders inside the layer share one tensor
                initialize(layer, held, fill.watched, prefix, fill.init)
            else:
                state_dict = fill.state_dict
                reset(layer, held, fill.watched, prefix, loading=state_dict is not None)
                if state_dict is not None:  # the resets tied inside the layer; then load
                    _load(layer, prefix, state_dict, versions)  # its values win
        _retie(held, made)


def _allocate(layer: nn.Module, device: torch.device) -> None:
    """Give each meta tensor of ``layer`` uninitialized memory on ``device``.

    ``to_empty`` would, but it empties the real tensors too: those of a module that an
    earlier layer of the partition holds as well, allocated and filled with that layer.
    ``_apply`` still, so that a module's own ``_apply`` runs (an RNN's flat weights).
    """
    layer._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


def _load(
    layer: nn.Module,
    prefix: str,
    state_dict: Mapping[str, Tensor],
    versions: dict[str, list[tuple[str, Any]]] | None,
) -> None:
    """Load the keys of ``layer`` that ``state_dict`` holds, as ``load_state_dict`` does.

    With the versions the state dict's ``_metadata`` records for the layer's modules
    (``versions``, :func:`_by_layer`), under their paths in the layer: a module's
    ``_load_from_state_dict`` that converts an older version's values would otherwise
    take a current checkpoint for an old one.
    """
    keys = layer.state_dict(keep_vars=True)
    mine = OrderedDict(
        (key, state_dict[prefix + key]) for key in keys if prefix + key in state_dict
    )
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and versions is not None:
        # A stage of a split model holds the model's own paths (no prefix).
        inside = metadata.items() if not prefix else versions.get(prefix[:-1], [])
        _keep_metadata(mine, dict(inside))
    layer.load_state_dict(mine, strict=False)  # what is missing was checked, or reset


def _by_layer(metadata: Mapping[str, Any] | None) -> dict[str, list[tuple[str, Any]]] | None:
    """The entries of ``metadata`` (by module path) per top layer, by path inside it.

    Grouped once per model, not looked for per layer: that took the layers times the
    modules (2000 layers of two modules each loaded in 21.7 s, now in 2.5 s).
    """
    if metadata is None:
        return None
    groups: dict[str, list[tuple[str, Any]]] = {}
    for path, data in metadata.items():
        layer, _, inside = path.partition(".")
        groups.setdefault(layer, []).append((inside, data))
    return groups


def _keep_metadata(state_dict: OrderedDict[str, Tensor], metadata: dict[str, Any]) -> None:
    """Hand ``state_dict`` the ``_metadata`` that ``load_state_dict`` reads versions from."""
    state_dict._metadata = metadata  # type: ignore[attr-defined]  # torch's own attribute, untyped


def _holders(layer: nn.Module) -> list[Holder]:
    """Every ``(id, module, name)`` that holds a meta tensor of ``layer``, in order.

    One id held twice or more is a tie inside the partition (two layers' weights, two
    names in one module, a module registered twice), which allocation cuts: it gives
    each holder a tensor of its own (:func:`_retie` ties them again).
    """
    holders, seen = [], set()
    for _, module in layer.named_modules(remove_duplicate=False):  # modules() has it from 2.11
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


def every_name_fits(state_dict: Mapping[str, Any], keys: Sequence[str], like: Tensor) -> bool:
    """Whether each of ``keys`` that ``state_dict`` holds is a tensor of ``like``'s shape.

    The plain model's load refuses a name that is not (a size mismatch, even with
    ``strict=False``): where one is not, the names are left as given, and the load
    refuses it alike, naming that key, rather than take another name's value.
    """
    return all(
        isinstance(state_dict[key], Tensor) and loads_into(state_dict[key], like)
        for key in keys
        if key in state_dict
    )


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
    tensors: dict[int, Tensor] = {}
    for _, layer in module.named_children():
        for _, tensor in named_tensors(layer):
            holders[id(tensor)] = holders.get(id(tensor), 0) + 1
            tensors[id(tensor)] = tensor
    loaded = OrderedDict(state_dict)
    saved = set(module.state_dict(keep_vars=True))  # no persistent=False buffer's name
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # each module's version, for its _load_from_state_dict
        _keep_metadata(loaded, metadata)
    for key, keys in state_names(module).items():
        value = loaded_value(state_dict, keys)
        if (
            value is not None
            and holders[key] > 1
            and every_name_fits(state_dict, keys, tensors[key])
        ):
            loaded.update(dict.fromkeys([k for k in keys if k in saved], value))
    return loaded


def named_tensors(layer: nn.Module) -> list[tuple[str, Tensor]]:
    """Every name of every parameter and buffer of ``layer``, as its state dict names them."""
    every = [
        layer.named_parameters(remove_duplicate=False),
        layer.named_buffers(remove_duplicate=False),
    ]
    return [pair for named in every for pair in named]
