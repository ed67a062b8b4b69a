"""Tied weights in a call that ``torch.func.functional_call`` gives tensors of its own.

``functional_call(model, params, args)`` puts the tensors of ``params`` in the model's
slots for one call, and treats a tied weight as one (``tie_weights=True``): given one of
its names, every use of the weight uses the tensor given. In a pipeline a tied weight is a
copy per partition (``tied.py``), tensors torch does not know to be one: given the plain
model's name, torch would replace the first partition's copy alone, and the last
partition's head would compute with the old weight, silently.

So at the start of a forward or step, :meth:`Ties.using` compares each tied weight's
slots with the copies the ties keep (``Ties.own``, the tensors their sums and hooks are
on). Where some slots hold other tensors, put there by a ``functional_call``:

- one tensor given (under one name or several): the slots that still hold their copies
  take it too, on their partitions' devices, for this call (:func:`fill`); the given
  tensor gets the gradient of every use by autograd itself, as in the plain model, and
  the copies stay out of it;
- a tensor given per copy, under every name (``dict(pipe.named_parameters())``, cloned):
  each partition computes with its own, and each gets the gradient of its partition's
  uses only, no sum: they are the caller's tensors, not the pipeline's copies;
- several tensors given, but not for every copy: which one the others take is not said,
  and the call is refused.

Slots that each hold a new ``nn.Parameter`` (a load with ``assign=True``, a conversion
under ``torch.__future__.set_overwrite_module_params_on_conversion(True)``) replaced the
copies for good: the ties keep those from then on (:func:`replaced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["Filled", "fill", "put_back", "replaced"]

Filled = list[tuple[dict[str, Any], str, Tensor]]
"""Slots given another tensor for one call: each slot's dict, name, and the copy it held."""


def replaced(own: Sequence[Tensor], now: Sequence[Tensor]) -> bool:
    """Whether ``now`` replaced the copies ``own`` for good: a new parameter in each slot."""
    kept = {id(p) for p in own}
    return len({id(p) for p in now}) == len(now) and all(
        isinstance(p, nn.Parameter) and id(p) not in kept for p in now
    )


def fill(slots: Sequence[tuple[nn.Module, str]], own: Sequence[Tensor], names: list[str]) -> Filled:
    """Give the slots that still hold a copy of ``own`` the one tensor given in the others.

    ``slots`` are a tied weight's (module, name), ``names`` its names in the state dict.
    Returns what it changed, for the caller to put back once the call is over.

    Raises:
        ValueError: several tensors were given, not one per slot (nothing changed).
    """
    kept = {id(p) for p in own}
    now = [module._parameters[name] for module, name in slots]
    given = list({id(p): p for p in now if p is not None and id(p) not in kept}.values())
    keeping = [(module, name, p) for (module, name), p in zip(slots, now, strict=True)
               if p is not None and id(p) in kept]  # fmt: skip
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
    filled: Filled = []
    for module, name, copy in keeping:
        module._parameters[name] = one if one.device == copy.device else one.to(copy.device)  # type: ignore[assignment]  # a slot takes any tensor, as functional_call's
        filled.append((module._parameters, name, copy))
    return filled


def put_back(filled: Filled) -> None:
    """Undo :func:`fill`: each slot holds its copy again."""
    for slots, name, copy in filled:
        slots[name] = copy
