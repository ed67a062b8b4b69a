"""Checkpointing of one cell, and its recomputation in backward.

A checkpointed cell runs its partition without recording a graph and keeps only its
input. When the gradient reaches the cell, backward runs the partition again on that
input, under the forward's autocast state and random numbers (see ``rng.py``), and
backpropagates through the graph it just built; that graph is dropped as soon as the
cell's backward returns, so recomputed activations live one cell at a time.

Why not ``torch.utils.checkpoint``: a cell's input and output are any nesting of tuples,
lists and dicts holding tensors and other values, a cell runs on a worker thread that
must re-enter the caller's state, the random numbers come from the cell's own generators
(``rng.py``), and :func:`is_recomputing` must be visible to
layers. One small autograd function does all of that in one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgpipe.mailbox import add_note
from torchgpipe.microbatch import Spec, distinct_tensors, flatten, per_tensor, unflatten
from torchgpipe.rng import CellRandomness
from torchgpipe.trace import profiled
from torchgpipe.worker import ThreadState

if TYPE_CHECKING:  # guards.py imports batchnorm.py, which imports this module
    from torchgpipe.guards import Restore, RunGuard

__all__ = [
    "aliases",
    "checkpoint",
    "fresh_leaves",
    "is_checkpointing",
    "is_recomputing",
    "output_pairs",
    "recomputing",
]

_flags = threading.local()


def is_checkpointing() -> bool:
    """Whether the calling thread runs the forward pass of a checkpointed cell.

    A layer can use it to skip work that recomputation would repeat, or to tell the
    checkpointed forward apart from an ordinary one::

        def forward(self, x):
            if is_checkpointing():
                ...  # no graph is recorded here; backward will run this again
            return self.body(x)

    A cell where neither an input nor a parameter wants a gradient says so too, though
    it runs as one that is not checkpointed (in grad mode, never recomputed).
    """
    return bool(getattr(_flags, "checkpointing", False))


def will_recompute() -> bool:
    """Whether the checkpointed forward running on this thread may be recomputed."""
    return bool(getattr(_flags, "recomputes", False))


def is_recomputing() -> bool:
    """Whether the calling thread recomputes a checkpointed cell during backward.

    Useful for side effects that must happen once per forward pass, such as updating
    running statistics::

        def forward(self, x):
            if not is_recomputing():
                self.calls += 1
            return self.body(x)

    Draw no random numbers in such a branch: the recomputation must draw what the
    forward drew, in the same order, or every later draw of the cell (Dropout's mask)
    comes out other than the forward's.
    """
    return bool(getattr(_flags, "recomputing", False))


class set_flag:  # lower case: used as a function: `with set_flag("recomputing"):`
    """Set the calling thread's flag ``name`` while entered (``is_recomputing()``...).

    A class, not a generator-based context manager: it is entered around every
    checkpointed cell, on the pipeline's critical path, where a generator costs more.
    """

    __slots__ = ("_name", "_previous", "_value")

    def __init__(self, name: str, value: bool = True) -> None:
        self._name = name
        self._previous = False
        self._value = value

    def __enter__(self) -> None:
        self._previous = getattr(_flags, self._name, False)
        setattr(_flags, self._name, self._value)

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        setattr(_flags, self._name, self._previous)
        if error is not None and self._name == "recomputes" and self._value and _needs_graph(error):
            add_note(
                error,
                "torchgpipe: this cell is checkpointed: its forward runs without a graph "
                "(is_checkpointing()), which its recomputation in the backward records. "
                "Where a layer needs one in its forward (a tensor hook, retain_grad()), "
                "do it only where the tensor requires grad (the recomputation does), "
                "or use checkpoint='never'",
            )


# What torch says of a tensor hook or retain_grad() where no graph is recorded.
_NO_GRAPH = (
    "cannot register a hook on a tensor that doesn't require gradient",
    "can't retain_grad on Tensor that has requires_grad=False",
)


def _needs_graph(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _NO_GRAPH)


Flags = tuple[AbstractContextManager[None], AbstractContextManager[None]]
_NO_FLAGS: Flags = (nullcontext(), nullcontext())


def checkpoint_flags(checkpointed: bool, again: bool) -> Flags:
    """The flags to enter around a cell's forward (none where it is not ``checkpointed``).

    ``is_checkpointing()``, and whether the cell may be recomputed (``again``).
    """
    if not checkpointed:
        return _NO_FLAGS
    return set_flag("checkpointing"), set_flag("recomputes", again)


class _Cell:
    """A checkpointed cell: what recomputation needs besides the saved tensors."""

    def __init__(
        self,
        function: Callable[[Any], Any],
        spec: Spec,
        leaves: list[Any],
        state: ThreadState,
        randomness: CellRandomness,
    ) -> None:
        self.function = function
        self.spec = spec
        # The leaves of the input and output with every tensor replaced by a marker: the
        # cell lives until backward, and must not keep tensors that autograd would free.
        self.leaves = leaves
        self.state = state
        self.randomness = randomness
        self.out_spec: Spec | None = None
        self.out_leaves: list[Any] = []
        self.fork = False
        self.guard: RunGuard | None = None
        self.restore: Restore | None = None  # the buffers the recomputation starts from
        # With a trace on: record(kind, start, end) for the recomputation and backward.
        self.record: Callable[[str, float, float], None] | None = None
        self.name = "B"  # in torch.profiler traces
        self.params: list[Tensor] = []  # inputs of the autograd function after the tensors
        self.withheld = False  # parameters that want a gradient, not among params

    def call(self, tensors: Sequence[Tensor]) -> Any:
        return self.function(unflatten(_with_tensors(self.leaves, tensors), self.spec))


class _Checkpointed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cell: _Cell, phony: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.cell = cell
        ctx.set_materialize_grads(False)
        tensors = inputs[: len(inputs) - len(cell.params)]  # then the parameters
        # Keep a copy: a layer at the start of the partition may modify its input in
        # place (ReLU(inplace=True) is common), and recomputation needs it unmodified.
        ctx.save_for_backward(*(x.clone() for x in tensors))
        kept = cell.guard.before_forward() if cell.guard is not None else None
        # Its outputs want a gradient, so a backward may recompute it, where an input does.
        recomputes = any(x.requires_grad for x in (phony, *inputs))
        flags = checkpoint_flags(True, recomputes)
        with flags[0], flags[1], cell.randomness.forward():
            output = cell.call(tensors)
        if cell.guard is not None:
            cell.restore = cell.guard.after_forward(kept)
        out_leaves, cell.out_spec = flatten(output)
        cell.out_leaves, distinct = _without_tensors(out_leaves)
        # detach(): an input returned as it is would otherwise become a view made by a
        # custom function, which later in-place layers may not modify.
        outputs = tuple(x.detach() for x in distinct)
        ctx.mark_non_differentiable(*(x for x in outputs if not differentiable(x)))
        if cell.fork:
            outputs += (torch.empty(0, device=phony.device),)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        cell: _Cell = ctx.cell
        if cell.fork:
            grads = grads[:-1]  # the phony's
        needs = ctx.needs_input_grad[2 : len(ctx.needs_input_grad) - len(cell.params)]
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"torchgpipe: a backward with create_graph=True reached the checkpointed "
                f"cell {cell.name}, whose recomputed graph is not differentiable again; "
                f"use checkpoint='never' for gradients of gradients (a gradient penalty)"
            )
        # A plain backward(): neither inputs= nor autograd.grad.
        plain = torch.autograd._is_checkpoint_valid()
        if not plain and cell.withheld:
            raise RuntimeError(
                f"torchgpipe: backward(inputs=...) or torch.autograd.grad reached the "
                f"checkpointed cell {cell.name} of a partition whose backward runs in "
                f"PyTorch's engine (a GPU's) and whose parameters have hooks (or are "
                f"computed from other tensors): its recomputation cannot hand their "
                f"gradients to the engine. Use checkpoint='never' for these, or a plain "
                f"backward() and .grad"
            )
        try:
            return _recompute_backward(ctx, cell, grads, needs, plain)
        except BaseException as error:
            add_note(error, f"torchgpipe: raised in {cell.name} (a checkpointed cell's backward)")
            raise


def _recompute_backward(
    ctx: Any, cell: _Cell, grads: tuple[Tensor | None, ...], needs: tuple[bool, ...], plain: bool
) -> tuple[Tensor | None, ...]:
    """Recompute ``cell`` and backpropagate ``grads`` through it; the gradients it gives.

    In a ``plain`` backward every leaf the recomputed graph reaches accumulates its
    ``.grad`` here, as reentrant checkpointing does (tensors a layer uses that are not
    its registered parameters included), and the engine gets None for the parameters
    given as inputs. Otherwise (``inputs=``, ``torch.autograd.grad``) it gets their
    gradients, and accumulates, captures or drops each as for the plain model's graph.
    """
    # The guard holds until the recomputed graph is through: what it restores may be
    # saved in that graph.
    guard = cell.guard.recomputing(cell.restore) if cell.guard is not None else nullcontext()
    with profiled(cell.name), guard:
        started = time.perf_counter()
        with recomputing(cell.randomness, cell.state):  # grad mode on: the aliases
            inputs, aliased = fresh_leaves(ctx.saved_tensors, needs)  # are recorded
            output = cell.call(tuple(aliased))
        recomputed = time.perf_counter()
        outputs = distinct_tensors(flatten(output)[0])[0]
        pairs = output_pairs(outputs, grads)
        ys, gs = [y for y, _ in pairs], [g for _, g in pairs]
        wanted = [x for x, need in zip(inputs, needs, strict=True) if need]
        if plain:
            if pairs:
                torch.autograd.backward(ys, gs)
            found: Sequence[Tensor | None] = [x.grad for x in wanted] + [None] * len(cell.params)
        else:
            wanted += cell.params
            found = [None] * len(wanted)
            if pairs and wanted:
                found = torch.autograd.grad(ys, wanted, gs, allow_unused=True)
        if cell.record is not None:
            cell.record("recompute", started, recomputed)
            cell.record("backward", recomputed, time.perf_counter())
    got = iter(found)
    grads_in = [next(got) if need else None for need in needs]
    return (None, None, *grads_in, *got)


def output_pairs(
    outputs: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> list[tuple[Tensor, Tensor]]:
    """The ``outputs`` of a cell that want a gradient, each with its gradient in ``grads``.

    Raises:
        RuntimeError: a recomputation made outputs other than its forward's (more or
            fewer, or of other shapes than their gradients, which are the forward's).
    """
    if len(outputs) == len(grads):
        pairs = [
            (y, g) for y, g in zip(outputs, grads, strict=True) if y.requires_grad and g is not None
        ]
        # A jagged dimension is a new symbol in every tensor: those are torch's to check.
        if all(y.shape == g.shape or y.is_nested or g.is_nested for y, g in pairs):
            return pairs
    made = [tuple(y.shape) for y in outputs]
    wanted = [None if g is None else tuple(g.shape) for g in grads]
    raise RuntimeError(
        f"torchgpipe: a checkpointed cell's recomputation made outputs of shapes {made}, "
        f"where its forward's have gradients of shapes {wanted}: a layer computes "
        f"otherwise when recomputed (under is_recomputing(), from a count of its calls, "
        f"from Python's random); make it compute alike, or use checkpoint='never'"
    )


def fresh_leaves(values: Sequence[Any], needs: Sequence[bool]) -> tuple[list[Any], list[Any]]:
    """The inputs of a recomputation: new leaves, and the aliases the layers get.

    Each tensor of ``values`` becomes a new leaf wanting a gradient where ``needs``
    says; other values pass as they are. See :func:`aliases` for the second list, which
    must be made under grad mode (inside :func:`recomputing`).
    """
    need = {id(x): n for x, n in zip(values, needs, strict=True) if isinstance(x, Tensor)}
    leaves = per_tensor(lambda x: x.detach().requires_grad_(need[id(x)]), values)
    return leaves, aliases(leaves)


def aliases(leaves: Sequence[Any]) -> list[Any]:
    """Non-leaf stand-ins for the leaves that want a gradient, which layers may modify.

    A layer may modify its input in place (as it could in a plain forward); a leaf that
    wants a gradient may not be, so the layer gets an alias and the leaf collects the
    gradient.
    """
    return per_tensor(lambda x: alias(x) if x.requires_grad else x, leaves)


@contextmanager
def recomputing(
    randomness: CellRandomness, state: ThreadState | None = None, loss: bool = False
) -> Iterator[None]:
    """Around a cell's recomputation: the forward's random numbers, ``is_recomputing()``.

    ``state``, when given, is the caller's (grad mode forced on): the engine's thread,
    where a connected cell recomputes, has none of it; a rank's loop has entered it.
    ``loss`` says the recomputation computes a loss its forward did not.

    Raises:
        RuntimeError: the recomputation called another random function than its
            forward did at that point, or from another line (its numbers would not be
            the forward's).
    """
    with ExitStack() as stack:
        if state is not None:
            stack.enter_context(state.apply(grad_enabled=True))
        stack.enter_context(set_flag("recomputing"))
        stack.enter_context(randomness.replay(loss))
        yield


class _Alias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def alias(x: Tensor) -> Tensor:
    return _Alias.apply(x)  # type: ignore[no-any-return,no-untyped-call]  # apply is unannotated


class _Slot:
    """Marks where a tensor leaf was: the ``index``-th distinct tensor of the leaves."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _without_tensors(leaves: list[Any]) -> tuple[list[Any], list[Tensor]]:
    """The leaves with a marker for each tensor, and the distinct tensors they mark."""
    tensors, which = distinct_tensors(leaves)
    it = iter(which)
    return [_Slot(next(it)) if isinstance(x, Tensor) else x for x in leaves], tensors


def _with_tensors(leaves: list[Any], tensors: Sequence[Tensor]) -> list[Any]:
    return [tensors[x.index] if isinstance(x, _Slot) else x for x in leaves]


def differentiable(x: Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def checkpoint(
    function: Callable[[Any], Any],
    value: Any,
    *,
    state: ThreadState,
    randomness: CellRandomness,
    device: torch.device,
    after: Tensor | None = None,
    fork: bool = False,
    guard: RunGuard | None = None,
    record: Callable[[str, float, float], None] | None = None,
    name: str = "B",
    trainable: bool = True,
    params: Sequence[Tensor] = (),
    withheld: bool = False,
) -> tuple[Any, Tensor | None]:
    """Run ``function(value)`` checkpointed: keep ``value``, recompute in backward.

    ``state`` is the caller's thread state, entered again for the recomputation;
    ``randomness`` makes the recomputation draw the random numbers the forward drew.

    The cell carries the ordering edges of ``dependency.py`` itself, which saves two
    autograd nodes per cell: ``after`` is the phony of the previous micro-batch on this
    partition (whose backward then waits for this cell's), and with ``fork`` the cell
    returns a phony for the next micro-batch, or else None.

    ``guard``, when given, keeps the recomputation on the state the forward saw
    (``guards.py``: parameters, buffers), and
    ``record``, when given, is told the spans of the recomputation and the backward;
    ``name`` names the recomputation and backward in ``torch.profiler`` traces.
    ``trainable`` says whether a parameter of ``function`` wants a gradient, and
    ``params`` lists those parameters (leaves, unhooked): inputs of the cell's autograd
    node, so that ``backward(inputs=...)`` and ``torch.autograd.grad`` reach the cell
    and get their gradients (see :func:`_recompute_backward`); where some are left out
    (``withheld``), those backward passes are refused at the cell.
    """
    leaves, spec = flatten(value)
    shell, distinct = _without_tensors(leaves)
    cell = _Cell(function, spec, shell, state, randomness)
    cell.fork = fork
    cell.guard = guard
    cell.record = record
    cell.name = name
    cell.params = list(params)
    cell.withheld = withheld or (trainable and not cell.params)
    tensors = tuple(distinct)
    # The phony makes the outputs want a gradient when a parameter does and none is given
    # in ``params``. With nothing to train and no input wanting a gradient, the outputs
    # want none either, as the plain model's would not.
    wants = trainable or any(x.requires_grad for x in tensors)
    phony = after if after is not None else torch.empty(0, device=device, requires_grad=wants)
    outputs = _Checkpointed.apply(cell, phony, *tensors, *cell.params)  # type: ignore[no-untyped-call]  # Function.apply is unannotated
    next_phony = outputs[-1] if fork else None
    if fork:
        outputs = outputs[:-1]
    assert cell.out_spec is not None  # set by _Checkpointed.forward
    return unflatten(_with_tensors(cell.out_leaves, outputs), cell.out_spec), next_phony
