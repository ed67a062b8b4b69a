"""State dicts that torchgpipe 0.0.7 saved, under the names this library gives their tensors.

torchgpipe 0.0.7 registered each layer under ``partitions.<j>.<name>``, kept a skippable
layer's module inside a wrapper as its ``module``, and gave a deferred batch norm two
buffers of its own, ``sum`` and ``sum_squares`` (its sums between micro-batches). Here
the layers are the model's children under their own names, a skippable layer is of its
own class, and what a deferred layer merges between micro-batches is no state. So a
checkpoint of 0.0.7 holds the same tensors under other keys::

    partitions.0.0.module.conv.weight  ->  0.conv.weight     (a skippable layer 0)
    partitions.0.1.running_mean        ->  1.running_mean
    partitions.0.1.sum                 ->  (dropped: a deferred batch norm's sums)

``GPipe.load_state_dict`` reads one through :func:`from_0_0_7`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch import nn

from torchgpipe.batchnorm import DeferredBatchNorm

__all__ = ["from_0_0_7"]

_PARTITIONS = "partitions."
_SUMS = ("sum", "sum_squares")  # 0.0.7's DeferredBatchNorm buffers


def from_0_0_7(state_dict: Mapping[str, Any], model: nn.Module) -> Mapping[str, Any]:
    """``state_dict`` under ``model``'s keys where torchgpipe 0.0.7 saved it; else itself.

    A state dict is 0.0.7's where every key starts with ``partitions.`` and none of
    ``model``'s does (this library refuses a layer of that name). A key that names no
    tensor of ``model`` either way is kept as 0.0.7 gave it but for ``partitions.<j>.``,
    so that a strict load names it among the unexpected keys.
    """
    keys = list(state_dict)
    own = model.state_dict(keep_vars=True)
    if not keys or not all(key.startswith(_PARTITIONS) for key in keys):
        return state_dict
    if any(key.startswith(_PARTITIONS) for key in own):
        return state_dict
    deferred = {
        _unwrapped(name) for name, m in model.named_modules() if isinstance(m, DeferredBatchNorm)
    }
    tensors = {_unwrapped(key): key for key in own}
    converted: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        path = _within(key)
        holder, _, name = path.rpartition(".")
        if path not in own and name in _SUMS and _unwrapped(holder) in deferred:
            continue
        converted[path if path in own else tensors.get(_unwrapped(path), path)] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        modules = {_unwrapped(name): name for name, _ in model.named_modules()}
        versions: OrderedDict[str, Any] = OrderedDict()
        for path, data in metadata.items():
            if path and path.count(".") < 2:  # partitions, partitions.<j>: no module here
                continue
            inside = _within(path) if path else ""
            versions[modules.get(_unwrapped(inside), inside)] = data
        converted._metadata = versions  # type: ignore[attr-defined]  # torch's own attribute
    return converted


def _within(key: str) -> str:
    """``key`` without its ``partitions.<j>.``: the layer's name first."""
    return key.split(".", 2)[2]


def _unwrapped(path: str) -> str:
    """``path`` without the ``module`` a 0.0.7 skippable wrapper put in it."""
    return ".".join(part for part in path.split(".") if part != "module")
