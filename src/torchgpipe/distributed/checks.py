"""What the processes of a pipeline compare at start, and the checks of their calls.

Every process builds the same ``nn.Sequential`` and ``PipelineStage``; at construction
each sends the others a fingerprint of what it was given (:func:`fingerprint`), and all
refuse to start, with the same message (:func:`differences`), when one differs. A
difference that slipped through would surface later as transfers that do not match,
or as a hang until the process group's timeout. The fingerprint holds the options,
each layer's type and tensor shapes, and the model's ties: which names hold one tensor
(``model[2].weight = model[0].weight``), since ties decide which transfers a step makes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["check_rank", "differences", "fingerprint"]


def fingerprint(module: nn.Sequential, options: Mapping[str, Any]) -> dict[str, Any]:
    """What a process was given: ``options``, each layer's tensors, and the ties."""
    layers = []
    for name, layer in module.named_children():
        params = ", ".join(
            f"{key} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for key, t in [*layer.named_parameters(), *layer.named_buffers()]
        )
        layers.append(f"{name}: {type(layer).__qualname__}({params})")
    return {**options, "layers": layers, "ties": _ties(module)}


def _ties(module: nn.Sequential) -> list[str]:
    """Each name that holds a tensor an earlier name holds: ``'2.weight is 0.weight'``."""
    first: dict[int, str] = {}
    ties = []
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        earlier = first.setdefault(id(tensor), name)
        if earlier != name:
            ties.append(f"{name} is {earlier}")
    return ties


def differences(prints: dict[int, dict[str, Any]]) -> list[str]:
    """Every way in which a rank's fingerprint differs from rank 0's, in one list."""
    base = prints[0]
    problems = []
    for rank in sorted(prints):
        if rank == 0:
            continue
        for field, value in prints[rank].items():
            if value == base.get(field):
                continue
            if field == "layers":
                problems.append(_layer_difference(base[field], value, rank))
            elif field == "ties":
                problems.append(_tie_difference(base[field], value, rank))
            else:
                problems.append(
                    f"{field} is {base.get(field)!r} on rank 0 but {value!r} on rank {rank}"
                )
    return problems


def _layer_difference(base: list[str], other: list[str], rank: int) -> str:
    if len(base) != len(other):
        return f"the model has {len(base)} layers on rank 0 but {len(other)} on rank {rank}"
    k = next(k for k, (a, b) in enumerate(zip(base, other, strict=True)) if a != b)
    return f"layer {k} is {base[k]} on rank 0 but {other[k]} on rank {rank}"


def _tie_difference(base: list[str], other: list[str], rank: int) -> str:
    parts = []
    only_base = [tie for tie in base if tie not in other]
    only_other = [tie for tie in other if tie not in base]
    if only_base:
        parts.append(f"on rank 0 but not on rank {rank}: {', '.join(only_base)}")
    if only_other:
        parts.append(f"on rank {rank} but not on rank 0: {', '.join(only_other)}")
    return f"the model's tied tensors differ, {'; '.join(parts)}"


def check_rank(dst: object, world_size: int, what: str) -> int:
    """``dst``, a rank of the pipeline's ``world_size`` processes, or a clear error.

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is out of range.
    """
    if not isinstance(dst, int) or isinstance(dst, bool):
        raise TypeError(f"{what} must be a rank (an int), got {dst!r}")
    if not 0 <= dst < world_size:
        raise ValueError(
            f"{what}={dst} is not a rank of the pipeline's {world_size} processes; pass "
            f"a rank from 0 to {world_size - 1}"
        )
    return dst
