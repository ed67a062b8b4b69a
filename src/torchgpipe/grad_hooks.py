"""Parameters' hooks run once per backward, with the backward's whole gradient.

The stages accumulate each micro-batch's share of a parameter's gradient into its
``.grad`` as they go, on their own threads. Left alone, the engine would call the
parameter's hooks (``register_hook``, ``register_post_accumulate_grad_hook``) once per
share: a hook that clips, quantises or adds noise would see a micro-batch's gradient,
not the batch's, and an optimizer stepped from a post-accumulate hook would step ``m``
times. So while the stages run, the ``.grad`` and the hooks of hooked parameters are set
aside (:class:`Aside`); afterwards their gradient goes to the engine once, which calls
the hooks and accumulates as it would for the unwrapped model.

``model(x)`` does it in the backward of the node between the caller's graph and the
stages' (``pipeline.py``); a schedule's step around the whole step (:func:`hooks_once`).
The library's own hooks that only add up what they see (``tied.py`` notes each copy's
share of a tied weight's gradient, marked :data:`SUMS_SHARES`) stay on through a
step: the ties are summed before the user's hooks run, which then see the whole
gradient of the weight, as the unwrapped model's single tensor's hooks do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["SUMS_SHARES", "Aside", "hooked", "hooks_once"]

_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")

SUMS_SHARES = "torchgpipe_sums_shares"
"""The attribute (True) of a library hook that may see a gradient in shares."""

Which = Literal["all", "user", "library"]


def hooked(p: Tensor, which: Which = "all") -> bool:
    """Whether ``p`` has a hook (of ``which`` kind) that the engine calls on its gradient."""
    return any(_kind(hook, which) for d in _dicts(p) for hook in d.values())


@contextmanager
def hooks_once(params: Iterable[Tensor]) -> Iterator[None]:
    """Around a schedule's step: the hooks of ``params`` run once, with the step's gradient.

    A parameter the step gave no gradient has its hooks not called, as in a plain
    backward that does not reach it. If the block raises, every ``.grad`` and hook of
    a hooked parameter is as it was before it.
    """
    watched = [p for p in params if p.requires_grad and p.is_leaf and hooked(p, "user")]
    if not watched:
        yield
        return
    aside = Aside(watched, "user")
    try:
        yield
    except BaseException:
        aside.abandon()
        raise
    reached = [p.grad is not None for p in watched]
    grads = aside.take()
    aside.put_back()
    pairs = [(p, g) for p, g, r in zip(watched, grads, reached, strict=True) if r]
    if not pairs:
        return
    # A leaf as a root: the engine runs its hooks, accumulates, then runs its
    # post-accumulate hooks, as at the end of the unwrapped model's backward. The
    # library's own hooks saw these gradients already, share by share.
    library = [_Silenced(p, "library") for p, _ in pairs]
    try:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
    finally:
        for hooks in library:
            hooks.restore()


class Aside:
    """The ``.grad`` and hooks of parameters, set aside while the stages run their backward.

    The stages' threads then leave in ``.grad`` the gradient of this backward alone, and
    call no hook of these parameters: the caller hands that gradient to the engine, which
    calls the hooks once and accumulates (or captures) it as for the plain model. Torch
    has no public way to silence a tensor's hooks for a while; each kind is kept in a
    dict on the tensor, which the engine reads at each call: those dicts are emptied,
    then refilled. A hooked parameter the stages left no gradient gets zeros from
    :meth:`take`: given None, the engine would call its hooks with None (given zeros,
    it calls them once, with whatever else this backward adds to it).
    """

    def __init__(self, params: list[Tensor], which: Which = "all") -> None:
        self.params = params
        self.grads = [p.grad for p in params]
        self.hooks = [_Silenced(p, which) for p in params]
        for p in params:
            p.grad = None

    def take(self) -> list[Tensor | None]:
        """What the stages left in each ``.grad`` (zeros for hooked ones); the hooks back."""
        new = [p.grad for p in self.params]
        for k, (p, hooks) in enumerate(zip(self.params, self.hooks, strict=True)):
            if new[k] is None and hooks:
                new[k] = torch.zeros_like(p)
            hooks.restore()
        return new

    def put_back(self) -> None:
        """Every ``.grad`` as it was."""
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad

    def abandon(self) -> None:
        """Every ``.grad`` and hook as it was (the stages' backward failed)."""
        self.put_back()
        for hooks in self.hooks:
            hooks.restore()


class _Silenced:
    """A parameter's hooks (of ``which`` kind), out of their dicts until :meth:`restore`.

    Restored, each dict holds its hooks in the order they were registered.
    """

    def __init__(self, p: Tensor, which: Which = "all") -> None:
        self.saved: list[tuple[dict[Any, Any], list[Any]]] = []
        for d in _dicts(p):
            if any(_kind(hook, which) for hook in d.values()):
                self.saved.append((d, list(d.items())))
                for key in [k for k, hook in d.items() if _kind(hook, which)]:
                    del d[key]

    def __bool__(self) -> bool:
        return bool(self.saved)

    def restore(self) -> None:
        saved, self.saved = self.saved, []
        for d, items in saved:
            kept = dict(d)  # registered meanwhile, or never taken out
            d.clear()
            d.update(items)
            d.update(kept)


def _dicts(p: Tensor) -> list[dict[Any, Any]]:
    return [d for d in (getattr(p, name, None) for name in _HOOKS) if d]


def _kind(hook: Any, which: Which) -> bool:
    if which == "all":
        return True
    return bool(getattr(hook, SUMS_SHARES, False)) == (which == "library")
