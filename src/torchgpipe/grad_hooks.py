"""Parameters' hooks run once per backward, with the backward's whole gradient.

The stages accumulate each micro-batch's share of a parameter's gradient into its
``.grad`` as they go, on their own threads. Left alone, the engine would call the
parameter's hooks (``register_hook``, ``register_post_accumulate_grad_hook``) once per
share: a hook that clips, quantises or adds noise would see a micro-batch's gradient,
not the batch's, and an optimizer stepped from a post-accumulate hook would step ``m``
times. So while the stages run, the ``.grad`` and the hooks of hooked parameters are set
aside (:class:`Aside`); afterwards their hooks run once on the whole gradient, which is
then accumulated, as the unwrapped model's backward would.

``model(x)`` does it in the backward of the node between the caller's graph and the
stages' (``pipeline.py``), handing the gradient to the engine; a schedule's step around
the whole step (:func:`hooks_once`), calling the hooks in the engine's order itself.
The library's own hooks that only add up what they see (``tied_sums.py`` notes each
copy's share of a tied weight's gradient, marked :data:`SUMS_SHARES`) stay on through a
step, and through ``model(x)``'s node where the copy has no hook of the user's (a GPipe
nested in a partition sums its ties within the partition's backward): the ties are
summed before the user's hooks run, which then see the whole
gradient of the weight, as the unwrapped model's single tensor's hooks do; each copy
runs its own hooks, and the copies must come out equal (a hook on every copy, or on
none).

The engine takes in what ``model(x)``'s node hands it for a parameter only after the
node returns (at once, or later in the backward where another node adds to it): until
then the pipeline stays held (``Workers.exclusive``), and :func:`when_taken` says when
it has, so that another thread's backward does not silence the hooks or set the
``.grad`` aside meanwhile.

Not covered, so run once per micro-batch: hooks on a parameter's gradient-accumulation
node (``p.view_as(p).grad_fn.next_functions[0][0].register_hook``, as Horovod registers
them), hooks on the parameters of a schedule's ``loss_fn``, and hooks registered on a
parameter during a step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

__all__ = [
    "SUMS_SHARES",
    "Aside",
    "Fate",
    "dense",
    "fate",
    "hooked",
    "hooks_once",
    "summed",
    "when_taken",
]

_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")

SUMS_SHARES = "torchgpipe_sums_shares"
"""The attribute (True) of a library hook that may see a gradient in shares."""

Fate = Literal["accumulate", "capture", "drop"]
"""What the engine's backward under way does with a gradient for a parameter."""


def fate(p: Tensor) -> Fate:
    """What the engine's backward under way does with a gradient for parameter ``p``."""
    node = get_gradient_edge(p).node
    try:
        return "accumulate" if torch._C._will_engine_execute_node(node) else "drop"
    except RuntimeError:  # torch refuses to tell of a leaf that autograd.grad captures
        return "capture"


def hooked(p: Tensor, users_only: bool = False) -> bool:
    """Whether ``p`` has a hook (the user's, with ``users_only``) the engine calls on it."""
    return any(_counts(hook, users_only) for d in _dicts(p) for hook in d.values())


@contextmanager
def hooks_once(params: Iterable[Tensor], ties: Sequence[Sequence[Tensor]] = ()) -> Iterator[None]:
    """Around a schedule's step: the hooks of ``params`` run once, with the step's gradient.

    ``ties`` holds the groups of copies of tied weights (``Ties.groups``), which the
    block sums before it ends: each copy then holds the weight's whole gradient, runs
    its own hooks on it, and must come out with what the others came out with (the
    copies are one weight: register a hook on every copy, as a loop over
    ``parameters()`` does, or on none). A parameter the step gave no gradient has its
    hooks not called, as in a plain backward that does not reach it. If the block
    raises, every ``.grad`` and hook of a hooked parameter is as it was before it.

    Across processes each process compares the copies it holds only: register a tied
    weight's hooks alike in every process that holds a copy.

    Raises:
        RuntimeError: a hook returned a gradient of another shape, dtype, device or
            layout, or the copies of a tied weight came out of their hooks different;
            the hooked parameters' ``.grad`` are then as before the step (the others
            keep what the step added).
    """
    groups: list[list[Tensor]] = []
    seen: set[int] = set()
    tied = {id(p): list(group) for group in ties for p in group}
    for p in params:
        if id(p) in seen or not (p.requires_grad and p.is_leaf):
            continue
        group = tied.get(id(p), [p])
        seen.update(map(id, group))
        if any(hooked(q, users_only=True) for q in group):
            groups.append([q for q in group if q.requires_grad and q.is_leaf])
    if not groups:
        yield
        return
    aside = Aside([p for group in groups for p in group], users_only=True)
    try:
        yield
    except BaseException:
        aside.abandon()
        raise
    new = [p.grad for p in aside.params]
    aside.restore_hooks()
    aside.put_back()
    # The engine's order for a leaf, by hand (the engine would run the library's own
    # hooks again, which saw these gradients share by share): the tensor hooks, each
    # given what the one before returned; the gradient accumulated; the
    # post-accumulate hooks. Every hook's result is checked before any .grad changes.
    with torch.no_grad():
        results = {id(p): _hooked_grad(p, grad) for p, grad in zip(aside.params, new, strict=True)}
        for group in groups:
            _check_copies(group, [results[id(p)] for p in group])
        for p in aside.params:
            grad = results[id(p)]
            if grad is None:
                continue
            if p.grad is None:  # a copy like p: a hook may have kept the tensor it was
                p.grad = _like(p, grad)  # given, which the engine then copies too
            else:
                p.grad = summed(p.grad, grad)
        for p in aside.params:
            if results[id(p)] is not None:
                for hook in list((p._post_accumulate_grad_hooks or {}).values()):
                    if _counts(hook, False):
                        hook(p)


def when_taken(handed: Sequence[tuple[Tensor, Fate]], done: Callable[[], None]) -> None:
    """Call ``done`` once the engine has taken in the gradients handed for some parameters.

    ``handed`` holds the parameters a node's backward (on this thread, now) gives a
    gradient, each with what the engine does with it. Taken in: accumulated, once its
    post-accumulate hooks ran, or captured (``torch.autograd.grad``), once its hooks
    ran; or the engine's backward ended, well or not. ``done`` is called once, on the
    thread that gets there first (the backward's, or the one that drops it).
    """
    handed = [(p, fate) for p, fate in handed if fate != "drop"]
    if not handed:
        done()
        return
    watch = _Watch(handed, done)
    # Run at the end of the backward; dropped unrun where the backward fails.
    torch.autograd.Variable._execution_engine.queue_callback(_AtEnd(watch.finish))


class _Watch:
    """The parameters whose handed gradient the engine has still to take in."""

    def __init__(self, handed: Sequence[tuple[Tensor, Fate]], done: Callable[[], None]) -> None:
        self._thread = threading.get_ident()  # where the engine runs a CPU backward
        self._done: Callable[[], None] | None = done
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        for k, (p, fate) in enumerate(handed):
            hook = _Taken(self, k)
            if fate == "accumulate":
                self._handles[k] = p.register_post_accumulate_grad_hook(hook)
            else:  # captured: after the hooks before it
                self._handles[k] = p.register_hook(hook)

    def taken(self, k: int) -> None:
        """Parameter ``k``'s gradient is in (on a stage's thread: a share, not this one)."""
        if threading.get_ident() != self._thread:
            return
        with self._lock:
            handle = self._handles.pop(k, None)
            left = bool(self._handles)
        if handle is not None:
            handle.remove()
            if not left:
                self.finish()

    def finish(self) -> None:
        """Every hook of this watch off, and ``done`` called (once)."""
        with self._lock:
            done, self._done = self._done, None
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.remove()
        if done is not None:
            done()


class _Taken:
    """The library's hook that tells a :class:`_Watch` its parameter's gradient is in."""

    def __init__(self, watch: _Watch, k: int) -> None:
        self.watch, self.k = watch, k

    def __call__(self, *args: Any) -> None:
        self.watch.taken(self.k)


class _AtEnd:
    """An engine callback that calls ``fn`` when run, and when dropped unrun."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        weakref.finalize(self, fn)

    def __call__(self) -> None:
        self.fn()


def _hooked_grad(p: Tensor, grad: Tensor | None) -> Tensor | None:
    """``grad`` through the user's tensor hooks of ``p``, in order; None stays None."""
    if grad is None:
        return None
    for hook in [h for h in (p._backward_hooks or {}).values() if _counts(h, True)]:
        changed = hook(grad)
        if changed is None:
            continue
        for what in ("shape", "dtype", "device", "layout"):
            if getattr(changed, what) != getattr(grad, what):
                raise RuntimeError(
                    f"torchgpipe: a hook of a parameter of shape {list(p.shape)} changed "
                    f"the {what} of its gradient ({getattr(grad, what)} to "
                    f"{getattr(changed, what)}); a hook must return a gradient like the "
                    f"one it was given, or None. The hooked parameters kept no gradient "
                    f"of this step"
                )
        grad = changed
    return grad


def _check_copies(group: list[Tensor], grads: list[Tensor | None]) -> None:
    """Refuse copies of a tied weight that came out of their hooks different."""
    present = [g for g in grads if g is not None]
    if len(present) < 2:
        return
    first = dense(present[0])
    # NaN and inf compare equal to themselves: an overflow is the optimizer's to see
    # (a GradScaler skips the step), not a sign of a hook on some copies only.
    if all(
        torch.allclose(dense(g).to(first.device), first, rtol=0, atol=0, equal_nan=True)
        for g in present[1:]
    ):
        return
    raise RuntimeError(
        f"torchgpipe: the {len(group)} copies of a tied weight of shape "
        f"{list(group[0].shape)} came out of their hooks with different gradients: a "
        f"hook is on some of the copies only (or draws at random). The copies are one "
        f"weight: register the hook on every copy (as a loop over model.parameters() "
        f"does) or on none. The hooked parameters kept no gradient of this step"
    )


def dense(grad: Tensor) -> Tensor:
    """``grad`` as a strided tensor."""
    return grad.to_dense() if grad.is_sparse else grad


def summed(total: Tensor | None, part: Tensor) -> Tensor:
    """``total + part``, into ``total`` where it can; sparse where both are, as autograd adds.

    A sparse embedding's gradient and a dense head's add up to a dense one.
    """
    if total is None:
        return part
    if total.is_sparse and not part.is_sparse:
        return part + total
    return total.add_(part)


def _like(p: Tensor, grad: Tensor) -> Tensor:
    """A copy of ``grad`` laid out as ``p`` is, as the engine gives a first ``.grad``."""
    if grad.is_sparse:
        return grad.clone()
    # preserve_format keeps p's strides where p is dense and does not overlap itself.
    return torch.empty_like(p, dtype=grad.dtype, device=grad.device).copy_(grad)


class Aside:
    """The ``.grad`` and hooks of parameters, set aside while the stages run their backward.

    The stages' threads then leave in ``.grad`` the gradient of this backward alone, and
    call no hook of these parameters. Then ``model(x)``'s node hands that gradient to
    the engine, which calls the hooks once and accumulates (or captures) it as for the
    plain model (:meth:`take`); a schedule's step calls the hooks itself
    (:func:`hooks_once`). Torch has no public way to silence a tensor's hooks for a
    while; each kind is kept in a dict on the tensor, which the engine reads at each
    call: each hook there is swapped for one that does nothing, then put back. A hooked
    parameter the stages left no gradient gets zeros from :meth:`take`: given None, the
    engine would call its hooks with None (given zeros, it calls them once, with
    whatever else this backward adds to it).
    """

    def __init__(self, params: list[Tensor], users_only: bool = False) -> None:
        self.params = params
        self.grads = [p.grad for p in params]
        self.hooks = [_Silenced(p, users_only) for p in params]
        for p in params:
            p.grad = None

    def take(self) -> list[Tensor | None]:
        """What the stages left in each ``.grad`` (zeros for hooked ones); the hooks back."""
        new = [p.grad for p in self.params]
        for k, (p, hooks) in enumerate(zip(self.params, self.hooks, strict=True)):
            if new[k] is None and hooks:
                new[k] = torch.zeros_like(p)
        self.restore_hooks()
        return new

    def restore_hooks(self) -> None:
        """Every silenced hook back (those whose handle was removed meanwhile stay out)."""
        for hooks in self.hooks:
            hooks.restore()

    def put_back(self) -> None:
        """Every ``.grad`` as it was."""
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad

    def abandon(self) -> None:
        """Every ``.grad`` and hook as it was (the stages' backward failed)."""
        self.put_back()
        self.restore_hooks()


class _Silenced:
    """A parameter's hooks (the user's only, with ``users_only``), silent until :meth:`restore`.

    Each stays under its key, replaced by a hook that does nothing: a hook whose handle
    is removed meanwhile stays removed, and the order of the hooks is kept.
    """

    def __init__(self, p: Tensor, users_only: bool = False) -> None:
        self.saved: list[tuple[dict[Any, Any], Any, Any]] = []
        for d in _dicts(p):
            for key, hook in list(d.items()):
                if _counts(hook, users_only):
                    self.saved.append((d, key, hook))
                    d[key] = _silent

    def __bool__(self) -> bool:
        return bool(self.saved)

    def restore(self) -> None:
        saved, self.saved = self.saved, []
        for d, key, hook in saved:
            if d.get(key) is _silent:
                d[key] = hook


def _silent(*args: Any) -> None:
    """What a silenced hook does: nothing (a tensor hook returning None keeps the grad)."""


def _dicts(p: Tensor) -> list[dict[Any, Any]]:
    return [d for d in (getattr(p, name, None) for name in _HOOKS) if d]


def _counts(hook: Any, users_only: bool) -> bool:
    """Whether to silence or call ``hook``: no placeholder, nor a library one (users_only)."""
    if hook is _silent or isinstance(hook, _Taken):
        return False
    return not (users_only and getattr(hook, SUMS_SHARES, False))
