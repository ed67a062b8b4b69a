"""Putting a model back as it was when building a GPipe or a PipelineStage fails."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import TypeVar

import torch
from torch import nn

__all__ = ["Undo"]


class Undo:
    """What every module of a model holds now: its parameters, buffers and children.

    Building on a model changes it in place: batch norm layers given a deferred
    class, tied weights given a copy per partition, meta layers allocated and filled,
    layers moved to their devices. Some refusals come only once that began (a reset
    that left a tensor as allocated, another process that failed to start); calling
    the ``Undo`` then puts every module's tensors and children back, the values of the
    parameters moved included, so the model can be given again, as it was.
    """

    def __init__(self, module: nn.Module, loaded: Iterable[nn.Module] = ()) -> None:
        """Keep what ``module`` holds; of the layers in ``loaded``, their values too.

        ``loaded``: layers with values that a state dict will be loaded into in place
        (layers built outside the meta device among meta ones); the others' tensors are
        replaced, not written, so keeping the tensors keeps their values.
        """
        self._kept = [
            (
                m,
                type(m),  # deferred batch norm changes a layer's class
                set(vars(m)),  # and adds attributes
                dict(m._parameters),
                dict(m._buffers),
                dict(m._modules),
                {name: p.data for name, p in m._parameters.items() if p is not None},
            )
            for m in module.modules()
        ]
        self._values = [
            (t, t.detach().clone())
            for layer in loaded
            for t in chain(layer.parameters(), layer.buffers())
        ]

    def __call__(self) -> None:
        """Put back what every module held when the ``Undo`` was made."""
        for module, cls, names, parameters, buffers, children, data in self._kept:
            module.__class__ = cls
            for name in set(vars(module)) - names:
                delattr(module, name)
            _refill(module._parameters, parameters)
            _refill(module._buffers, buffers)
            _refill(module._modules, children)
            for name, value in data.items():
                parameter = parameters[name]
                assert parameter is not None  # only those were kept
                parameter.data = value  # where .to(device) moved it, back
            if isinstance(module, nn.RNNBase):  # its flat weights: those put back, not kept
                module._init_flat_weights()
        with torch.no_grad():
            for tensor, value in self._values:
                tensor.copy_(value)


V = TypeVar("V")


def _refill(table: dict[str, V], kept: dict[str, V]) -> None:
    if not isinstance(table, dict):  # a TorchScript module's: its names are fixed
        for name, value in kept.items():
            table[name] = value
        return
    table.clear()
    table.update(kept)
