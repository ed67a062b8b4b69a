"""What keeps a recomputation from computing otherwise than its forward did.

A checkpointed cell runs its layers twice: in the forward, and again in backward. The
plain model runs them once, so whatever the layers change besides their output (their
buffers) must come out as after one run, and the recomputation must compute from the
state the forward computed from:

- The parameters: those the forward used. Under ``torch.func.functional_call`` the
  forward used the tensors it was given, which are gone from the modules by the time
  of backward: the recomputation puts them back (so their gradients are theirs).
- Any buffer that a layer changes in its forward (batch norm's running statistics,
  spectral norm's power iteration, a step counter) is set, for the recomputation, to a
  copy of the value the cell's forward started from, and then back to the value the
  later forwards left: the recomputed weight is the forward's, what a layer reads of
  the statistics in training is what its forward read (a batch renormalization, the
  fused convolution and batch norm of quantization-aware training), and the buffer
  ends as in the plain model.
- The modules' training flags: those of the run's forward. A model switched to
  ``eval()`` between the forward and the backward (a validation pass in between)
  recomputes in training mode, as the plain model's saved graph was made, and is back
  in ``eval()`` after each recomputation.
- Deferred batch norm's running statistics change once per step, in the last
  micro-batch's deferred forward, so every cell's forward started from their values
  before the step: each recomputation gets copies of those, kept when the run first
  used the partition (the deferred forward leaves them alone in a recomputation; a
  subclass's forward may change them besides, as batchnorm.py allows, and changes the
  copies). A subclass that reads them after its deferred forward, in the last
  micro-batch, read the step's update there but reads the values before in its
  recomputation.

Which buffers a forward changes (in place, or by assigning a new tensor) is learned at
the partition's first checkpointed forward, which keeps a copy of each before it runs
and compares values after (a fused kernel may change one with no new version);
later forwards keep a copy only of those seen changing, and of batch norm's running
statistics in training, which torch's kernels update without a new version. A buffer
first seen changing
later (a layer that changes it only now and then) is learned then, with a warning: that
one cell's recomputation starts from the changed value.

A :class:`RecomputeGuard` lives as long as its partition and keeps only what it learned;
what one run needs (:class:`RunGuard`, made at the run's first use of the partition,
from the modules as they are then) lives with the run and its cells.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.tied_given import is_moved

__all__ = ["RecomputeGuard", "Restore", "RunGuard", "RunGuards"]

# What deferred batch norm tracks: kept once per run, not as other buffers (its forward
# updates them at the last micro-batch only, so a checkpointed last cell would seem to
# change them for the first time, and warn).
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")

# Per buffer: the tensor before the forward, its version then, a copy where needed, and
# whether it was lazy (no value yet: its forward gives it one).
Kept = list[tuple[Tensor, int, Tensor | None, bool]]
# What one cell's recomputation starts from: per buffer its forward changed, the module,
# the name, the value before.
Restore = list[tuple[nn.Module, str, Tensor]]
# Tensors to put in a module's slots (its _buffers or _parameters) for a recomputation.
Swaps = list[tuple[dict[str, Any], str, Tensor]]


def _held(slots: Any, name: str) -> Any:
    """``slots[name]``, None where absent (a TorchScript module's slots have no ``get``)."""
    if type(slots) is dict:
        return slots.get(name)
    return slots[name] if name in slots else None  # noqa: SIM401  # it has no get


class RecomputeGuard:
    """What a partition's recomputations have learned: the buffers its forwards change."""

    def __init__(self, partition: nn.Module) -> None:
        self.partition = partition
        self.changing: set[tuple[int, str]] | None = None  # (module id, name); None: unknown
        self.warned = False

    def for_run(self) -> RunGuard:
        """What one run needs, from the partition's modules as they are now."""
        return RunGuard(self)


class RunGuard:
    """One run's guard of a partition.

    ``before_forward()`` and ``after_forward(kept)`` go around each checkpointed forward
    and give what its recomputation needs; ``recomputing(restore)`` goes around the
    recomputation and the backward through its graph (what it sets may be saved there).
    """

    def __init__(self, guard: RecomputeGuard) -> None:
        self.guard = guard
        self.before_step: Restore = []  # deferred batch norm's statistics
        # Per buffer: its module, its name, and whether torch's batch norm updates it in
        # training without counting a version (the running statistics).
        self.buffers: list[tuple[nn.Module, str, bool]] = []
        self.parameters: list[tuple[nn.Module, str]] = []
        self.modes: list[tuple[nn.Module, bool]] = []  # each module's training flag
        for module in guard.partition.modules():
            self.modes.append((module, module.training))
            self.parameters += [(module, n) for n, p in module._parameters.items() if p is not None]
            stats = isinstance(module, _BatchNorm) and module.track_running_stats
            deferred = stats and isinstance(module, DeferredBatchNorm)
            if deferred:
                self.before_step += [
                    (module, n, b.clone())
                    for n in _RUNNING_STATS
                    if (b := _held(module._buffers, n)) is not None
                ]
            self.buffers += [
                (module, n, stats and n in _RUNNING_STATS)
                for n, b in module._buffers.items()
                if b is not None and not (deferred and n in _RUNNING_STATS)
            ]
        self.used: list[Tensor | None] | None = None  # the parameters the forwards used
        self.swaps: Swaps | None = None  # those the modules no longer hold, once checked

    def before_forward(self) -> Kept | None:
        """What a checkpointed forward keeps of the buffers before it runs."""
        if self.used is None:
            self.used = [_held(module._parameters, name) for module, name in self.parameters]
        if not self.buffers:
            return None
        changing = self.guard.changing
        kept: Kept = []
        for module, name, uncounted in self.buffers:
            b = _held(module._buffers, name)
            if b is None:  # removed or set to None since the run began: nothing to keep
                return None
            known = changing is None or (id(module), name) in changing
            lazy = is_lazy(b)
            if lazy and not uncounted:
                raise ValueError(
                    f"torchgpipe: the buffer {name!r} of a {type(module).__name__} has no "
                    f"value yet (a lazy module) in a checkpointed partition, whose "
                    f"recomputation needs the value the forward started from; initialize "
                    f"the lazy modules first (one forward of the plain model, or of the "
                    f"GPipe under checkpoint='never'), or use checkpoint='never'"
                )
            wanted = (known or (uncounted and module.training)) and not lazy
            kept.append((b, b._version, b.clone() if wanted else None, lazy))
        return kept

    def after_forward(self, kept: Kept | None) -> Restore | None:
        """What the recomputation of the cell that just ran must start from; None: as is."""
        if kept is None:
            return None
        restore: Restore = []
        guard, changed = self.guard, set()
        learning = guard.changing is None
        for (module, name, uncounted), (b, version, copy, lazy) in zip(
            self.buffers, kept, strict=True
        ):
            now = _held(module._buffers, name)
            updated = uncounted and module.training  # with no version to show for it
            same = now is b and b._version == version
            if same and not updated and learning and copy is not None:
                # Once, at the first checkpointed forward: a fused kernel may change a
                # buffer in place with no new version (fake quantization's observer).
                updated = not _equal(copy, b)
            if same and not updated and (id(module), name) not in (guard.changing or ()):
                continue
            changed.add((id(module), name))
            # Replaced by a new tensor, the old one untouched: it is the value before.
            before = b if now is not b and b._version == version and not updated else copy
            if lazy:  # torch's lazy batch norm: from the reset statistics
                before = None if now is None else _reset_value(name, now)
            if before is not None:
                restore.append((module, name, before))
            elif not guard.warned:
                guard.warned = True
                warnings.warn(
                    f"torchgpipe: the buffer {name!r} of a {type(module).__name__} changed "
                    f"in a checkpointed forward for the first time after the partition's "
                    f"first one; this cell's recomputation starts from its new value "
                    f"(later cells are kept right). checkpoint='never' avoids it.",
                    stacklevel=2,
                )
        guard.changing = changed if guard.changing is None else guard.changing | changed
        return restore or None

    def recomputing(self, restore: Restore | None) -> AbstractContextManager[None]:
        """Around a cell's recomputation and its backward: the state its forward saw.

        Raises:
            RuntimeError: the forward used parameters that a recomputation cannot use
                again (``functional_call`` given tensors computed from others).
        """
        if self.swaps is None:
            self.swaps = self._parameters_used()
        restore = [*restore, *self.before_step] if restore else self.before_step
        # A copy each time: a second backward (retain_graph) starts from it again.
        swaps: Swaps = [(m._buffers, name, b.clone()) for m, name, b in restore]
        if self.swaps:
            swaps += self.swaps
        flips = [(module, mode) for module, mode in self.modes if module.training != mode]
        if not swaps and not flips:  # the common case, once per recomputed cell
            return nullcontext()
        return self._swapped(swaps, flips)

    @contextmanager
    def _swapped(self, swaps: Swaps, flips: list[tuple[nn.Module, bool]]) -> Iterator[None]:
        now = [(slots, name, _held(slots, name)) for slots, name, _ in swaps]
        for slots, name, before in swaps:
            slots[name] = before
        for module, mode in flips:
            module.training = mode
        try:
            yield
        finally:
            for slots, name, value in now:
                slots[name] = value
            for module, mode in flips:
                module.training = not mode

    def _parameters_used(self) -> Swaps:
        """The parameters the forwards used where the modules now hold others."""
        if self.used is None:
            return []
        swaps: Swaps = []
        for (module, name), p in zip(self.parameters, self.used, strict=True):
            if p is None or _held(module._parameters, name) is p:
                continue
            if p.grad_fn is not None and not is_moved(p):  # a tied weight given: fine
                raise RuntimeError(
                    f"torchgpipe: the forward used a parameter {name!r} of a "
                    f"{type(module).__name__} computed from other tensors (given to "
                    f"torch.func.functional_call, say), which a checkpointed cell's "
                    f"recomputation cannot use again; use checkpoint='never', or give "
                    f"leaf tensors"
                )
            swaps.append((module._parameters, name, p))  # functional_call's, now gone
        return swaps


class RunGuards:
    """The guards of one run, per stage: each made at the run's first use of its stage."""

    def __init__(self, guards: Mapping[int, RecomputeGuard | None]) -> None:
        self._guards = guards
        self._made: dict[int, RunGuard] = {}

    def __getitem__(self, s: int) -> RunGuard | None:
        made = self._made.get(s)
        if made is None:
            guard = self._guards.get(s)
            if guard is None:
                return None
            made = self._made[s] = guard.for_run()
        return made


def _equal(before: Tensor, now: Tensor) -> bool:
    """Whether ``now`` holds the values of ``before`` (True where torch cannot say)."""
    try:
        if before.shape != now.shape:
            return False
        if torch.equal(before, now):
            return True
        # NaN equals nothing: a buffer holding one, only read, is not changing.
        floating = before.is_floating_point() or before.is_complex()
        return floating and bool(torch.allclose(before, now, rtol=0, atol=0, equal_nan=True))
    except (RuntimeError, NotImplementedError):  # a layout torch.equal does not take
        return True


def _reset_value(name: str, now: Tensor) -> Tensor:
    """What batch norm's ``reset_running_stats`` gives the statistic ``name``."""
    return torch.ones_like(now) if name == "running_var" else torch.zeros_like(now)
