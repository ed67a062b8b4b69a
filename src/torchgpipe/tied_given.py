"""Tied weights in a call that ``torch.func.functional_call`` gives tensors of its own.

``functional_call(model, params, args)`` puts the tensors of ``params`` in the model's
slots for one call, and treats a tied weight as one (``tie_weights=True``): given one of
its names, every use of the weight uses the tensor given. In a pipeline a tied weight is a
copy per partition (``tied.py``), tensors torch does not know to be one: given the plain
model's name, torch would replace the first partition's copy alone, and the last
partition's head would compute with the old weight, silently.

So at the start of a forward or step, :meth:`Ties.using` compares each tied weight's
slots with the copies the ties keep (``Ties.own``, the tensors their sums and hooks are
on). A slot that holds a plain tensor, not a parameter, holds a call's (a module's
slot takes a parameter only, but from ``functional_call``):

- one tensor given (under one name or several): the slots that still hold their copies
  take it too, for this call (:func:`fill`), on their partitions' devices (a copy there
  that autograd takes back to it, which a checkpointed cell may use again:
  :func:`moved`); the given tensor gets the gradient of every use by autograd itself,
  as in the plain model, and the copies stay out of it;
- a tensor given per copy, under every name (``pipe.named_parameters()``, cloned):
  each partition computes with its own, and each gets the gradient of its partition's
  uses only, no sum: they are the caller's tensors, not the pipeline's copies;
- several tensors given, but not for every copy: which one the others take is not said,
  and the call is refused.

A slot that holds another parameter than its copy was given one for good, as a module
takes one (a load with ``assign=True``, a conversion that overwrites parameters,
``module.weight = nn.Parameter(...)``), or by a ``functional_call`` given parameters:
the two cannot be told apart, and the ties keep the slots' parameters as the copies from
then on (:func:`replaced`), as they did before a call was looked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Filled", "fill", "is_moved", "moved", "put_back", "replaced"]

Filled = list[tuple[dict[str, Any], str, Tensor]]
"""Slots given another tensor for one call: each slot's dict, name, and the copy it held."""


def replaced(p: Tensor | None) -> bool:
    """Whether a slot holding ``p`` holds the model's parameter: its copy, or a new one."""
    return isinstance(p, nn.Parameter)


def moved(one: Tensor, device: torch.device) -> Tensor:
    """``one`` on ``device``, for a slot there: itself where it is already there."""
    if one.device == device:
        return one
    made = one.to(device)
    _MOVED[made] = True
    return made


_MOVED = WeakIdKeyDictionary()  # the tensors moved(), while they live


def is_moved(p: Tensor) -> bool:
    """Whether ``p`` is a given tensor :func:`moved` to a partition's device.

    A checkpointed cell may use it again in its recomputation: its node (a copy)
    keeps no tensors, so autograd can go through it once per micro-batch.
    """
    return p in _MOVED


def fill(
    holders: Sequence[Sequence[tuple[nn.Module, str]]], own: Sequence[Tensor], names: list[str]
) -> Filled:
    """Give the slots that still hold a copy of ``own`` the one tensor given in the others.

    ``holders`` are, per copy of a tied weight, the (module, name) slots that hold it;
    ``names``, the weight's names in the state dict. Returns what it changed, for the
    caller to put back once the call is over. Changes all or nothing.

    Raises:
        ValueError: several tensors were given, not one per slot (nothing changed).
    """
    kept = {id(p) for p in own}
    now = [(module, name, module._parameters[name]) for slots in holders for module, name in slots]
    given = list({id(p): p for _, _, p in now if p is not None and id(p) not in kept}.values())
    keeping = [(module, name, p) for module, name, p in now if p is not None and id(p) in kept]
    if not given or not keeping:
        return []
    if len(given) > 1:
        named = " / ".join(names) if names else "a tied weight"
        raise ValueError(
            f"torchgpipe: functional_call gave the tied weight {named} {len(given)} "
            f"different tensors, for some of its copies (one per partition that uses it) "
            f"and not others, so which one the rest would use is not said; give it one "
            f"tensor, under any of its names, or one under every name of each copy"
        )
    one = given[0]
    placed = [moved(one, copy.device) for _, _, copy in keeping]  # what fails, before a change
    filled: Filled = []
    for (module, name, copy), tensor in zip(keeping, placed, strict=True):
        module._parameters[name] = tensor  # type: ignore[assignment]  # a slot takes any tensor, as functional_call's
        filled.append((module._parameters, name, copy))
    return filled


def put_back(filled: Filled) -> None:
    """Undo :func:`fill`: each slot holds its copy again."""
    for slots, name, copy in filled:
        slots[name] = copy
