"""Layers built on the meta device, made real only where they run.

A model too large for one process is built without memory, then each process (or, in
``GPipe``, each partition's device) allocates and fills only its own layers::

    with torch.device("meta"):
        model = build()                                   # shapes and dtypes, no memory
    stage = PipelineStage(model, balance)                 # its layers' reset_parameters()
    stage = PipelineStage(model, balance, init=my_init)   # or a function of each layer
    stage = PipelineStage(model, balance, state_dict=sd)  # or the plain model's keys

Without ``init`` or ``state_dict``, every module that holds tensors of its own is reset
by its ``reset_parameters()`` (or ``_reset_parameters()``, as ``nn.MultiheadAttention``
names it), children before parents, the order in which their constructors ran. A module
that holds tensors and has neither is refused, by name: its values cannot be made up.
The values drawn differ from a model built on the CPU under the same seed (each process
draws only its own layers); load a state dict where they must be equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import chain

import torch
from torch import Tensor, nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from torchgpipe.split_stage import Stage

__all__ = ["Init", "check_materializable", "check_meta_arguments", "materialize", "on_meta"]

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


def materialize(
    layers: list[tuple[str, nn.Module]],
    device: torch.device,
    *,
    init: Init | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
) -> None:
    """Allocate the meta layers among ``layers`` on ``device``, and fill them.

    ``layers`` are ``(name, layer)`` pairs, ``name`` the layer's in the plain
    ``nn.Sequential`` (its keys in ``state_dict`` start with ``name + "."``, but for a
    split model's stages, :func:`key_prefix`). Layers
    with no meta tensor are left as they are. Every layer is checked before any is
    changed, so a refusal leaves the model as it was.

    A tensor that several modules of ``layers`` hold (a head tied to an embedding of
    the same partition, layers that share one weight, a module registered twice) stays
    one tensor, with the values its first holder's layer gave it (its reset, ``init``,
    or its first name in ``state_dict``); what a later holder's layer filled is dropped.
    Ties across partitions are :mod:`torchgpipe.tied`'s.

    A module under the legacy ``torch.nn.utils.spectral_norm`` or ``weight_norm``
    (forward pre-hooks) keeps its values in ``weight_orig``, ``weight_u``, ... that its
    ``reset_parameters()`` does not fill: it needs ``init`` or ``state_dict``, which
    are trusted to fill them (the hooks recompute ``weight`` at each forward).

    Raises:
        ValueError: a layer mixes meta and real tensors; ``state_dict`` lacks a key of
            a layer, or has a shape that does not fit; or, without ``init``, a module
            holds a tensor that nothing fills (no ``reset_parameters``, not in
            ``state_dict``), among them one under the legacy spectral or weight norm.
    """
    todo = check_materializable(layers, init=init, state_dict=state_dict)
    holders = [_holders(layer) for _, layer in todo]  # before any is allocated
    made: dict[int, Tensor] = {}  # a meta tensor's id: the one tensor that replaces it
    for (name, layer), held in zip(todo, holders, strict=True):
        layer.to_empty(device=device)
        with torch.no_grad():
            if init is not None:
                init(layer)
            else:
                _reset(layer)  # where a module can; the state dict's values then replace it
                if state_dict is not None:
                    prefix = key_prefix(name, layer)
                    for key, tensor in layer.state_dict(keep_vars=True).items():
                        tensor.copy_(state_dict[prefix + key])
        _retie(held, made)


_Holder = tuple[int, nn.Module, str]
"""The ``id`` of a meta tensor, and a module that holds it under a name of its own."""


def _holders(layer: nn.Module) -> list[_Holder]:
    """Every ``(id, module, name)`` that holds a meta tensor of ``layer``, in order.

    One id held twice or more is a tie inside the partition (two layers' weights, two
    names in one module, a module registered twice), which ``to_empty`` would cut: it
    gives each holder a tensor of its own.
    """
    holders, seen = [], set()
    for module in layer.modules(remove_duplicate=False):
        for name, tensor in _own_tensors(module):
            if tensor.is_meta and (id(module), name) not in seen:
                seen.add((id(module), name))
                holders.append((id(tensor), module, name))
    return holders


def _retie(holders: list[_Holder], made: dict[int, Tensor]) -> None:
    """Give every holder of each meta tensor the one that replaced it first.

    The first holder's tensor, as its layer's fill left it, is kept (in ``made``); a
    later holder's, allocated by ``to_empty`` and filled by its own reset (or ``init``,
    or the state dict), is dropped. So each tied tensor is filled once, as the first
    holder fills it, and a module that two layers share is not filled anew by the
    second.
    """
    for key, module, name in holders:
        table = module._parameters if name in module._parameters else module._buffers
        kept = made.setdefault(key, table[name])  # type: ignore[arg-type]  # a holder holds a tensor
        if table[name] is not kept:
            table[name] = kept  # type: ignore[assignment]  # a parameter's holder keeps a parameter


def _own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors ``module`` holds itself, parameters and buffers, by name."""
    tables = (module._parameters, module._buffers)
    return [(n, t) for table in tables for n, t in table.items() if t is not None]


def key_prefix(name: str, layer: nn.Module) -> str:
    """What a layer's keys start with in the plain model's state dict.

    A layer's name, except for a stage of a split model (:mod:`torchgpipe.split`), whose
    keys are the model's own.
    """
    return "" if isinstance(layer, Stage) else f"{name}."


def check_materializable(
    layers: list[tuple[str, nn.Module]],
    *,
    init: Init | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
) -> list[tuple[str, nn.Module]]:
    """The meta layers among ``layers``, once checked that they can be filled.

    Raises:
        ValueError: as :func:`materialize`, which calls this first.
    """
    if init is not None and state_dict is not None:
        raise ValueError("pass init or state_dict, not both: either fills the layers")
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
        if init is None:
            _check_fillable(name, layer, state_dict)
        todo.append((name, layer))
    return todo


def _check_fillable(name: str, layer: nn.Module, state_dict: Mapping[str, Tensor] | None) -> None:
    """Refuse a layer whose tensors the state dict or its modules' resets cannot fill."""
    prefix, filled = key_prefix(name, layer), set()
    if state_dict is not None:
        expected = layer.state_dict(keep_vars=True)
        missing = sorted(prefix + k for k in expected if prefix + k not in state_dict)
        if missing:
            raise ValueError(
                f"the state dict has no {', '.join(missing)}; give the plain model's "
                f"state dict (its keys are the nn.Sequential's: '<layer>.<name>')"
            )
        for key, tensor in expected.items():
            value = state_dict[prefix + key]
            if value.shape != tensor.shape:
                raise ValueError(
                    f"{prefix}{key} has shape {tuple(value.shape)} in the state dict but "
                    f"{tuple(tensor.shape)} in the model"
                )
        filled = {prefix + k for k in expected}
    modules = list(_children_first(layer, name))
    legacy = [
        f"{path} ({type(module).__name__} under {hook})"
        for path, module in modules
        for hook in _legacy_norms(module)
        if any(f"{path}.{n}" not in filled for n in _own(module))
    ]
    if legacy:
        raise ValueError(
            f"{', '.join(legacy)} cannot be made on its device: the legacy hook keeps "
            f"its values in tensors that reset_parameters() does not fill; pass init= "
            f"(a function of each layer) or state_dict= (the plain model's) to fill them "
            f"(torch.nn.utils.parametrizations' norms, which replace these deprecated "
            f"hooks, need one of them too)"
        )
    unfilled = [
        f"{path}.{n} ({type(module).__name__})"
        for path, module in modules
        if _reset_of(module) is None
        for n in _own(module)
        if f"{path}.{n}" not in filled
    ]
    if unfilled:
        where = "" if state_dict is None else ", nor the state dict"
        raise ValueError(
            f"{', '.join(unfilled)} cannot be made on its device: its module has no "
            f"reset_parameters() to fill it{where}; pass init= (a function of each "
            f"layer) or state_dict= (the plain model's)"
        )


def _legacy_norms(module: nn.Module) -> list[str]:
    """The legacy hook-based norms on ``module`` (``torch.nn.utils.spectral_norm``, ...)."""
    kinds = {SpectralNorm: "spectral_norm", WeightNorm: "weight_norm"}
    return [
        f"torch.nn.utils.{name}"
        for hook in module._forward_pre_hooks.values()
        for kind, name in kinds.items()
        if isinstance(hook, kind)
    ]


def _reset(layer: nn.Module) -> None:
    """Reset every module of ``layer`` that holds tensors and can, children first."""
    for _, module in _children_first(layer, ""):
        reset = _reset_of(module)
        if reset is not None and _own(module):
            reset()


def _own(module: nn.Module) -> list[str]:
    """The names of the tensors ``module`` holds itself (not its children's)."""
    return [name for name, _ in _own_tensors(module)]


def _reset_of(module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters`` (or ``_reset_parameters``, attention's name), if any."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def _children_first(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s submodules, each after its children: the order constructors ran."""
    for name, child in module.named_children():
        yield from _children_first(child, f"{path}.{name}")
    yield path, module
