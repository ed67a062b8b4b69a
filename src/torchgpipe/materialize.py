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
  of a meta layer (a buffer registered with ``persistent=False`` is never saved, so
  never filled this way). One name of a tied parameter is enough: the meta path reads
  the state dict as ``load_state_dict`` would (:func:`torchgpipe.tied.tied_state_dict`).
- Otherwise, a module's own reset: ``reset_parameters()`` (or ``_reset_parameters()``,
  as ``nn.MultiheadAttention`` names it), children before parents, the order in which
  their constructors ran. It is trusted to fill the module's parameters (its name says
  so), and the buffers of torch's own classes (and this library's): ``BatchNorm``
  resets its running statistics. The buffers of a class of yours (a subclass of a
  torch class included: a mask added to ``nn.Linear``) are checked once its reset ran:
  one it neither replaced nor wrote is refused then (see :func:`_reset`), so a reset
  may fill them, yours or torch's (a subclass of ``BatchNorm1d`` keeps working).
- A parameter that an earlier layer of the model (or an earlier module of the same
  layer) holds too needs nothing of its own: every holder ends with its first holder's
  values (:func:`_retie` inside a partition, :mod:`torchgpipe.tied` across them). Only
  the first holder must be filled.

The values drawn differ from a model built on the CPU under the same seed (each process
draws only its own layers); load a state dict where they must be equal.
"""

from __future__ import annotations

import math
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
    split model's stages, :func:`key_prefix`). Layers with no meta tensor are left as
    they are.

    Call :func:`check_materializable` first, on every layer this process will fill and
    with the whole model: it refuses what cannot be filled before anything changes,
    and it alone sees ties to layers outside ``layers``. This fills what that check
    found: each module's reset, ``init``, or the keys ``state_dict`` holds. A tensor
    that none of them fills here is a later holder of a tied parameter, left as
    allocated until its first holder's values reach it.

    A tensor that several modules of ``layers`` hold (a head tied to an embedding of
    the same partition, layers that share one weight, a module registered twice) stays
    one tensor, with the values its first holder's layer gave it; what a later holder's
    layer filled is dropped. Ties across partitions are :mod:`torchgpipe.tied`'s.

    Raises:
        ValueError: a layer mixes meta and real tensors.
    """
    todo = _meta_layers(layers)
    holders = [_holders(layer) for _, layer in todo]  # before any is allocated
    made: dict[int, Tensor] = {}  # a meta tensor's id: the one tensor that replaces it
    for (name, layer), held in zip(todo, holders, strict=True):
        layer.to_empty(device=device)
        with torch.no_grad():
            if init is not None:
                init(layer)
            else:
                loaded: dict[str, Tensor] = {}  # layer's key: its value in the state dict
                prefix = key_prefix(name, layer)
                if state_dict is not None:
                    loaded = {
                        key: state_dict[prefix + key]
                        for key in layer.state_dict(keep_vars=True)
                        if prefix + key in state_dict  # else a tie's later name
                    }
                _reset(layer, set(loaded), prefix)  # where it can; the state dict's values win
                targets = layer.state_dict(keep_vars=True)
                for key, value in loaded.items():
                    targets[key].copy_(value)
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
    model: nn.Sequential | None = None,
) -> list[tuple[str, nn.Module]]:
    """The meta layers among ``layers``, once checked that they can be filled.

    ``model`` is the whole ``nn.Sequential`` that ``layers`` are part of (by default
    ``layers`` are all of it): a parameter tied to one of its earlier layers needs no
    fill here. What fills what is the module docstring's; ``state_dict`` is read as
    given, so pass it through :func:`torchgpipe.tied.tied_state_dict` first.

    Raises:
        ValueError: ``init`` and ``state_dict`` both given; a layer mixes meta and real
            tensors; ``state_dict`` lacks a key of a meta layer, or has a shape that
            does not fit; or, without ``init``, a tensor that nothing fills (every one
            named, with the reason), among them those of a module under the legacy
            ``torch.nn.utils.spectral_norm`` or ``weight_norm`` hooks, which keep their
            values in tensors (``weight_orig``, ``weight_u``, ...) that
            ``reset_parameters()`` does not fill.
    """
    if init is not None and state_dict is not None:
        raise ValueError("pass init or state_dict, not both: either fills the layers")
    todo = _meta_layers(layers)
    if init is None:
        whole = layers if model is None else list(model.named_children())
        _check_fillable(todo, state_dict, _first_holders(whole))
    return todo


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


def _first_holders(layers: list[tuple[str, nn.Module]]) -> dict[int, tuple[int, str]]:
    """Each parameter's first holder in the model: its layer's ``id``, and its key there.

    In the order of the state dict, of :func:`_holders` and of ``Ties.untie``: layers in
    order, each module before its children.
    """
    first: dict[int, tuple[int, str]] = {}
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        for path, module in layer.named_modules(remove_duplicate=False):
            for n, parameter in module._parameters.items():
                if parameter is not None:
                    first.setdefault(id(parameter), (id(layer), prefix + _join(path, n)))
    return first


def _check_fillable(
    layers: list[tuple[str, nn.Module]],
    state_dict: Mapping[str, Tensor] | None,
    first: dict[int, tuple[int, str]],
) -> None:
    """Refuse, all at once, every tensor of ``layers`` that nothing fills (no ``init``)."""
    missing: list[str] = []
    shapes: list[str] = []
    legacy: list[str] = []
    unfilled: list[str] = []
    for name, layer in layers:
        prefix = key_prefix(name, layer)
        saved = {} if state_dict is None else layer.state_dict(prefix=prefix, keep_vars=True)
        for path, module in _children_first(layer, prefix.removesuffix(".")):
            hooks, outside = _legacy_norms(module), False
            for n, tensor in _own_tensors(module):
                key = _join(path, n)
                mine = (id(layer), key)
                if isinstance(tensor, nn.Parameter) and first.get(id(tensor), mine) != mine:
                    continue  # a later holder of a tied parameter: it takes the first's values
                if key in saved and state_dict is not None:
                    if key not in state_dict:
                        missing.append(key)
                    elif state_dict[key].shape != tensor.shape:
                        shapes.append(
                            f"{key} has shape {tuple(state_dict[key].shape)} in the state dict "
                            f"but {tuple(tensor.shape)} in the model"
                        )
                    continue
                outside = True
                why = _why_unfilled(module, n)
                if why and not hooks:
                    unfilled.append(f"{key} ({type(module).__name__}: {why})")
            if hooks and outside:
                legacy.extend(f"{path} ({type(module).__name__} under {hook})" for hook in hooks)
    problems = []
    if missing:
        problems.append(
            f"the state dict has no {', '.join(sorted(missing))}; give the plain model's "
            f"state dict (its keys are the nn.Sequential's: '<layer>.<name>'; one name of "
            f"a tied weight is enough)"
        )
    problems.extend(shapes)
    if legacy:
        problems.append(
            f"{', '.join(legacy)} cannot be made on its device: the legacy hook keeps "
            f"its values in tensors that reset_parameters() does not fill; pass init= "
            f"(a function of each layer) or state_dict= (the plain model's) to fill them "
            f"(torch.nn.utils.parametrizations' norms, which replace these deprecated "
            f"hooks, need one of them too)"
        )
    if unfilled:
        problems.append(
            f"nothing is known to fill {', '.join(unfilled)}, so each would keep whatever "
            f"memory it was given; pass init= (a function of each layer, which must then "
            f"fill every tensor of it), state_dict= holding them (the plain model's; a "
            f"buffer registered with persistent=False is never in one), or build those "
            f"layers outside torch.device('meta') (a layer with values is kept as it is)"
        )
    if problems:
        raise ValueError("\n".join(problems))


def _why_unfilled(module: nn.Module, name: str) -> str | None:
    """Why no reset of ``module`` is known to fill its tensor ``name``; None: one may.

    Whether a reset fills a user's class's buffers is known only once it ran: see
    :func:`_reset`.
    """
    if _reset_of(module) is None:
        return "it has no reset_parameters()"
    return None


def _torchs_own(module: nn.Module) -> bool:
    """Whether ``module``'s class is torch's own (or this library's), not a user's.

    Their resets are known to fill their buffers too (``BatchNorm``'s running
    statistics, ``DeferredBatchNorm``'s); a user's subclass may add buffers they do not.
    """
    return type(module).__module__.split(".")[0] in ("torch", "torchgpipe")


def _legacy_norms(module: nn.Module) -> list[str]:
    """The legacy hook-based norms on ``module`` (``torch.nn.utils.spectral_norm``, ...)."""
    kinds = {SpectralNorm: "spectral_norm", WeightNorm: "weight_norm"}
    return [
        f"torch.nn.utils.{name}"
        for hook in module._forward_pre_hooks.values()
        for kind, name in kinds.items()
        if isinstance(hook, kind)
    ]


def _reset(layer: nn.Module, loaded: set[str], prefix: str) -> None:
    """Reset every module of ``layer`` that holds tensors and can, children first.

    ``loaded``: the keys (in ``layer``'s state dict) a state dict fills afterwards;
    ``prefix``: what the layer's keys start with in the model's, for errors.

    The reset of a class of a user's (a subclass of torch's included) may leave a buffer
    it knows nothing of (a mask a subclass of ``nn.Linear`` adds): such a buffer is
    first filled with NaN (when floating), and found unfilled when the reset neither
    replaced it, nor wrote it in place (its version counter), nor through ``.data``
    (it is still all NaN).

    Raises:
        ValueError: a reset left a buffer of a user's class as it was allocated.
    """
    for path, module in _children_first(layer, ""):
        reset = _reset_of(module)
        if reset is None or not _own_tensors(module):
            continue
        watched = {}  # name: (buffer, its version once marked)
        if not _torchs_own(module):
            for n, b in module._buffers.items():
                if b is not None and _join(path, n) not in loaded:
                    if b.is_floating_point() or b.is_complex():
                        b.fill_(math.nan)
                    watched[n] = (b, b._version)
        reset()
        left = [n for n, (b, v) in watched.items() if _unfilled(module._buffers.get(n), b, v)]
        if left:
            names = ", ".join(prefix + _join(path, n) for n in left)
            raise ValueError(
                f"{type(module).__name__}.reset_parameters() left {names} as allocated "
                f"(uninitialized memory): fill it there, or pass init= or a state dict "
                f"holding it, or build that layer outside the meta device"
            )


def _unfilled(now: Tensor | None, marked: Tensor, version: int) -> bool:
    """Whether a buffer marked before a reset is still as marked after it."""
    if now is not marked or marked._version != version:
        return False
    floating = marked.is_floating_point() or marked.is_complex()
    return not floating or bool(marked.isnan().all())


def _reset_of(module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters`` (or ``_reset_parameters``, attention's name), if any."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def _children_first(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s submodules, each after its children: the order constructors ran.

    Each with its path under ``path``, as its keys in a state dict start.
    """
    for name, child in module.named_children():
        yield from _children_first(child, _join(path, name))
    yield path, module


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
