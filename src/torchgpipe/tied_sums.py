"""When the shares of a tied weight's gradient are summed, and when they are dropped.

Each copy of a tied weight notes what a backward adds to it (:class:`Record`, a tensor
hook); the shares are summed when the library knows the backward is over
(``Ties.reduce``): at the end of a schedule's step (``Ties.summing``), and for
``model(x)`` at the end of the engine's backward pass, through the callback that the
outputs' node queues (:class:`ReduceAtEnd`, :class:`PassEnd`).

Shares are forgotten when the pass or step that noted them failed, or at a forward or
step (``Ties.begin``: a backward that reached a copy alone, a regularizer of the weight,
left one that no sum took), but only while no pass or step is under way: a forward of
another thread (an evaluation thread beside the training one) must not drop what a
backward in progress has noted, or its sum would miss them. A failed pass is seen as the
engine drops its callback unrun.

Of passes under way at once (two threads training one model), only the last to end sums
(``Ties.passed``): the others' stages may still be adding to the ``.grad`` it would
write, or have set them aside; the last one sums what all of them noted, and does so
even where it failed itself, if one before it ended well. The sum then holds what the
failed one noted before it failed (the shares are not told apart by pass), where the
plain model's weight, accumulated once after all its uses, gets none of it. A step sums at
its end, under the pipelines' hold, which a pass's stages take too. A pass's sum takes no
hold: at the end of a backward on a GPU, the engine's device thread runs it, and the
thread holding the pipelines may be waiting for that backward. A pass or step that
begins while a sum runs waits for it (``Ties.passing``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgpipe.grad_hooks import SUMS_SHARES, fate

if TYPE_CHECKING:
    from torchgpipe.tied import Ties

__all__ = ["PassEnd", "Record", "ReduceAtEnd", "refuse_ties_named_apart", "tie_groups"]


class Record:
    """A tensor hook: passes the gradient on, and tells the ties about it.

    It only adds up what it is told, so it may see a gradient in shares
    (``grad_hooks.hooks_once``).
    """

    def __init__(self, ties: Ties, key: tuple[int, int]) -> None:
        self.ties, self.key = ties, key

    def __call__(self, grad: Tensor | None) -> None:
        """Note ``grad``, the share of this copy (None: none, from a node that gave none)."""
        if grad is not None:
            self.ties.record(self.key, grad)


setattr(Record, SUMS_SHARES, True)  # it may see a gradient in shares: see its docstring


class PassEnd:
    """The engine's callback at the end of a backward pass through the ties' outputs.

    Run, it sums the shares; dropped unrun (the pass failed), it only says the pass is
    over. Either way once.
    """

    def __init__(self, ties: Ties) -> None:
        self._ties = ties
        self._dropped = weakref.finalize(self, ties.passed, False)

    def __call__(self) -> None:
        """The pass ended well: the last one under way sums the shares."""
        self._dropped.detach()
        self._ties.passed(True)


class ReduceAtEnd(torch.autograd.Function):
    """Identity in forward; in backward, a pass begins: its sum comes at the engine's end."""

    @staticmethod
    def forward(ctx: Any, ties: Ties, *xs: Tensor) -> tuple[Tensor, ...]:
        """The outputs as they are."""
        ctx.ties = ties
        # detach(), not the tensor itself: a custom Function's view of its input could
        # not be modified in place afterwards.
        return tuple(x.detach() for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        """The gradients as they are; the sum queued for the engine's end.

        Raises:
            RuntimeError: the backward names some copies of a tied weight, or asks
                ``torch.autograd.grad`` for one (as the stages' node refuses it).
        """
        if not torch.autograd._is_checkpoint_valid():  # backward(inputs=...), or .grad
            # Captured only: a copy that a checkpointed cell keeps out of its node (it has
            # a hook, Record) is not reached by name, so naming some copies is not seen.
            refuse_ties_named_apart(ctx.ties.groups, partial(_names, ctx.ties), captured=True)
        ctx.ties.passing()
        torch.autograd.Variable._execution_engine.queue_callback(PassEnd(ctx.ties))
        return (None, *grads)


def tie_groups(params: Iterable[Tensor]) -> list[tuple[Tensor, ...]]:
    """The tied weights whose copies are among ``params``: each as its copies, owner first.

    Found through the hooks :class:`Ties` puts on the copies (every copy but the owner).
    """
    groups: dict[tuple[int, int], tuple[Tensor, ...]] = {}
    for p in params:
        for hook in (getattr(p, "_backward_hooks", None) or {}).values():
            if isinstance(hook, Record):
                g = hook.key[0]
                groups[(id(hook.ties), g)] = tuple(hook.ties.own[g])
    return list(groups.values())


def refuse_ties_named_apart(
    groups: Sequence[Sequence[Tensor]],
    names: Callable[[list[Tensor]], str],
    *,
    captured: bool = False,
) -> None:
    """Refuse a backward that names some copies of a tied weight, or captures one.

    Each copy's gradient holds its partition's uses only until the sum at the end of the
    backward, which adds into every copy's ``.grad``. Called where the backward begins:
    nothing has changed yet. ``names`` names the copies for the message; with
    ``captured``, only a capture is refused.

    Raises:
        RuntimeError: a copy named apart from the others of its weight, or captured.
    """
    wrong = []
    for group in groups:
        if not all(p.requires_grad for p in group):  # frozen: no gradient to name
            continue
        fates = {fate(p) for p in group}
        if (len(fates) > 1 and not captured) or "capture" in fates:
            wrong += list(group)
    if wrong:
        raise RuntimeError(
            f"torchgpipe: this backward names some copies of a tied weight "
            f"({names(wrong)}), or asks torch.autograd.grad for one; each partition that "
            f"uses a tied weight holds a copy of it, and the copies' gradients are summed "
            f"into their .grad at the end of the backward. Name every copy (all of "
            f"model.parameters(), say) or none in backward(inputs=...), and read .grad "
            f"rather than calling torch.autograd.grad of a tied weight"
        )


def _names(ties: Ties, params: list[Tensor]) -> str:
    """The names of the weights ``params`` are copies of (``'0.weight = 4.weight'``)."""
    mine = {id(p) for p in params}
    return ", ".join(
        " = ".join(ties.names[g]) or f"tied weight {g}"
        for g, group in enumerate(ties.groups)
        if any(id(p) in mine for p in group)
    )
