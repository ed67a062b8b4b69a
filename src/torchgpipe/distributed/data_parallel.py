"""Data parallelism over pipelines: the same stage's gradients averaged over its replicas."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = ["all_reduce_gradients"]


def all_reduce_gradients(
    module: nn.Module, group: Any, *, op: Literal["mean", "sum"] = "mean"
) -> None:
    """Average (or sum) ``module``'s gradients over a data-parallel ``group``.

    For pipelines replicated over data-parallel groups: after each step, every replica
    of a stage calls this with the group of its replicas, then steps its optimizer. A
    parameter without a gradient counts as a zero gradient, so replicas that did not all
    reach a parameter still agree. Gradients of one dtype and device travel together.

    Raises:
        ValueError: an unknown ``op``.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    import torch.distributed as dist

    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    params = [p for p in module.parameters() if p.requires_grad]
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault((p.dtype, p.device), []).append(p)
    size = dist.get_world_size(group)
    for bucket in buckets.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if op == "mean":
            flat /= size
        offset = 0
        for p, g in zip(bucket, grads, strict=True):
            part: Tensor = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
