"""Weights tied across partitions: a copy on each partition, equal gradients and values.

A parameter used by layers of two partitions (a language model's token embedding and
its output head) cannot be one tensor: each partition has its own device, and even on
one device each partition's worker would read it while another's optimizer writes it.
So the first partition that uses it keeps it (the owner) and each later one gets a
copy on its own device, in the modules that use it there (:meth:`Ties.untie`).

The copies stay equal by identical updates. After each backward, every copy's
``.grad`` holds the same sum: the gradient of all the uses of the weight, as the
unwrapped model's single tensor gets. Each copy records, with a tensor hook, what the
backward adds to it; at the end of the backward the owner adds the others' share to
its own ``.grad`` (one device, a fixed order) and every copy takes the owner's sum.
Equal values, equal gradients and one optimizer over all of them give equal updates:
elementwise optimizers (SGD, Adam, ...) compute the same numbers for equal inputs on
devices of one kind. The end of the backward is where the library knows it: at the
end of a schedule's step, and for ``model(x)`` through a callback that the output's
backward queues in autograd's engine (it runs once the whole backward is over).

What follows: the model's ``parameters()`` hold each copy (an optimizer steps them all;
gradient-norm clipping counts a tied weight once per copy), and ``state_dict()`` holds
every name the weight has, as the unwrapped model's does. Across processes, each
group also knows the ranks that hold it, and :meth:`Ties.reduce` sums over them through
an :data:`Across` (``torchgpipe/distributed/ties.py``).

A buffer that layers of two partitions hold is copied once: each later partition's copy
takes its first holder's values when the partitions are filled (:meth:`Ties.align`; a
meta model's copies would otherwise keep whatever memory they were given), and is not
kept equal afterwards: a change to one copy, by hand, by a load or by a forward, stays
in that copy. Keeping them equal at run time would cost every run a check of every
copy, and could not reach the other partitions within a forward, as the plain model's
one tensor does. Buffers do not travel between processes (``materialize.py``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torchgpipe.grad_hooks import dense, summed
from torchgpipe.materialize import loaded_value, state_names, tied_state_dict
from torchgpipe.microbatch import flatten, unflatten
from torchgpipe.tied_drift import Drift
from torchgpipe.tied_given import Filled, fill, put_back, replaced
from torchgpipe.tied_loads import loading
from torchgpipe.tied_sums import Record, ReduceAtEnd

__all__ = ["Ties", "loaded_value", "state_names", "tied_state_dict"]


Across = Callable[[tuple[int, ...], Tensor, Tensor], Callable[[], Tensor]]
"""Sums a tied weight's gradient over processes: ``across(ranks, grad, mine)()``.

Every process of ``ranks`` (the owner first) calls it with its own ``.grad`` and
``mine``, what this backward added to it here; the call makes every tensor the sum
needs and returns the move, whose call does the transfers and returns the owner's
``grad`` plus every other process's ``mine``, in every process alike. See
:mod:`torchgpipe.distributed.ties`.
"""


class _Sum(NamedTuple):
    """A group's sum as :meth:`Ties.prepare` leaves it for :meth:`Ties.finish`."""

    group: int
    total: Tensor | None  # the owner's .grad to be (None: none to set)
    move: Callable[[], Tensor] | None  # the transfers across processes, which give it
    grads: list[tuple[Tensor, bool]]  # each copy's .grad to be, and whether to write it
    frozen: str | None = None  # held across processes and frozen here: its first name
    held: tuple[str, torch.dtype] | None = None  # held across processes: name, dtype here


Slot = tuple[nn.Module, str]  # a module, and the name of a parameter (or buffer) in it


class Ties:
    """The parameters tied across partitions: each group's owner first, then its copies.

    Each is held as a slot (module, name), not as the tensor: filling a meta model
    replaces its parameters (``materialize.py``). :attr:`buffers`: the buffers that
    layers of several partitions hold, owner first, which :meth:`align` makes equal once.
    """

    def __init__(
        self,
        slots: list[list[Slot]],
        ranks: list[tuple[int, ...] | None],
        names: list[list[str]] | None = None,
        buffers: list[list[Slot]] | None = None,
        holders: list[list[list[Slot]]] | None = None,
    ) -> None:
        self.slots = slots
        # Per group, per copy: every slot that holds it (a weight used twice in a partition).
        self.holders = holders if holders is not None else [[[s] for s in g] for g in slots]
        self.buffers = buffers if buffers is not None else []
        self.ranks = ranks  # per group: the processes that hold it, or None: this one only
        self.names = names if names is not None else [[] for _ in slots]  # in the state dict
        self._flags = [True] * len(slots)  # per group: requires_grad, as last made equal
        self._drift = Drift()  # the copies changed alike between forwards (tied_drift.py)
        self._lock = threading.RLock()
        self._pending: dict[tuple[int, int], Tensor] = {}
        self._in_flight, self._owed = 0, False  # passes and steps under way, a sum left
        self._handles: list[RemovableHandle] = []
        # What _hook() hooked: (group, copy, parameter, its __dict__ then).
        self._hooked: list[tuple[int, int, Tensor, dict[str, Any]]] = []
        # Per group: the copies the sums and hooks are on, which the slots hold but in a
        # call that functional_call gives tensors of its own (tied_given.py).
        self.own = self.groups

    @property
    def groups(self) -> list[list[Tensor]]:
        """The tied parameters as they are now, owner first in each group."""
        return [[module._parameters[name] for module, name in group] for group in self.slots]  # type: ignore[misc]  # a slot holds a parameter

    @classmethod
    def untie(
        cls,
        partitions: Sequence[Sequence[nn.Module]],
        devices: Sequence[torch.device],
        *,
        shared: Mapping[int, tuple[int, ...]] | None = None,
        names: Mapping[int, list[str]] | None = None,
    ) -> Ties:
        """Give each partition its own copy of every tensor an earlier partition uses.

        ``partitions`` holds each partition's layers, ``devices`` their devices. A copy
        goes where the owner's tensor was, in every module of the partition that held
        it; a parameter's copy starts equal to it (a meta one stays meta). Call
        :meth:`align` once the partitions are placed and filled. ``shared`` maps the
        ``id`` of each parameter other processes hold too to the ranks that hold it;
        ``names``, each parameter's names in the whole model (:func:`state_names`).

        Raises:
            ValueError: a module is part of two partitions.
        """
        first: dict[int, tuple[int, Slot]] = {}
        home: dict[int, int] = {}  # a module's partition
        copies: dict[tuple[int, int], Tensor] = {}
        groups: dict[int, list[Slot]] = {}
        buffers: dict[int, list[Slot]] = {}
        holders: dict[int, list[list[Slot]]] = {}  # per tensor, per copy: where it is
        shared = shared or {}
        for j, layers in enumerate(partitions):
            for layer in layers:
                for module in layer.modules():
                    if home.setdefault(id(module), j) != j:
                        raise ValueError(
                            f"a {type(module).__name__} module is part of layers in "
                            f"partitions {home[id(module)]} and {j}; tie parameters "
                            f"(layer_b.weight = layer_a.weight), not whole modules"
                        )
                    for slots in (module._parameters, module._buffers):
                        for name, tensor in slots.items():
                            if tensor is None:
                                continue
                            key = id(tensor)
                            owner, slot = first.setdefault(key, (j, (module, name)))
                            if key in shared and isinstance(tensor, nn.Parameter):
                                groups.setdefault(key, [slot])
                            held = holders.setdefault(key, [[]])
                            if owner == j:
                                held[0].append((module, name))
                                continue
                            copy = copies.get((key, j))
                            if copy is None:
                                copy = copies[(key, j)] = _copy(tensor, devices[j])
                                kind = groups if isinstance(tensor, nn.Parameter) else buffers
                                kind.setdefault(key, [slot]).append((module, name))
                                held.append([])
                            held[-1].append((module, name))
                            slots[name] = copy  # type: ignore[assignment]  # a Parameter's copy is one
        # Groups held by other processes first, in the order of ``shared``, which every
        # process builds alike from the whole model: their transfers must match.
        order = {key: k for k, key in enumerate(shared)}
        keys = [key for key, group in groups.items() if len(group) > 1 or key in shared]
        keys.sort(key=lambda key: order.get(key, len(order)))  # stable for the others
        names = names or {}
        return cls(
            [groups[key] for key in keys],
            [shared.get(key) for key in keys],
            [list(names.get(key, [])) for key in keys],
            list(buffers.values()),
            [holders[key] for key in keys],
        )

    def __bool__(self) -> bool:
        return bool(self.slots)  # the buffers need nothing once aligned

    def align(self) -> None:
        """Make every copy equal to its owner, and watch their gradients.

        Called once the owners hold their values (a meta model's are filled by then). A
        shared buffer's copies take its owner's values here, once (see the module's doc).
        """
        self.own = self.groups  # a meta model's were replaced, filled
        with torch.no_grad():
            for owner, *copies in self.groups:
                for copy in copies:
                    copy.copy_(owner)
            for (module, name), *slots in self.buffers:
                first = module._buffers[name]
                for m, n in slots:
                    m._buffers[n].copy_(first)  # type: ignore[union-attr,arg-type]  # slots hold buffers
        self._flags = [all(p.requires_grad for p in group) for group in self.groups]
        self._drift.forget()  # the copies changed here, unequally
        self.begin()  # every copy frozen where one is, and watched

    def begin(self, step: bool = False) -> None:
        """Get ready for a forward or a ``step``: every copy frozen where one is, and watched.

        Shares no sum took are forgotten unless a pass or step is under way (see
        ``tied_sums.py``). Freezing or unfreezing a tied weight's name does it to the
        weight: where a copy's ``requires_grad`` differs from the group's, all take it.

        Raises:
            RuntimeError: the copies of a tied weight changed unequally (``tied_drift.py``).
        """
        for g, now in enumerate(self.groups):  # replaced for good (tied_given.py)
            across = self.ranks[g] is not None
            pairs = zip(self.own[g], now, strict=True)
            self.own[g] = [p if across or replaced(p) else o for o, p in pairs]
        self._drift.check(self.own, self.names, step)
        with self._lock:
            if not self._in_flight:
                self._pending.clear()
        for g, group in enumerate(self.own):
            last = self._flags[g]
            flag = next((p.requires_grad for p in group if p.requires_grad != last), last)
            for p in group:
                if p.requires_grad != flag:
                    p.requires_grad_(flag)
            self._flags[g] = flag
        wanted = self._wanted()
        if len(wanted) != len(self._hooked) or any(
            a[:2] != b[:2] or a[2] is not b[2] or vars(a[2]) is not b[3]
            for a, b in zip(wanted, self._hooked, strict=False)
        ):
            self._hook()

    @contextmanager
    def using(self, step: bool = False) -> Iterator[None]:
        """Around a forward or a ``step``: :meth:`begin`, and given tensors (tied_given.py).

        Raises:
            RuntimeError: as :meth:`begin`.
            ValueError: several tensors given for some copies of a tied weight.
        """
        self.begin(step)
        filled: Filled = []
        try:
            for g, holders in enumerate(self.holders):
                if self.ranks[g] is None:
                    filled += fill(holders, self.own[g], self.names[g])  # all or none
            yield
        finally:
            put_back(filled)

    def passing(self) -> None:
        """A backward pass or step begins (after a sum under way: ``tied_sums.py``)."""
        with self._lock:
            self._in_flight += 1

    def passed(self, ran: bool, *, summed: bool = False) -> None:
        """Over: well (``ran``, ``summed`` or not) or failed; see ``tied_sums.py``."""
        with self._lock:  # reentrant: reduce() takes it too, and passing() waits
            try:
                self._owed |= ran and not summed  # a pass that ended well left its sum
                if self._in_flight == 1 and self._owed:
                    self._owed = False
                    self.reduce()
                elif self._in_flight == 1 and not ran:
                    self._pending.clear()
            finally:
                self._in_flight -= 1

    @contextmanager
    def summing(self, reduce: bool = True) -> Iterator[None]:
        """Around a step: summed at its end (but for ``reduce=False``); a failed one's dropped."""
        self.passing()
        ran = False
        try:
            yield
            if reduce:
                self.reduce()
            ran = True
        finally:
            self.passed(ran, summed=True)

    def reduce(self, across: Across | None = None) -> None:
        """Give every copy the sum of the gradients all its group's uses added since.

        ``across`` sums over the other processes that hold a group (every process of
        the group calls this, ``across`` included, for each such group in order). The
        same as :meth:`finish` of :meth:`prepare`; a pass or step that begins waits.
        """
        with self._lock:
            self.finish(self.prepare(across))

    def prepare(self, across: Across | None = None) -> list[_Sum]:
        """Everything :meth:`reduce` computes alone: the sums here, the tensors it fills.

        What could fail here (memory short, a gradient of an unexpected kind) fails
        before any transfer, which another process would otherwise wait on: across
        processes this runs before the step's end, so such a failure fails the step on
        every rank, and :meth:`finish` only moves values into tensors already made.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
        sums: list[_Sum] = []
        with torch.no_grad():
            for g, (owner, *copies) in enumerate(self.own):
                ranks = self.ranks[g]
                if ranks is None and not owner.requires_grad:  # frozen: no gradient
                    continue
                parts = [pending.get((g, c)) for c in range(len(copies) + 1)]
                total = owner.grad
                for part in parts[1:]:
                    if part is not None:
                        total = summed(total, part.to(owner.device))
                move = None
                if ranks is not None and across is not None:
                    mine = torch.zeros_like(owner)
                    for part in parts:
                        if part is not None:
                            mine = summed(mine, part.to(owner.device))
                    total = torch.zeros_like(owner) if total is None else dense(total)
                    # Frozen here too: the transfers go unless every holder froze it
                    # (finish's skip), so that one that disagrees waits on none.
                    move = across(ranks, total, mine)
                name = self.names[g][0] if move is not None and self.names[g] else None
                held = (name, owner.dtype) if name is not None else None
                if total is None or not owner.requires_grad:
                    frozen = None if owner.requires_grad else name
                    sums.append(_Sum(g, None, move, [], frozen, held))
                    continue
                # Each copy's .grad: its own, written in place, or made here.
                grads = [
                    (copy.grad, True)
                    if copy.grad is not None and copy.grad.layout == total.layout
                    else (total.to(copy.device, copy=True), move is not None)
                    for copy in copies
                ]
                sums.append(_Sum(g, total, move, grads, held=held))
        return sums

    def finish(self, sums: list[_Sum], skip: Collection[int] = ()) -> None:
        """The transfers of :meth:`prepare`'s sums, in order; then every copy's ``.grad``.

        ``skip``: groups frozen in every process that holds them, which move nothing.
        """
        with torch.no_grad():
            for entry in sums:
                if entry.group in skip:
                    continue
                total = entry.move() if entry.move is not None else entry.total
                if entry.total is None or total is None:
                    continue
                owner, *copies = self.own[entry.group]
                owner.grad = total
                for copy, (grad, write) in zip(copies, entry.grads, strict=True):
                    if write:
                        grad.copy_(total)
                    copy.grad = grad

    def after_backward(self, outputs: list[Any]) -> list[Any]:
        """The micro-batches' ``outputs`` through a node whose backward ends in :meth:`reduce`.

        One node for all of them: its backward runs once per backward pass.
        """
        flat = [flatten(output) for output in outputs]
        wanting = [x for leaves, _ in flat for x in leaves if _wants_grad(x)]
        if not wanting:
            return outputs
        views = iter(ReduceAtEnd.apply(self, *wanting))  # type: ignore[no-untyped-call]  # Function.apply is unannotated
        return [
            unflatten([next(views) if _wants_grad(x) else x for x in leaves], spec)
            for leaves, spec in flat
        ]

    def _wanted(self) -> list[tuple[int, int, Tensor]]:
        """The parameters to watch: (group, copy, parameter), as ``_hook`` hooks them.

        Not a group's owner in this process alone: what the backward adds to it stays in
        its ``.grad``, which :meth:`reduce` reads.
        """
        return [
            (g, c, parameter)
            for g, group in enumerate(self.own)
            for c, parameter in enumerate(group)
            if parameter.requires_grad and (c > 0 or self.ranks[g] is not None)
        ]

    def _hook(self) -> None:
        """Hook the parameters :meth:`_wanted` names, each noted with its ``__dict__``.

        The same tensor object with another ``__dict__`` was swapped
        (``torch.utils.swap_tensors``, which ``module.float()`` calls under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``): a swap
        exchanges the tensor underneath and the ``__dict__``, and keeps the identity and
        the dict of hooks, which torch bound to the tensor underneath when it made the
        dict, so no hook in it fires any more, a hook added since included. Assigning
        the dict again binds it to the tensor now underneath. So it is done for every
        parameter not hooked here under the same ``__dict__`` before (a frozen one may
        have been swapped unseen): the user's hooks in its dict fire again too.
        """
        kept = {id(p) for _, _, p, held in self._hooked if vars(p) is held}
        for handle in self._handles:
            handle.remove()
        wanted = self._wanted()
        self._handles = [p.register_hook(Record(self, (g, c))) for g, c, p in wanted]
        for (_, _, p), handle in zip(wanted, self._handles, strict=True):
            # First among the parameter's hooks, hooked anew or not: the share recorded
            # for the sum is the engine's, whatever a user's hook returns.
            hooks = p._backward_hooks
            assert isinstance(hooks, OrderedDict)  # register_hook made it so
            hooks.move_to_end(handle.id, last=False)
            if id(p) not in kept:
                p._backward_hooks = p._backward_hooks  # bound anew: see the docstring
        self._hooked = [(g, c, p, vars(p)) for g, c, p in wanted]

    def watch_loads(self, module: nn.Module) -> None:
        """Keep the copies equal through ``module.load_state_dict`` (``module`` holds them).

        Register after any hook that renames the state dict's keys (``keep_plain_keys``).
        """
        module._register_load_state_dict_pre_hook(partial(loading, self), with_module=True)
        module.register_load_state_dict_post_hook(self._loaded)

    def _loaded(self, module: nn.Module, incompatible: Any) -> None:
        self.own = self.groups  # ``assign=True``: new parameters
        self._drift.forget()  # a copy under two names was loaded twice
        self.begin()  # ``assign=True`` puts new parameters in place: watch them

    def record(self, key: tuple[int, int], grad: Tensor) -> None:
        """Note ``grad``, on its way into the ``.grad`` of copy ``key``, for :meth:`reduce`."""
        with self._lock:
            seen = self._pending.get(key)
            if seen is None:
                self._pending[key] = grad.detach().clone()  # the engine may keep ``grad`` as .grad
            else:
                self._pending[key] = summed(seen, grad.detach())

    def __getstate__(self) -> dict[str, Any]:
        state = {"slots": self.slots, "ranks": self.ranks, "names": self.names}
        return {**state, "flags": self._flags, "buffers": self.buffers, "holders": self.holders}

    def __setstate__(self, state: dict[str, Any]) -> None:
        holders = state.get("holders")  # None in a pickle of before: the first holders
        args = state["slots"], state["ranks"], state["names"], state["buffers"], holders
        self.__init__(*args)  # type: ignore[misc]
        self._flags = state["flags"]
        self._hook()  # on the copied tensors


def _wants_grad(x: Any) -> bool:
    return isinstance(x, Tensor) and x.requires_grad


def _copy(tensor: Tensor, device: torch.device) -> Tensor:
    """A copy of ``tensor`` on ``device``, of its kind (a meta tensor stays meta).

    A parameter's copy is of its class (a subclass of ``nn.Parameter`` included) and
    holds its attributes (``p._no_weight_decay = True``, by which optimizer groups are
    often built): the copies are one weight, and must be treated alike.
    """
    data = torch.empty_like(tensor) if tensor.is_meta else tensor.detach().to(device, copy=True)
    if not isinstance(tensor, nn.Parameter):
        return data
    kind = type(tensor)
    made = (kind if issubclass(kind, nn.Parameter) else nn.Parameter)(data, tensor.requires_grad)
    made.__dict__.update(vars(tensor))
    return made
