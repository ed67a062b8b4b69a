"""State dicts that torchgpipe 0.0.7 saved, under the names this library gives their tensors.

torchgpipe 0.0.7 registered each layer under ``partitions.<j>.<name>``, kept a skippable
module inside a wrapper as its ``module``, and gave a deferred batch norm two buffers of
its own, ``sum`` and ``sum_squares`` (its sums between micro-batches). Here the layers
are the model's children under their own names, a skippable module is of its own
class, and what a deferred layer merges between micro-batches is no state. So a
checkpoint of 0.0.7 holds the same tensors under other keys::

    partitions.0.0.module.conv.weight  ->  0.conv.weight     (a skippable layer 0)
    partitions.0.1.running_mean        ->  1.running_mean
    partitions.0.1.sum                 ->  (dropped: a deferred batch norm's sums)

:func:`watch_loads` renames them wherever a ``GPipe`` is loaded: on its own, or inside
a model that holds it (whose keys have the GPipe's path before them).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.skip.skippable import Skippable
from torchgpipe.versions import put_versions_back, set_version, start_versions

__all__ = ["renamed_keys", "watch_loads"]

_PARTITIONS = "partitions."
_SUMS = ("sum", "sum_squares")  # 0.0.7's DeferredBatchNorm buffers


def watch_loads(module: nn.Module) -> None:
    """Read 0.0.7's keys wherever ``module`` is loaded (``load_state_dict`` hooks).

    The versions the state dict's ``_metadata`` records go under the new paths too
    while the load runs (torch reads them there), and out again once it ended: the
    caller's state dict is left as it came.
    """
    module._register_load_state_dict_pre_hook(_rename, with_module=True)
    module.register_load_state_dict_post_hook(put_versions_back)


def renamed_keys(keys: list[str], model: nn.Module) -> dict[str, str | None]:
    """For a state dict of 0.0.7 (``keys``), each key's name in ``model`` (None: dropped).

    Empty where ``keys`` are not 0.0.7's: its layers' keys start with ``partitions.``
    there (a module attached to its GPipe beside them kept its own, as here), and none
    of ``model``'s does (a layer of that name is refused). A key that names no tensor of
    ``model`` keeps its name without ``partitions.<j>.``, so that a strict load names it
    among the unexpected keys; one without ``partitions.`` is left as it is.
    """
    if not any(key.startswith(_PARTITIONS) for key in keys):
        return {}  # before the model's keys are made: every load of a GPipe comes here
    own = model.state_dict(keep_vars=True)
    if any(key.startswith(_PARTITIONS) for key in own):
        return {}
    wrapped = _skippables(model)
    tensors = {_as_saved(key, wrapped): key for key in own}
    batch_norms = {_as_saved(f"{name}.", wrapped) for name, m in _norms(model)}
    renamed: dict[str, str | None] = {}
    for key in filter(lambda key: key.startswith(_PARTITIONS), keys):
        path = _within(key)
        holder, _, name = path.rpartition(".")
        if path not in tensors and name in _SUMS and f"{holder}." in batch_norms:
            renamed[key] = None
        else:
            renamed[key] = tensors.get(path, path)
    return renamed


def _rename(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    keys = [key[len(prefix) :] for key in state_dict if key.startswith(prefix)]
    renamed = renamed_keys(keys, module)
    for old, new in renamed.items():
        value = state_dict.pop(prefix + old)
        if new is not None:
            state_dict[prefix + new] = value
    metadata: dict[str, Any] | None = getattr(state_dict, "_metadata", None)
    start_versions(module, metadata)
    if not renamed or metadata is None:
        return
    wrapped, paths = _skippables(module), {}
    for path, _ in module.named_modules():
        saved = _as_saved(f"{path}.", wrapped)[:-1]  # a skippable one's: its module's
        paths[saved] = path
        if path in wrapped:  # the wrapper's own
            paths[saved.removesuffix(".module")] = path
    given = dict(metadata)  # the caller's own versions are kept
    for path, data in given.items():
        inside = path[len(prefix) :] if path.startswith(prefix + _PARTITIONS) else ""
        if inside.count(".") >= 2:  # a module of a layer (not partitions, partitions.<j>)
            new = prefix + paths.get(_within(inside), _within(inside))
            if new not in given:
                set_version(module, new, data)


def _within(key: str) -> str:
    """``key`` without its ``partitions.<j>.``: the layer's name first."""
    return key.split(".", 2)[2]


def _skippables(model: nn.Module) -> set[str]:
    """The paths of the skippable modules in ``model``, which 0.0.7 wrapped."""
    return {path for path, m in model.named_modules() if isinstance(m, Skippable)}


def _norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _as_saved(key: str, wrapped: set[str]) -> str:
    """``key`` (a tensor's, or a module's path and a dot) as 0.0.7 named it in a layer.

    A skippable module's ``module.`` after its path: ``0.conv.weight``, where ``0`` is
    skippable, was ``0.module.conv.weight``.
    """
    parts = key.split(".")
    saved: list[str] = []
    for k, part in enumerate(parts[:-1]):
        saved.append(part)
        if ".".join(parts[: k + 1]) in wrapped:
            saved.append("module")
    return ".".join([*saved, parts[-1]])
