"""Clipping a pipeline's gradients by their total norm, each weight counted once.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does not fit a pipeline
that ties weights or spans processes: a tied weight has a copy in every partition that
uses it, each holding the same summed gradient, so the norm would count it once per
copy; and across processes each rank sees its own parameters only, so each would clip
by another norm, and the copies of a tied weight would drift apart.
``GPipe.clip_grad_norm_`` and ``PipelineStage.clip_grad_norm_`` count each weight once
(its owner's copy), add up the processes' parts in rank order (every rank gets the same
total), and scale every copy alike::

    loss_fn(model(x), y).backward()
    model.clip_grad_norm_(1.0)          # not clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

The parts are summed in float64, so the total can differ from torch's float32 one in
the last bits.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["clip_grad_norm", "counted_once", "norm_part"]


def check_clip_arguments(max_norm: float, norm_type: float) -> tuple[float, float]:
    """``max_norm`` and ``norm_type`` as floats, refused when they mean nothing.

    ``max_norm=math.inf`` clips nothing: the call only returns the total norm, as
    torch's clip does (a non-finite norm still scales the gradients by NaN there).

    Raises:
        TypeError: either is not a real number (a bool is not one).
        ValueError: ``max_norm`` is negative or NaN, ``norm_type`` not positive.
    """
    floats = []
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        # As torch's clip takes them: a real number (NumPy's too), a one-element tensor,
        # 'inf' as a string.
        fits = (
            isinstance(value, numbers.Real)
            or (isinstance(value, str) and value.lower() in ("inf", "infinity"))
            or (isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex())
        )
        try:
            if _is_bool(value) or not fits:
                raise TypeError
            floats.append(float(value.detach() if isinstance(value, Tensor) else value))
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must be a real number, got {value!r} of type {type(value).__name__}"
            ) from None
    limit, order = floats
    if not limit >= 0:  # NaN too
        raise ValueError(
            f"max_norm must be a number >= 0 (math.inf to clip nothing and get the norm), "
            f"got {max_norm!r}"
        )
    if not order > 0:
        raise ValueError(f"norm_type must be positive (2.0, or math.inf), got {norm_type!r}")
    return limit, order


def _is_bool(value: object) -> bool:
    """A bool, or a tensor of one: ``float()`` takes them, but they are no norm."""
    if isinstance(value, Tensor):
        return value.dtype == torch.bool
    return isinstance(value, bool)  # NumPy's bool is no numbers.Real: refused anyway


def counted_once(
    parameters: Iterable[Tensor],
    groups: Sequence[Sequence[Tensor]],
    ranks: Sequence[tuple[int, ...] | None],
    rank: int = 0,
) -> list[Tensor]:
    """The ``parameters`` whose gradients count in the norm: each weight once.

    ``groups``: the tied weights' copies in this process, owner first; ``ranks``: per
    group, the processes that hold it (the first counts it), or None for this one only.
    """
    skip: set[int] = set()
    for group, held in zip(groups, ranks, strict=True):
        skip.update(id(copy) for copy in group[1:])
        if held is not None and held[0] != rank:
            skip.add(id(group[0]))
    return [p for p in parameters if id(p) not in skip]


def norm_part(grads: Iterable[Tensor], norm_type: float) -> Tensor:
    """This holder's part of the total norm: the sum of ``|g| ** p``, or the max ``|g|``.

    A 0-dim float64 tensor on the CPU; 0 for no gradients. One copy to the CPU per
    device, not per gradient (on a GPU each copy waits for the device).
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        norm = torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float64)
        by_device.setdefault(grad.device, []).append(norm)
    parts = [torch.zeros((), dtype=torch.float64)]
    for norms in by_device.values():
        stacked = torch.stack(norms)
        powers = stacked if math.isinf(norm_type) else stacked**norm_type
        parts.append(_combine(powers, norm_type).cpu())
    return _combine(torch.stack(parts), norm_type)


def _combine(parts: Tensor, norm_type: float) -> Tensor:
    """Parts of a norm's ``p``-th power added up; for the max norm, the largest."""
    return parts.max() if math.isinf(norm_type) else parts.sum()


def clip_grad_norm(
    counted: Sequence[Tensor],
    every: Sequence[Tensor],
    max_norm: float,
    norm_type: float,
    *,
    error_if_nonfinite: bool,
    gather: Callable[[Tensor], list[Tensor]] | None = None,
) -> Tensor:
    """Scale the gradients of ``every`` parameter so that their total norm is ``max_norm``.

    ``counted`` holds each weight once (the norm is theirs); ``every`` also the copies,
    which are scaled alike. ``gather(part)``: every process's part, in rank order (None
    in one process). Returns the total norm before clipping, a 0-dim float32 tensor on
    the CPU.

    Raises:
        RuntimeError: the total norm is not finite and ``error_if_nonfinite``.
    """
    max_norm, norm_type = check_clip_arguments(max_norm, norm_type)
    grads = [p.grad for p in counted if p.grad is not None]
    parts = [norm_part(grads, norm_type)]
    if gather is not None:
        parts = gather(parts[0])
    total = _combine(torch.stack(parts), norm_type)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}, so they "
            f"cannot be clipped; pass error_if_nonfinite=False to scale them anyway"
        )
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0 or math.isnan(scale):  # a NaN norm makes every gradient NaN, as torch's
        with torch.no_grad():
            for p in every:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return total.float()
