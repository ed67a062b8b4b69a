"""Facts about a ``torch.distributed`` process group that the transport and others need.

Which backend moves which device's tensors, and whether this process is a member.
"""

from __future__ import annotations

from typing import Any

__all__ = ["backends_of", "check_member"]


def backends_of(group: Any) -> dict[str, str]:
    """Which backend moves the tensors of each device type on ``group``.

    From its configuration (``"cpu:gloo,cuda:nccl"``), not its name: a group made by
    ``init_process_group()`` without a backend is named ``"undefined"``, one made with
    ``"cpu:gloo,cuda:nccl"`` by that string. A name alone (older torch) stands for
    every device type it moves: ``"nccl"`` CUDA tensors only.
    """
    import torch.distributed as dist

    get_config = getattr(dist, "get_backend_config", None)
    config = str(get_config(group) if get_config is not None else dist.get_backend(group))
    if ":" not in config:
        return {"cuda": config} if config == "nccl" else {"cpu": config, "cuda": config}
    pairs = (entry.partition(":") for entry in config.split(","))
    return {device.strip(): backend.strip() for device, _, backend in pairs}


def check_member(
    group: Any, name: str, wanted: str = "the one of its own pipeline, or leave it out"
) -> None:
    """Refuse a process group this process is not in, before torch fails on it obscurely.

    ``name`` is the argument that gave it, ``wanted`` says which group to pass instead.
    """
    import torch.distributed as dist

    if dist.get_rank(group) < 0:  # what torch.distributed answers to a non-member
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not in the process group "
            f"given as {name}=; pass a group that includes it, {wanted} (every process "
            f"calls new_group() for each group, but only the group's members may pass "
            f"what it returns)"
        )
