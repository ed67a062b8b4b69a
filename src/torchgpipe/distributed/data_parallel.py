"""Data parallelism over pipelines: the same stage's gradients averaged over its replicas.

Each bucket of gradients (one dtype and device) travels as one flat tensor, with two
more elements per parameter at its end: 1 where this replica has a gradient, and 1
where that gradient is dense. After the sum, a parameter whose first flag is 0 had no
gradient on any replica, and keeps none, as in the plain model (an optimizer skips it:
no weight decay, no momentum). One collective per bucket tells both the gradients and
where they exist::

    parameters w and b; no replica used b:   w's gradient   b's   flags (w, b) (w, b)
    replica 0                                [ g0          | 0   |  1  0       1  0 ]
    replica 1                                [ g1          | 0   |  1  0       1  0 ]
    all_reduce (sum), then / 2 for a mean    [ (g0+g1)/2   | 0   |  2  0       2  0 ]
    w.grad = (g0 + g1) / 2; b.grad stays None

A sparse gradient (``nn.Embedding(sparse=True)``) travels in its bucket as dense. Which
replicas have one, and in which layout, only each replica knows (one did not use the
embedding this step, another used it densely too), while every replica must make the
same collectives with the same sizes: a slot of the parameter's size in every bucket
is the one layout they all agree on without asking. Where every replica that has a
gradient has a sparse one, the mean is made sparse again, as the plain model's
gradient would be (``torch.optim.SparseAdam`` takes sparse gradients only): one more
collective of a flag per row (per index of the first dimension) gives the rows any
replica's gradient names, and the gradient holds those rows of the mean, no other,
as the plain model's would (a row looked up whose gradient sums to zero included:
``SparseAdam`` still decays its moments). A dense gradient on any replica makes the
result dense, as autograd adds a sparse gradient and a dense one.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import torch
from torch import Tensor, nn

from torchgpipe.distributed.groups import backends_of, check_member

__all__ = ["all_reduce_gradients"]


def all_reduce_gradients(
    module: nn.Module, group: Any, *, op: Literal["mean", "sum"] = "mean"
) -> None:
    """Average (or sum) ``module``'s gradients over a data-parallel ``group``.

    For pipelines replicated over data-parallel groups: after each step, every replica
    of a stage calls this with the group of its replicas, then steps its optimizer. A
    parameter that no replica gave a gradient keeps ``grad`` None; one that only some
    replicas did gets the reduced gradient everywhere, a replica without one counting
    zero. Gradients of one dtype and device travel together, in one ``all_reduce``;
    for the mean each is divided first, as DDP does (a float16 sum may overflow where
    the mean fits).
    Sparse gradients travel as dense, and come out sparse (the rows any replica's
    gradient names) where every replica that has a gradient has a sparse one, dense
    otherwise (see the module's documentation).

    Raises:
        TypeError: ``group`` is not a process group (a list of ranks, say).
        ValueError: an unknown ``op``, a ``group`` this process is not a member of, or
            one whose members hold different stages (in every member).
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    import torch.distributed as dist

    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    _check_group(group)
    if group is not None:
        check_member(group, "group", "the group of this stage's replicas")
    params = [p for p in module.parameters() if p.requires_grad]
    _check_replicas(module, params, group)
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault((p.dtype, p.device), []).append(p)
    size = dist.get_world_size(group)
    for bucket in buckets.values():
        _reduce_bucket(bucket, group, divide=size if op == "mean" else 1)


def _check_replicas(module: nn.Module, params: list[nn.Parameter], group: Any) -> None:
    """Refuse, in every member at once, a ``group`` whose members hold different stages.

    Each member's layout (its stages, where ``module`` is a ``PipelineStage``, and its
    trainable parameters' shapes, dtypes and devices) is digested, and one small
    ``all_reduce`` (max of the digest and of its negation) tells whether all agree.
    Otherwise the members would average different stages' gradients, silently where the
    shapes agree (identical blocks), or the collectives would not match.
    """
    import torch.distributed as dist

    from torchgpipe.distributed.stage import PipelineStage

    stages = module.stages if isinstance(module, PipelineStage) else None
    layout = [(tuple(p.shape), str(p.dtype), p.device.type) for p in params]
    digest = hashlib.sha256(repr((stages, layout)).encode()).digest()
    value = int.from_bytes(digest[:7], "little")  # fits an int64, and its negation too
    device = torch.device("cpu")
    if "cpu" not in backends_of(group):  # NCCL: it moves this process's GPU's tensors
        gpus = [p.device for p in params if p.device.type == "cuda"]
        if isinstance(module, PipelineStage) and module.device.type == "cuda":
            gpus.insert(0, module.device)
        device = gpus[0] if gpus else torch.device("cuda", torch.cuda.current_device())
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != value or int(both[1]) != -value:
        held = f"stages {list(stages)}, " if stages is not None else ""
        raise ValueError(
            f"the members of group do not all hold the same stages and trainable "
            f"parameters: this process holds {held}{len(params)} trainable parameter "
            f"tensors, and another holds others (other stages, or parameters frozen "
            f"otherwise); pass the group of this stage's replicas (the processes that "
            f"hold the same stages of pipelines alike), not the pipeline's own group, and "
            f"freeze parameters alike in every replica"
        )


def _check_group(group: object) -> None:
    """Refuse what is not a process group (a list of ranks), before torch fails on it.

    Torch's message would be ``unhashable type: 'list'``. What ``new_group()`` returns to
    a process outside the group passes: :func:`check_member` refuses it by name.
    """
    import torch.distributed as dist

    outside = dist.GroupMember.NON_GROUP_MEMBER
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if type(group) is type(outside) and group == outside:
        return
    ranks = list(group) if isinstance(group, list | tuple) else "ranks"
    raise TypeError(
        f"group must be a ProcessGroup, or None for the default group; got {group!r} of "
        f"type {type(group).__name__}: make the group with dist.new_group({ranks}) in "
        f"every process, and pass what it returns"
    )


def _reduce_bucket(bucket: list[nn.Parameter], group: Any, *, divide: int) -> None:
    """Reduce one bucket's gradients and flags in one ``all_reduce`` (two with sparse)."""
    import torch.distributed as dist

    grads = [_dense(p) for p in bucket]
    n, dtype, device = len(bucket), bucket[0].dtype, bucket[0].device
    present = [p.grad is not None for p in bucket]
    dense = [p.grad is not None and not p.grad.is_sparse for p in bucket]
    # The rows of this replica's sparse gradients, before the collectives: whatever
    # fails here alone must fail before any, or the other replicas would wait on it.
    rows = {k: _rows(p) for k, p in enumerate(bucket) if present[k] and not dense[k]}
    flat = torch.cat(
        [*(g.reshape(-1) for g in grads), torch.tensor(present + dense, dtype=dtype, device=device)]
    )
    total = flat.numel() - 2 * n
    if divide != 1:  # before the sum, as DDP: a float16 sum may overflow where the mean fits
        flat[:total] /= divide
    dist.all_reduce(flat, group=group)
    anywhere = (flat[total : total + n] != 0).tolist()
    somewhere_dense = (flat[total + n :] != 0).tolist()
    # The same on every replica, after the sum: the parameters whose mean is sparse.
    sparse = [k for k in range(n) if anywhere[k] and not somewhere_dense[k]]
    named: dict[int, Tensor] = {}
    if sparse:
        parts = [rows[k] if k in rows else _rows(bucket[k]) for k in sparse]
        flags = torch.cat(parts)
        dist.all_reduce(flags, group=group)
        for k, some in zip(sparse, flags.split([r.numel() for r in parts]), strict=True):
            named[k] = some.nonzero().reshape(-1)
    offset = 0
    for k, (p, g) in enumerate(zip(bucket, grads, strict=True)):
        part: Tensor = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        if not anywhere[k]:
            continue  # no replica has a gradient for it (its grad is None here too)
        if k in named:
            index = named[k].to(part.device)  # sorted, each row once: coalesced as made
            p.grad = torch.sparse_coo_tensor(
                index.unsqueeze(0), part[index], p.shape, check_invariants=False, is_coalesced=True
            )
        elif p.grad is None or p.grad.is_sparse:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)


def _dense(p: Tensor) -> Tensor:
    """``p``'s gradient as a dense tensor; zeros where it has none."""
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def _rows(p: Tensor) -> Tensor:
    """A flag per row of ``p`` (index of its first dimension): 1 where its gradient names it.

    All 0 for a dense gradient, or none. ``int32``, not the bucket's dtype: a sum of
    flags in ``bfloat16`` stops counting at 256 replicas.
    """
    flags = torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.int32, device=p.device)
    if p.grad is not None and p.grad.is_sparse:
        flags[p.grad.coalesce().indices()[0].to(p.device)] = 1
    return flags
