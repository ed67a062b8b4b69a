"""Skip trackers: where a stashed tensor waits until it is popped.

A skippable module hands its stashes and pops to the tracker of the calling thread:

- Outside GPipe, each thread has a plain tracker, a dict from skip key to tensor; a
  pop takes the tensor out again, so a plain ``nn.Sequential`` of skippable layers
  holds each skip only between its stash and its pop. A skippable layer that raises
  takes back what it stashed in that call; a forward that stops between a stash and
  its pop for another reason (a later layer raises, or a slice of the model such as
  ``model[:2](x)`` runs) leaves the stash there until the same name is stashed again.
- Inside GPipe, each cell runs under a :class:`CellTracker`. Skips popped in the same
  partition stay in it; skips for later partitions are collected as outbound, and
  skips stashed by earlier partitions arrive as inbound. The cell returns the outbound
  ones alongside its output, so that checkpointing sees them as outputs (gradients
  reach the stashing layer) and inbound ones as inputs (recomputation pops the very
  tensors the forward popped, and stashes nothing anywhere but in its own return
  value).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor

from torchgpipe.checkpoint import differentiable, will_recompute
from torchgpipe.microbatch import flatten
from torchgpipe.skip.errors import SkipError

if TYPE_CHECKING:
    from torchgpipe.skip.skippable import SkipKey

__all__ = ["CellTracker", "SkipTracker", "current_tracker", "run_cell", "use_tracker"]


class SkipTracker:
    """Holds stashed tensors until they are popped."""

    def __init__(self) -> None:
        self.waiting: dict[SkipKey, Tensor | None] = {}

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Keep ``tensor`` until ``key`` is popped."""
        self.waiting[key] = tensor

    def take_back(self, key: SkipKey) -> None:
        """Forget ``key``'s stash, if it is still waiting (its layer failed)."""
        self.waiting.pop(key, None)

    def give_back(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Let ``key`` be popped again: a base's forward that popped it failed."""
        self.waiting[key] = tensor

    def pop(self, key: SkipKey) -> Tensor | None:
        """Take the tensor stashed as ``key`` out.

        Raises:
            SkipError: nothing was stashed as ``key`` (yet).
        """
        if key not in self.waiting:
            raise SkipError(
                f"skip {key} was popped before any layer stashed it; a layer that "
                f"stashes {key} must run first (verify_skippables(model) checks a "
                f"Sequential)"
            )
        return self.waiting.pop(key)


class CellTracker(SkipTracker):
    """The tracker of one GPipe cell: inbound skips in, outbound skips collected.

    An inbound skip changed in place before its pop, through the partition's input that
    shares its memory (``ReLU(inplace=True)`` right after the cut), is refused at the
    pop where that loses something: the skip wants a gradient (the pop would get the
    new values without the gradient through the change), or the cell is
    checkpointed and may be recomputed (its recomputation gets the skip and the input
    apart, and would pop the values from before the change). Changes between the
    stash and this partition are checked before it runs (``cell.SkipVersions``).

    Args:
        inbound: the skips earlier partitions stashed for this one.
        outbound: the keys this partition stashes for later partitions.
        value: the partition's input. A skip that is one of its tensors, or a view of
            the same tensor, is changed where autograd sees it, as in the plain model:
            not judged.
    """

    def __init__(
        self,
        inbound: dict[SkipKey, Tensor | None],
        outbound: frozenset[SkipKey],
        value: Any = None,
    ):
        super().__init__()
        self.waiting.update(inbound)
        self._outbound = outbound
        self.out: dict[SkipKey, Tensor | None] = {}
        roots = {id(_root(x)) for x in flatten(value)[0] if isinstance(x, Tensor)}
        self._noted = {key: _noted(skip, roots) for key, skip in inbound.items()}

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Collect ``tensor`` as outbound, or keep it for a pop in this partition."""
        if key in self._outbound:
            self.out[key] = tensor
        else:
            super().stash(key, tensor)

    def take_back(self, key: SkipKey) -> None:
        """Nothing to do: a cell's tracker is dropped with the failed cell."""

    def give_back(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Let ``key`` be popped again, judged from now on.

        What the failed call did to the skip it popped, the plain model's does too.
        """
        super().give_back(key, tensor)
        if key in self._noted:
            self._noted[key] = [(x, x._version) for x, _ in self._noted[key]]

    def pop(self, key: SkipKey) -> Tensor | None:
        """Take the tensor stashed as ``key`` out, unless it changed in place here first.

        Raises:
            SkipError: nothing was stashed as ``key`` (yet).
            RuntimeError: a layer of this partition changed the inbound skip in place
                before its pop, losing a gradient or the recomputation's values.
        """
        skip = super().pop(key)
        # Kept after the pop: a skip given back (a failed base's forward) is popped again.
        for x, version in self._noted.get(key, ()):  # none: stashed in this partition
            if x._version != version and self._loses(x):
                raise RuntimeError(
                    f"torchgpipe: the skip {key} was changed in place before its pop, by "
                    f"a layer of the popping partition working on its input, which shares "
                    f"memory with the skip (ReLU(inplace=True) right after the partition "
                    f"boundary, say); the pop would get the new values but not the "
                    f"gradient through that change (and a checkpointed cell's "
                    f"recomputation the values from before it). Make that layer work out "
                    f"of place, or stash a copy (stash({key.name!r}, x.clone()), which then "
                    f"pops the values from before the change)"
                )
        return skip

    @staticmethod
    def _loses(x: Tensor) -> bool:
        """Whether popping ``x``, changed in place through an input, loses anything.

        Not judged: a skip that wants no gradient, changed by an operation with one
        that does (``x.mul_(w)``, ``w`` trained): the plain model's pop may get that
        gradient (the stashing layer's output and the skip one tensor) or not (a
        detached skip), which the popping partition cannot tell apart.
        """
        return x.requires_grad or will_recompute()


_local = threading.local()


def current_tracker() -> SkipTracker:
    """The tracker of the calling thread: a cell's inside GPipe, else the thread's own."""
    tracker: SkipTracker | None = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Make ``tracker`` the calling thread's tracker within the block."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous


def run_cell(
    function: Callable[[Any], Any], outbound: tuple[SkipKey, ...], packed: Any
) -> tuple[Any, dict[SkipKey, Tensor | None]]:
    """Run a partition on ``(value, inbound)``; return ``(output, outbound skips)``.

    Raises:
        SkipError: an inbound skip was not popped, or an outbound one not stashed
            (the layout and the layers disagree).
    """
    value, inbound = packed
    tracker = CellTracker(inbound, frozenset(outbound), value)
    with use_tracker(tracker):
        output = function(value)
    missing = [str(key) for key in outbound if key not in tracker.out]
    left = [str(key) for key in inbound if key in tracker.waiting]
    if missing or left:
        raise SkipError(
            f"GPipe routes skips {missing} out of this partition and {left} into it, but "
            f"its layers did not stash or pop them under those names: a skippable module "
            f"that declares them was not called (a module holding it that does not call "
            f"it in its forward: give its skips to a module that runs), or a layer's skip "
            f"names and namespaces changed after GPipe was built (isolate() before "
            f"wrapping the model)"
        )
    return output, {key: tracker.out[key] for key in outbound}


def _root(x: Tensor) -> Tensor:
    """The tensor ``x`` is a view of, or ``x``: autograd follows changes across them."""
    return x if x._base is None else x._base


def _noted(skip: Any, roots: AbstractSet[int]) -> list[tuple[Tensor, int]]:
    """``skip``'s float and complex tensors with their versions now, to compare later.

    Not noted: one whose root (:func:`_root`) is in ``roots``, that of an input tensor,
    and inference tensors, which keep no version.
    """
    return [
        (x, x._version)
        for x in flatten(skip)[0]
        if isinstance(x, Tensor)
        and differentiable(x)
        and not x.is_inference()
        and id(_root(x)) not in roots
    ]
