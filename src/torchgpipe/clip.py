"""Clipping a pipeline's gradients by their total norm, each weight counted once.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does not fit a pipeline
that ties weights or spans processes: a tied weight has a copy in every partition that
uses it, each holding the same summed gradient, so the norm would count it once per
copy; and across processes each rank sees its own parameters only, so each would clip
by another norm, and the copies of a tied weight would drift apart.
``GPipe.clip_grad_norm_`` and ``PipelineStage.clip_grad_norm_`` count each weight once
(its owner's copy), bring the processes' parts together in rank order (every rank gets
the same total), and scale every copy alike::

    loss_fn(model(x), y).backward()
    model.clip_grad_norm_(1.0)          # not clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

Torch's total is the norm of order ``p`` of the vector of every gradient's own norm
(a complex gradient's: of its absolute values), each taken in its gradient's dtype, the
vector in the dtype that promotes them all. This clip does the same arithmetic: each
process takes its gradients' norms in their dtypes (:func:`norm_part`), the processes'
norms are brought together in rank order, and the total is their norm in the promoted
dtype (:func:`total_norm`). So it overflows, or underflows, where torch's does (float16
gradients of 1000 give an infinite total in both), and differs from it at most in the
last bits, from the order of the sum. With no gradient anywhere the total is 0, as
torch's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import reduce

import torch
from torch import Tensor

__all__ = ["NormPart", "clip_by", "clip_grad_norm", "counted_once", "norm_part", "total_norm"]


_INF = ("inf", "infinity")  # the strings max_norm may be, as torch's float() reads them


def check_clip_arguments(max_norm: float, norm_type: float | str) -> tuple[float, float]:
    """``max_norm`` and ``norm_type`` as floats, refused when they mean nothing.

    ``max_norm=math.inf`` clips nothing: the call only returns the total norm, as
    torch's clip does (a non-finite norm still scales the gradients by NaN there).
    ``norm_type`` is any number but NaN (0 and negative ones too, as torch takes them),
    or a string that ``float()`` reads (``'2'``, ``'inf'``), as torch's ``float()`` does.

    Raises:
        TypeError: either is not a real number (a bool is not one).
        ValueError: ``max_norm`` is negative or NaN, ``norm_type`` NaN.
    """
    floats = []
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        # As torch's clip takes them: a real number (NumPy's too), a one-element tensor;
        # a string: 'inf' for max_norm, any that float() reads for norm_type.
        fits = (
            isinstance(value, numbers.Real)
            or (isinstance(value, str) and (name == "norm_type" or value.lower() in _INF))
            or (isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex())
        )
        try:
            if _is_bool(value) or not fits:
                raise TypeError
            floats.append(float(value.detach() if isinstance(value, Tensor) else value))
        except (TypeError, ValueError):
            also = " or a string that float() reads ('2', 'inf')" if name == "norm_type" else ""
            raise TypeError(
                f"{name} must be a real number{also}, got {value!r} of type {type(value).__name__}"
            ) from None
    limit, order = floats
    if not limit >= 0:  # NaN too
        raise ValueError(
            f"max_norm must be a number >= 0 (math.inf to clip nothing and get the norm), "
            f"got {max_norm!r}"
        )
    if math.isnan(order):
        raise ValueError(
            f"norm_type must be a number, not NaN (2.0, 1.0, math.inf, 0, -math.inf, ...), "
            f"got {norm_type!r}"
        )
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


@dataclass(frozen=True)
class NormPart:
    """Some gradients' (a process's) own norms: what they bring to the total norm.

    Attributes:
        norms: each gradient's norm of the order asked, taken in its dtype (a complex
            gradient's real dtype), as a Python float (exact: float64 holds every value
            of the narrower dtypes).
        dtype: the dtype that promotes the gradients' norms; None for no gradient.
    """

    norms: tuple[float, ...]
    dtype: torch.dtype | None


def norm_part(grads: Iterable[Tensor], norm_type: float) -> NormPart:
    """Each of ``grads``' norms of order ``norm_type``, as torch's clip takes them.

    One copy to the CPU per device, not per gradient (on a GPU each copy waits for it).

    Raises:
        RuntimeError, NotImplementedError: torch cannot take the norm of a gradient
            (a sparse one; an empty one for ``norm_type`` inf or below 0), as its clip.
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    dtypes: list[torch.dtype] = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad.detach(), norm_type)  # in the gradient's dtype
        by_device.setdefault(grad.device, []).append(norm.to(torch.float64))  # exact
        dtypes.append(norm.dtype)
    norms: list[float] = []
    for on_device in by_device.values():
        norms += torch.stack(on_device).cpu().tolist()
    return NormPart(tuple(norms), reduce(torch.promote_types, dtypes) if dtypes else None)


def total_norm(parts: Sequence[NormPart], norm_type: float) -> Tensor:
    """The total norm of the gradients of every part, a 0-dim tensor on the CPU.

    The norm of order ``norm_type`` of all the parts' norms, in rank order, computed as
    torch's clip computes it: in the dtype that promotes the gradients' norms (float16
    and bfloat16 give float32, float32 and float64 float64), which is the dtype returned;
    the default dtype where there is no gradient.
    """
    dtypes = [part.dtype for part in parts if part.dtype is not None]
    dtype = reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()
    norms = [norm for part in parts for norm in part.norms]
    if not norms:
        return torch.zeros((), dtype=dtype)
    # Each norm is a value of its gradient's dtype, so the promoted one holds it exactly.
    total: Tensor = torch.linalg.vector_norm(torch.tensor(norms, dtype=dtype), norm_type)
    return total


def clip_by(
    parts: Sequence[NormPart],
    every: Sequence[Tensor],
    max_norm: float,
    norm_type: float,
    *,
    error_if_nonfinite: bool,
) -> Tensor:
    """Scale the gradients of ``every`` parameter by the total norm of ``parts``, to ``max_norm``.

    Returns the total norm before clipping (:func:`total_norm`). The scale is taken
    from it as torch takes it, in its dtype: a total that overflows that dtype is
    infinite here too, and scales every gradient by 0.

    Raises:
        RuntimeError: the total norm is not finite and ``error_if_nonfinite``.
    """
    total = total_norm(parts, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}, so they "
            f"cannot be clipped; pass error_if_nonfinite=False to scale them anyway"
        )
    scale = float(max_norm / (total + 1e-6))  # in the total's dtype, as torch's
    if scale < 1.0 or math.isnan(scale):  # a NaN norm makes every gradient NaN, as torch's
        with torch.no_grad():
            for p in every:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return total


def clip_grad_norm(
    counted: Sequence[Tensor],
    every: Sequence[Tensor],
    max_norm: float,
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> Tensor:
    """``GPipe.clip_grad_norm_``: clip the gradients of ``every`` parameter in this process.

    ``counted`` holds each weight once (the norm is theirs); ``every`` also the copies,
    which are scaled alike. ``foreach`` is taken as torch's clip takes it, where it
    chooses an implementation only (one kernel for many gradients): here it changes
    nothing, each gradient's norm is taken alone, in its dtype. Returns the total norm
    before clipping, a 0-dim tensor on the CPU in the dtype torch's clip returns
    (:func:`total_norm`).

    Raises:
        TypeError, ValueError: an argument is refused (:func:`check_clip_arguments`).
        RuntimeError: the total norm is not finite and ``error_if_nonfinite``, or torch
            cannot take the norm of a gradient (:func:`norm_part`).
    """
    del foreach  # see the docstring
    max_norm, order = check_clip_arguments(max_norm, norm_type)
    part = norm_part([p.grad for p in counted if p.grad is not None], order)
    return clip_by([part], every, max_norm, order, error_if_nonfinite=error_if_nonfinite)
