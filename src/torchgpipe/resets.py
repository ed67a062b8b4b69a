"""The modules' own resets of a layer just allocated, and the check that they filled it.

:mod:`torchgpipe.materialize` trusts no reset blindly: each tensor a reset is to fill
is marked first (NaN; a sentinel for integers), and one the resets left marked, wholly
or in part, is refused once they ran (:func:`reset`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Holder", "join", "own_tensors", "reset", "reset_of"]

Holder = tuple[int, nn.Module, str]
"""The ``id`` of a meta tensor, and a module that holds it under a name of its own."""


def own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors ``module`` holds itself, parameters and buffers, by name."""
    tables = (module._parameters, module._buffers)
    return [(n, t) for table in tables for n, t in table.items() if t is not None]


def reset(
    layer: nn.Module, held: list[Holder], watched: dict[int, tuple[int, Tensor]], prefix: str
) -> None:
    """Reset every module of ``layer`` that holds tensors and can, children first.

    ``held``: the layer's holders before allocation (:func:`_holders`); ``watched``:
    the meta tensors a reset is to fill (:attr:`Fill.watched`); ``prefix``: what the
    layer's keys start with in the model's, for errors.

    Each watched tensor is first marked: NaN when floating, the dtype's lowest value
    for integers, ``True`` for booleans. It is found unfilled (:meth:`_Mark.unfilled`)
    when no reset replaced it in any holder and it still holds a NaN (floating), or,
    for integers, no reset wrote it in place (its version counter) nor through
    ``.data`` (its storage, or its values).

    Raises:
        ValueError: the resets left a watched tensor as allocated.
    """
    paths: dict[int, str] = {}
    for path, module in layer.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    marks: dict[int, _Mark] = {}
    for key, module, name in held:
        if key in watched and watched[key][0] == id(layer):
            tensor = _slot(module, name)
            assert tensor is not None  # a holder holds a tensor
            if key not in marks and _markable(tensor):
                _mark(tensor)
                key_name = prefix + join(paths[id(module)], name)
                marks[key] = _Mark(tensor, tensor._version, tensor.data_ptr(), key_name, [])
            if key in marks:
                marks[key].holders.append((module, name))
    for _, module in _children_first(layer, ""):
        reset = reset_of(module)
        if reset is not None and own_tensors(module):
            reset()
    left = [mark.name for mark in marks.values() if mark.unfilled()]
    if left:
        where = prefix.removesuffix(".") or type(layer).__name__
        raise ValueError(
            f"layer {where}: reset_parameters() left {', '.join(left)} as allocated "
            f"(uninitialized memory, wholly or in part): fill it in the reset of the "
            f"module that holds it, or pass init= or a state dict holding it, or build "
            f"that layer outside the meta device"
        )


def _slot(module: nn.Module, name: str) -> Tensor | None:
    """The tensor ``module`` holds as ``name``, a parameter or a buffer."""
    found = module._parameters.get(name)
    return module._buffers.get(name) if found is None else found


@dataclass
class _Mark:
    """A tensor marked before the resets ran, as it was then."""

    tensor: Tensor
    version: int
    pointer: int
    name: str
    holders: list[tuple[nn.Module, str]]

    def unfilled(self) -> bool:
        """Whether the resets left the tensor, or part of it, as marked.

        Not when a holder now holds another tensor. A floating tensor still holding a
        NaN was not wholly written; an integer one counts as written once its version
        or its storage changed, or any value differs from the mark.
        """
        if any(_slot(module, name) is not self.tensor for module, name in self.holders):
            return False
        flat = self.tensor.detach().reshape(-1)
        if self.tensor.is_floating_point() or self.tensor.is_complex():
            return any(bool(part.isnan().any()) for part in flat.split(_PIECE))
        if self.tensor._version != self.version or self.tensor.data_ptr() != self.pointer:
            return False
        mark = _MARKS[self.tensor.dtype] if self.tensor.dtype in _MARKS else _lowest(flat)
        return all(bool((part == mark).all()) for part in flat.split(_PIECE))


_PIECE = 1 << 24  # elements looked at a time: a bounded temporary, whatever the tensor
_MARKS: dict[torch.dtype, bool] = {torch.bool: True}


def _lowest(tensor: Tensor) -> int:
    return torch.iinfo(tensor.dtype).min


def _markable(tensor: Tensor) -> bool:
    """Whether :func:`_mark` and its check work for ``tensor``'s dtype (not quantized...)."""
    probe = torch.empty(1, dtype=tensor.dtype)
    try:
        _mark(probe)
        if probe.is_floating_point() or probe.is_complex():
            return bool(probe.isnan().all())
        return bool((probe == (_MARKS.get(probe.dtype) or _lowest(probe))).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False  # left to its reset, unchecked


def _mark(tensor: Tensor) -> None:
    """Fill ``tensor`` with what no reset is likely to write: NaN, a lowest integer, True."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.data.fill_(math.nan)
    else:
        tensor.data.fill_(_MARKS[tensor.dtype] if tensor.dtype in _MARKS else _lowest(tensor))


def reset_of(module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters`` (or ``_reset_parameters``, attention's name), if any."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def _children_first(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s submodules, each after its children: the order constructors ran.

    Each with its path under ``path``, as its keys in a state dict start.
    """
    for name, child in module.named_children():
        yield from _children_first(child, join(path, name))
    yield path, module


def join(path: str, name: str) -> str:
    """``name`` under ``path``, as state-dict keys join them."""
    return f"{path}.{name}" if path else name
