"""Copies of a tied weight that changed unequally between two forwards, refused.

The copies of a tied weight (``tied.py``) stay equal only if everything that changes
one changes all: one optimizer over all of them, a load of the state dict. The usual
mistake is an optimizer made before the model was wrapped, from the plain model's
``parameters()``: it holds the weight once, so it steps the first copy and never the
others, which drift apart silently, step after step.

Every in-place change bumps a tensor's version counter (``Tensor._version``), and an
optimizer changes each parameter it holds the same way. So between two forwards the
copies of one weight must each have gone up by the same count; where they did not, the
forward that records gradients, or the step, is refused with what to do, unless the
values are equal after all. Comparing counters costs a few integers per copy; the
values are read only where the counts differ. Not checked: a forward under ``no_grad``
(an evaluation may run on another thread while an optimizer steps the copies one after
another); a schedule's step is, whatever the grad mode.
Not seen: a change through ``.data``, or by a fused optimizer (``fused=True``), which
torch does not count, or unequal changes that bump every copy alike (an optimizer
stepping each copy from a hook of its own, with the share of the gradient that copy
has seen so far).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Drift"]


class Drift:
    """The version of each copy of each tied weight, as last seen changing alike."""

    def __init__(self) -> None:
        self._seen: list[list[tuple[Tensor, dict[str, Any], int]]] = []

    def forget(self) -> None:
        """Compare from the next :meth:`check` on (the library changed the copies itself)."""
        self._seen = []

    def check(
        self, groups: Sequence[Sequence[Tensor]], names: Sequence[Sequence[str]], step: bool
    ) -> None:
        """Refuse copies changed unequally since the last check; note their versions.

        ``groups`` holds each tied weight's copies, owner first; ``names``, its names in
        the state dict. ``step``: a schedule's step, which trains under ``no_grad`` too,
        so it is checked whatever the grad mode. A group whose tensors were replaced (a
        meta model filled, a load with ``assign=True``) or swapped
        (``torch.utils.swap_tensors``) is not compared.

        Raises:
            RuntimeError: the copies of a tied weight were changed unequally.
        """
        now = [[(p, vars(p), p._version) for p in group] for group in groups]
        if not step and not torch.is_grad_enabled():  # an evaluation: beside an optimizer?
            self._seen = self._seen or now  # where to compare from (built under no_grad)
            return
        for g, (before, after) in enumerate(zip(self._seen, now, strict=False)):
            # Swapped (torch.utils.swap_tensors, as module.float() may): another __dict__.
            same = len(before) == len(after) and all(
                a[0] is b[0] and a[1] is b[1] for a, b in zip(before, after, strict=True)
            )
            if not same:
                continue
            changes = [b[2] - a[2] for a, b in zip(before, after, strict=True)]
            if len(set(changes)) > 1 and not _equal([p for p, _, _ in after]):
                named = " / ".join(names[g]) if g < len(names) and names[g] else f"group {g}"
                raise RuntimeError(
                    f"torchgpipe: the copies of the tied weight {named} (one per partition "
                    f"that uses it) changed unequally since the last forward (in-place "
                    f"changes per copy, the first partition's first: {changes}), so they no "
                    f"longer hold one weight. Most likely an optimizer holds only some of "
                    f"them: one made before the model was wrapped, from the plain model's "
                    f"parameters(), steps the first copy alone; or the optimizer holds "
                    f"them in groups of different settings (weight decay chosen by module "
                    f"type puts an embedding's copy in one and a head's in another). Make "
                    f"the optimizer from the pipeline's parameters() after wrapping, every "
                    f"copy of a weight in one group, and change a tied weight "
                    f"by hand in every copy (a layer cannot change it in place in its "
                    f"forward either: nn.Embedding(max_norm=...) renormalizes its own "
                    f"copy). To make the copies equal again, load a state dict"
                )
        self._seen = now


def _equal(copies: list[Tensor]) -> bool:
    """Whether the copies hold one value after all (read only where counts differ)."""
    owner = copies[0]
    with torch.no_grad():
        return all(torch.equal(owner, c.to(owner.device)) for c in copies[1:])
