"""What keeps a recomputation from changing a partition's state otherwise than its forward.

A checkpointed cell runs its layers twice: in the forward, and again in backward. The
plain model runs them once, so whatever the layers change besides their output (their
buffers) must come out as after one run, and the recomputation must compute from the
state the forward computed from:

- Batch norm's running statistics are updated by the forward and put back after the
  recomputation (:func:`~torchgpipe.batchnorm.freeze_running_stats`). Training-mode
  batch norm does not read them, so the recomputation computes what the forward did.
- Any other buffer that a layer changes in its forward (spectral norm's power
  iteration, a step counter) is set, for the recomputation, to the value the cell's
  forward started from, and then back to the value the later forwards left: the
  recomputed weight is the forward's, and the buffer ends as in the plain model.

Which buffers a forward changes (in place, or by assigning a new tensor) is learned at
the partition's first checkpointed forward, which keeps a copy of each before it runs;
later forwards keep a copy only of those seen changing. A buffer first seen changing
later (a layer that changes it only now and then) is learned then, with a warning: that
one cell's recomputation starts from the changed value.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.batchnorm import DeferredBatchNorm, freeze_running_stats

__all__ = ["Kept", "RecomputeGuard", "Restore", "recompute_guard"]

# Per buffer: the tensor before the forward, its version then, and a copy where needed.
Kept = list[tuple[Tensor, int, Tensor | None]]
# Per buffer the forward changed: its module, its name, its value before the forward.
Restore = list[tuple[nn.Module, str, Tensor]]


def recompute_guard(partition: nn.Module) -> RecomputeGuard | None:
    """The guard of ``partition``; None when it has no buffer a forward could change."""
    guard = RecomputeGuard(partition)
    return guard if guard.batch_norms or guard.slots else None


class RecomputeGuard:
    """Keeps a partition's recomputations from changing its buffers otherwise than once.

    ``before_forward()`` and ``after_forward(kept)`` go around each checkpointed forward
    and give what its recomputation needs; ``recomputing(restore)`` goes around the
    recomputation and the backward through its graph (what it sets may be saved there).
    """

    def __init__(self, partition: nn.Module) -> None:
        self.batch_norms: list[_BatchNorm] = []
        self.slots: list[tuple[nn.Module, str]] = []
        for module in partition.modules():
            if isinstance(module, DeferredBatchNorm):
                continue  # its recomputation never updates what it tracks
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                self.batch_norms.append(module)
                continue
            self.slots += [(module, name) for name, b in module._buffers.items() if b is not None]
        self._changing: list[bool] | None = None  # per slot; None: not learned yet
        self._warned = False

    def before_forward(self) -> Kept | None:
        """What a checkpointed forward keeps of the buffers before it runs."""
        if not self.slots:
            return None
        changing = self._changing
        kept: Kept = []
        for k, (module, name) in enumerate(self.slots):
            b = module._buffers[name]
            if b is None:  # set to None since: nothing to keep
                continue
            copy = b.clone() if changing is None or changing[k] else None
            kept.append((b, b._version, copy))
        return kept if len(kept) == len(self.slots) else None

    def after_forward(self, kept: Kept | None) -> Restore | None:
        """What the recomputation of the cell that just ran must start from."""
        if kept is None:
            return None
        restore: Restore = []
        changed = []
        for (module, name), (b, version, copy) in zip(self.slots, kept, strict=True):
            now = module._buffers[name]
            if now is b and b._version == version:
                changed.append(False)
                continue
            changed.append(True)
            # Replaced by a new tensor, the old one untouched: it is the value before.
            before = b if b._version == version else copy
            if before is not None:
                restore.append((module, name, before))
            elif not self._warned:
                self._warned = True
                warnings.warn(
                    f"torchgpipe: the buffer {name!r} of a {type(module).__name__} changed "
                    f"in a checkpointed forward for the first time after the partition's "
                    f"first one; this cell's recomputation starts from its new value "
                    f"(later cells are kept right). checkpoint='never' avoids it.",
                    stacklevel=2,
                )
        if self._changing is None:
            self._changing = changed
        else:
            self._changing = [a or b for a, b in zip(self._changing, changed, strict=True)]
        return restore or None

    @contextmanager
    def recomputing(self, restore: Restore | None) -> Iterator[None]:
        """Around a cell's recomputation and its backward: the buffers as they were."""
        frozen: Any = freeze_running_stats(self.batch_norms) if self.batch_norms else nullcontext()
        with frozen:
            if not restore:
                yield
                return
            now = [(module, name, module._buffers[name]) for module, name, _ in restore]
            for module, name, before in restore:
                module._buffers[name] = before
            try:
                yield
            finally:
                for module, name, value in now:
                    module._buffers[name] = value
