"""Data parallelism over pipelines: the same stage's gradients averaged over its replicas.

Each bucket of gradients (one dtype and device) travels as one flat tensor, with one
more element per parameter at its end: 1 where this replica has a gradient, 0 where it
has none. After the sum, a parameter whose flag is 0 had no gradient on any replica,
and keeps none, as in the plain model (an optimizer skips it: no weight decay, no
momentum). One collective per bucket tells both the gradients and where they exist::

    parameters w and b; no replica used b:   w's gradient   b's   flags (w, b)
    replica 0                                [ g0          | 0   |  1  0 ]
    replica 1                                [ g1          | 0   |  1  0 ]
    all_reduce (sum), then / 2 for a mean    [ (g0+g1)/2   | 0   |  2  0 ]
    w.grad = (g0 + g1) / 2; b.grad stays None
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from torchgpipe.distributed.transport import check_member

__all__ = ["all_reduce_gradients"]


def all_reduce_gradients(
    module: nn.Module, group: Any, *, op: Literal["mean", "sum"] = "mean"
) -> None:
    """Average (or sum) ``module``'s gradients over a data-parallel ``group``.

    For pipelines replicated over data-parallel groups: after each step, every replica
    of a stage calls this with the group of its replicas, then steps its optimizer. A
    parameter that no replica gave a gradient keeps ``grad`` None; one that only some
    replicas did gets the reduced gradient everywhere, a replica without one counting
    zero. Gradients of one dtype and device travel together, in one ``all_reduce``.

    Raises:
        ValueError: an unknown ``op``, or a ``group`` this process is not a member of.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    import torch.distributed as dist

    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    if group is not None:
        check_member(group, "group", "the group of this stage's replicas")
    params = [p for p in module.parameters() if p.requires_grad]
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault((p.dtype, p.device), []).append(p)
    size = dist.get_world_size(group)
    for bucket in buckets.values():
        _reduce_bucket(bucket, group, divide=size if op == "mean" else 1)


def _reduce_bucket(bucket: list[nn.Parameter], group: Any, *, divide: int) -> None:
    """Reduce one bucket's gradients and presence flags in one ``all_reduce``."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
    present = torch.tensor(
        [p.grad is not None for p in bucket], dtype=bucket[0].dtype, device=bucket[0].device
    )
    flat = torch.cat([*(g.reshape(-1) for g in grads), present])
    dist.all_reduce(flat, group=group)
    total = flat.numel() - len(bucket)
    if divide != 1:
        flat[:total] /= divide
    anywhere = (flat[total:] != 0).tolist()
    offset = 0
    for k, (p, g) in enumerate(zip(bucket, grads, strict=True)):
        part: Tensor = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        if not anywhere[k]:
            continue  # no replica has a gradient for it (its grad is None here too)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)
