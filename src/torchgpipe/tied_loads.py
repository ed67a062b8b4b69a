"""A state dict loaded into a model whose tied weights are a copy per partition.

The plain model's state dict holds every name of a tied weight (``tied.py``); loaded
into the pipeline, each name reaches one copy. This gives every copy the value the plain
model's one tensor would end with, before torch loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from torchgpipe.materialize import every_name_fits, loaded_value

if TYPE_CHECKING:
    from torchgpipe.tied import Ties

__all__ = ["loading"]


def loading(
    ties: Ties,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    metadata: Any,
    strict: bool,
    *args: Any,
) -> None:
    """Give every name of each tied weight here the value the plain model would end with.

    A load's pre-hook of ``module``, which holds the copies of ``ties``. The value is
    :func:`loaded_value`'s: a name the state dict lacks is filled from another, so it is
    not reported missing (torch tells a hook nothing of ``strict``). Each copy gets a
    tensor of its own (``assign=True`` would otherwise put one tensor under two
    parameters), and every name of one copy the same parameter: with ``assign=True``
    torch would wrap a plain tensor in a parameter once per name, and a weight used
    twice in a partition would no longer be one there.
    """
    mine: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        mine.setdefault(id(parameter), []).append(prefix + name)
    for g, group in enumerate(ties.groups):
        keys = [prefix + key for key in ties.names[g]]
        value = loaded_value(state_dict, keys)
        if value is None or not every_name_fits(state_dict, keys, group[0]):
            continue
        for member in group:
            copy = nn.Parameter(value.detach().clone(), member.requires_grad)
            for key in mine.get(id(member), []):
                state_dict[key] = copy
