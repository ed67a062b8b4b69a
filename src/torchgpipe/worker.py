"""Worker threads, one per partition, and the caller's state they must carry.

Workers live for one call of ``GPipe.forward``: they are started when it begins and
joined before it returns or raises. Threads are cheap next to a training step (the
benchmark reports the overhead per cell), and a pool that lives no longer than the call
can neither leak threads nor stop a ``GPipe`` from being copied, pickled or collected.

A new thread starts with PyTorch's thread-local defaults (grad mode on, autocast off,
the default CUDA stream), so the caller's state is captured in a :class:`ThreadState`
and entered again on each worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

__all__ = ["ThreadState", "spawn"]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type``, or None when autocast is off."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    if device_type == "cpu":  # pragma: no cover - torch < 2.4
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    else:  # pragma: no cover - torch < 2.4
        enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return dtype if enabled else None


@dataclass(frozen=True)
class ThreadState:
    """The thread-local state of the caller that every cell must run under."""

    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # device types where it is on

    @classmethod
    def capture(cls) -> ThreadState:
        """Read the calling thread's grad mode and autocast state."""
        autocast = []
        for device_type in _AUTOCAST_DEVICE_TYPES:
            dtype = _autocast_dtype(device_type)
            if dtype is not None:
                autocast.append((device_type, dtype))
        return cls(torch.is_grad_enabled(), tuple(autocast))

    @contextmanager
    def apply(self, *, grad_enabled: bool | None = None) -> Iterator[None]:
        """Enter this state on the calling thread; ``grad_enabled`` overrides grad mode."""
        grad = self.grad_enabled if grad_enabled is None else grad_enabled
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield


@contextmanager
def spawn(jobs: Sequence[Callable[[], None]], *, name: str = "torchgpipe") -> Iterator[None]:
    """Run each job on a thread of its own within the block; join them all on exit.

    The jobs must return on their own: this never abandons a thread, so a job that could
    block forever would hang the caller. Jobs report failures through their own channels.
    """
    threads = [
        threading.Thread(target=job, name=f"{name}-worker-{j}", daemon=True)
        for j, job in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for thread in threads:
            thread.join()
