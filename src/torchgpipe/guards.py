"""What keeps a recomputation from computing otherwise than its forward did.

A checkpointed cell runs its layers twice: in the forward, and again in backward. The
plain model runs them once, so whatever the layers change besides their output (their
buffers) must come out as after one run, and the recomputation must compute from the
state the forward computed from:

- The parameters: those the forward used. Under ``torch.func.functional_call`` the
  forward used the tensors it was given, which are gone from the modules by the time
  of backward: the recomputation uses them again (so their gradients are theirs). A
  parameter changed in place since the forward (an ``optimizer.step()`` before the
  backward) is refused, as autograd refuses it in the plain model.

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

import itertools
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.batchnorm import DeferredBatchNorm, freeze_running_stats

__all__ = ["Kept", "RecomputeGuard", "Restore", "recompute_guard", "run_token"]

_RUNS = itertools.count()


def run_token() -> int:
    """A number for a run of the stages that no other run of this process has."""
    return next(_RUNS)


# Per buffer: the tensor before the forward, its version then, and a copy where needed.
Kept = list[tuple[Tensor, int, Tensor | None]]
# Tensors to put in a module's slots (its _buffers or _parameters) for a recomputation.
Swaps = list[tuple[dict[str, Any], str, Tensor]]


class Used:
    """The parameters a run's forward used, shared by its cells of one partition.

    Checked once, at the run's first recomputation on the partition (the user's code
    cannot run between two recomputations of one backward).
    """

    __slots__ = ("swaps", "tensors")

    def __init__(self, tensors: list[tuple[Tensor, int]]) -> None:
        self.tensors = tensors  # per parameter slot: the tensor, its version
        self.swaps: Swaps | None = None  # what the check found: put back for each cell


class Restore:
    """What a cell's recomputation starts from: the forward's parameters and buffers."""

    __slots__ = ("buffers", "parameters")

    def __init__(self, parameters: Used) -> None:
        self.parameters = parameters
        # Per buffer the forward changed: its module, its name, its value before.
        self.buffers: list[tuple[nn.Module, str, Tensor]] = []


def recompute_guard(partition: nn.Module) -> RecomputeGuard | None:
    """The guard of ``partition``; None when it has neither parameters nor buffers."""
    guard = RecomputeGuard(partition)
    return guard if guard.batch_norms or guard.slots or guard.parameters else None


class RecomputeGuard:
    """Keeps a partition's recomputations from changing its buffers otherwise than once.

    ``before_forward()`` and ``after_forward(kept)`` go around each checkpointed forward
    and give what its recomputation needs; ``recomputing(restore)`` goes around the
    recomputation and the backward through its graph (what it sets may be saved there).
    """

    def __init__(self, partition: nn.Module) -> None:
        self.batch_norms: list[_BatchNorm] = []
        self.slots: list[tuple[nn.Module, str]] = []
        self.parameters = [
            (module, name)
            for module in partition.modules()
            for name, p in module._parameters.items()
            if p is not None
        ]
        for module in partition.modules():
            if isinstance(module, DeferredBatchNorm):
                continue  # its recomputation never updates what it tracks
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                self.batch_norms.append(module)
                continue
            self.slots += [(module, name) for name, b in module._buffers.items() if b is not None]
        self._changing: list[bool] | None = None  # per slot; None: not learned yet
        self._warned = False
        self._used: tuple[int, Used] | None = None  # the last run's (its token, Used)

    def used_in(self, token: int) -> Used:
        """The parameters of the run ``token`` (a number no other run has), recorded once."""
        if self._used is None or self._used[0] != token:
            tensors = [(p, p._version) for p in self._parameters_now() if p is not None]
            self._used = (token, Used(tensors))
        return self._used[1]

    def _parameters_now(self) -> list[Tensor | None]:
        return [module._parameters[name] for module, name in self.parameters]

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

    def after_forward(self, kept: Kept | None, used: Used) -> Restore:
        """What the recomputation of the cell that just ran must start from."""
        restore = Restore(used)
        if kept is None:
            return restore
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
                restore.buffers.append((module, name, before))
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
        return restore

    def recomputing(self, restore: Restore | None) -> AbstractContextManager[None]:
        """Around a cell's recomputation and its backward: the state its forward saw.

        Raises:
            RuntimeError: a parameter the forward used was changed in place since.
        """
        swaps: Swaps = []
        if restore is not None:
            used = restore.parameters
            if used.swaps is None:
                used.swaps = self._parameters_used(used.tensors)
            if restore.buffers:
                swaps = [(m._buffers, name, before) for m, name, before in restore.buffers]
            swaps = swaps + used.swaps if used.swaps else swaps
        if not swaps and not self.batch_norms:  # the common case, once per recomputed cell
            return nullcontext()
        return self._swapped(swaps)

    @contextmanager
    def _swapped(self, swaps: Swaps) -> Iterator[None]:
        frozen: Any = freeze_running_stats(self.batch_norms) if self.batch_norms else nullcontext()
        with frozen:
            now = [(slots, name, slots[name]) for slots, name, _ in swaps]
            for slots, name, before in swaps:
                slots[name] = before
            try:
                yield
            finally:
                for slots, name, value in now:
                    slots[name] = value

    def _parameters_used(self, used: list[tuple[Tensor, int]]) -> Swaps:
        """The parameters the forward used where the modules now hold others.

        Raises:
            RuntimeError: a parameter the forward used was changed in place since.
        """
        if len(used) != len(self.parameters):
            return []  # parameters set to None, or added, since: nothing to compare
        swaps = []
        for (module, name), (p, version) in zip(self.parameters, used, strict=True):
            if p._version != version:
                raise RuntimeError(
                    f"torchgpipe: the parameter {name!r} of a {type(module).__name__} was "
                    f"changed in place after the forward that used it (version {version}, "
                    f"now {p._version}), and its checkpointed cell would recompute with the "
                    f"new value; call optimizer.step() after backward, not between "
                    f"forward and backward"
                )
            if module._parameters[name] is not p:  # functional_call's, now gone
                swaps.append((module._parameters, name, p))
        return swaps
