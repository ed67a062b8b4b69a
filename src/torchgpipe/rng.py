"""Random numbers of cells: each cell draws from generators of its own.

What a cell (micro-batch ``i`` on partition ``j``) draws depends only on a seed taken
from the default CPU generator when the forward (or the step) starts, on ``i`` and on
``j``: not on the checkpoint mode, the schedule, how the worker threads interleave, or
what other threads draw. A recomputation draws what the forward drew. Runs repeat under
``torch.manual_seed``.

How: while a cell runs (its forward, and its recomputation in backward), a torch
function mode on the cell's thread gives every random function the cell's own
``torch.Generator`` (one per device, seeded from the cell's seed), as the function's
``generator=`` argument (``random_functions.py`` holds the table). Forward and
recomputation start from the same seed, so they draw the same numbers. The
process-wide generators are never set, only drawn from once per forward for the
seed (which moves the default CPU generator on by one draw, in eval and under no_grad
too), so other threads' draws are left as they were::

    forward starts:  seed = draw from torch's default CPU generator
    cell (i, j):     seed_ij = mix(seed, i, j)
                     forward:        torch.rand(...)  ->  torch.rand(..., generator=G_ij)
                     recomputation:  the same calls, on a new G_ij seeded alike

Why a function mode: it sees the calls made from Python in the forward, where layers
draw, and costs a Python call per torch function of a cell. A dispatch mode sees every
operator, backward included, and costs a call each. The few functions that draw inside
C++ code with no generator argument (multi-head attention's dropout, the recurrent
layers' dropout between layers) run with a dispatch mode on for their own operators
only (:class:`_RandomOperators`).

A call that brings a generator of its own draws what it would draw from it, as in the
unwrapped model: the forward notes the generator's state, draws from a new generator in
that state and moves the caller's on to where that one ended; the recomputation draws
from another new generator in the noted state: the same numbers, and the caller's
generator advanced once.

Not covered, so drawing from the default generators without these guarantees: random
draws of custom C++ or Triton kernels, random ``torch.ops.aten`` operators called
directly or from TorchScript (below the function mode), cuDNN's recurrent dropout on
CUDA (its state is seeded inside cuDNN), and Python's ``random`` and NumPy's
generators. A draw inside ``torch.utils.checkpoint`` in a cell, whose result wants a
gradient, is refused: torch recomputes that code in the backward from the default
generator, not the cell's (``_in_torch_checkpoint``, by the frames between the call and
the cell: a walk of a few microseconds per random call in grad mode).
On CUDA, Dropout in a cell runs as ``bernoulli_`` and a multiply rather than the fused
kernel, and keeps its mask in the input's dtype.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchgpipe.random_functions import GENERATOR_AT, HANDLERS, NAMES, native_dropout

__all__ = ["CellRandomness", "cell_seed", "draw_seed", "own_generators", "random_functions"]

_MASK64 = 0xFFFFFFFFFFFFFFFF

# Held while a cell notes a generator's state and draws from it: layers of two
# partitions may share one generator, and a draw between the two would shift it.
_GIVEN = threading.RLock()


def draw_seed() -> int:
    """A seed for a forward pass's cells, drawn from the default CPU generator."""
    # device="cpu": under torch.set_default_device("cuda") or "meta" the draw would go
    # to that device's generator (or draw nothing at all).
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item())


def cell_seed(seed: int, i: int, j: int) -> int:
    """The seed of cell ``(i, j)`` (micro-batch, partition) of a run seeded with ``seed``.

    A splitmix64 finalizer over the three numbers: nearby cells get unrelated seeds.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (j << 32) + i) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits


def own_generators(seed: int = 0) -> TorchFunctionMode:
    """A scope whose random functions draw from generators of its own, seeded ``seed``.

    For the library's own runs of a user's layers outside a pipeline (``split``'s
    example run, balancing by time): the process-wide generators are neither advanced
    nor put back, so a thread drawing meanwhile gets fresh numbers, as it would
    without the library (``torch.random.fork_rng`` would hand it some twice).
    """
    return _CellGenerators(seed, cell=False)


def random_functions() -> list[str]:
    """The names of the functions that draw from a cell's generators inside a pipeline."""
    return list(NAMES)


class _CellGenerators(TorchFunctionMode):
    """Hands the cell's own generator to every random function called on this thread."""

    def __init__(
        self,
        seed: int,
        given: list[Tensor] | None = None,
        replays: _CellGenerators | None = None,
        more: bool = False,
        cell: bool = True,
    ) -> None:
        super().__init__()
        self._seed = seed
        self._cell = cell  # a pipeline's cell, whose graph its backward goes through
        self._backward = False  # a cell entered in grad mode: a backward follows
        self._generators: dict[torch.device, torch.Generator] = {}
        # The state of each generator a call brought along, in call order: recorded by
        # the forward, replayed by the recomputation (``given`` is the forward's list).
        self._record: list[Tensor] | None = [] if given is None else None
        self._replay = iter(given) if given is not None else None
        # The random functions called, in order: a recomputation (``replays`` is its
        # forward) must call the forward's, or its numbers from there on would differ
        # from the forward's, silently. It may stop short (a lazy module's first forward
        # made its weights) and, with ``more`` (a loss the forward did not compute), go on.
        self.calls: list[Any] = []
        self._replays = replays
        self._more = more

    def generator(self, device: torch.device | str | int | None) -> torch.Generator | None:
        """The cell's generator for ``device``, made (and seeded) on first use."""
        device = _resolve(device)
        if device.type == "meta":  # shapes only: nothing is drawn
            return None
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def __enter__(self) -> _CellGenerators:
        self._backward = self._cell and torch.is_grad_enabled()
        super().__enter__()  # type: ignore[no-untyped-call]  # TorchFunctionMode is unannotated
        return self

    def operators(self) -> _RandomOperators:
        """A scope in which random operators draw from this cell's generators too."""
        return _RandomOperators(self)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = HANDLERS.get(func)
        if handler is None:  # most functions draw nothing: the fast way through
            return func(*args, **kwargs) if kwargs else func(*args)
        call = (func, _site())
        if self._replays is not None:
            self._check_call(call, self._replays.calls)
        self.calls.append(call)
        kwargs = kwargs or {}
        if (
            kwargs.get("generator") is not None
            or any(isinstance(a, torch.Generator) for a in args)  # given one, positionally
        ):
            return self._given(func, args, kwargs)
        if "generator" in kwargs:  # generator=None, as torch.nn.init passes it on
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        at = GENERATOR_AT.get(func)
        if at is not None and len(args) == at + 1 and args[at] is None:  # poisson(x, None)
            args = args[:at]  # the handler gives the cell's generator, by keyword
        if self._backward and _in_torch_checkpoint():
            return self._refuse_drawn(handler, func, args, kwargs)
        return handler(self, func, args, kwargs)

    def _refuse_drawn(self, handler: Any, func: Any, args: Any, kwargs: Any) -> Any:
        """A call inside ``torch.utils.checkpoint``: refused where it drew into a gradient.

        That is, where the cell's generators moved (Dropout's p > 0) and the result wants
        a gradient: torch recomputes the region only for a backward through it.
        """
        before = {d: g.get_state() for d, g in self._generators.items()}
        result = handler(self, func, args, kwargs)
        if not _wants_grad(result):
            return result
        for device, generator in self._generators.items():
            start = before.get(device)
            if start is None:  # made by this call: it started from the seed
                start = torch.Generator(device=device).manual_seed(self._seed).get_state()
            if not torch.equal(generator.get_state(), start):
                _refuse_torch_checkpoint()
        return result

    def _check_call(self, call: _Call, forward: list[_Call]) -> None:
        """Refuse a recomputation's ``call`` where its forward made another.

        A call is its function and the line of the user's code that made it: a branch
        under ``if not is_recomputing()`` that called ``dropout`` before a Dropout has
        the function of the call after it, but not its line.
        """
        k = len(self.calls)
        if (k < len(forward) and forward[k] == call) or (k >= len(forward) and self._more):
            return
        was = _shown(forward[k]) if k < len(forward) else "nothing more"
        raise RuntimeError(
            f"torchgpipe: the recomputation of a checkpointed cell called {_shown(call)} "
            f"as its random call {k + 1}, where its forward called {was}, so its random "
            f"numbers (Dropout's masks) from there on would not be the forward's and the "
            f"gradients would be wrong: a layer draws only when not recomputing (under "
            f"'if not is_recomputing()') or only when recomputing, or a lazy module "
            f"(LazyLinear) made its weights in the forward. Draw alike in both (run one "
            f"plain forward before wrapping lazy modules), or use checkpoint='never'"
        )

    def _given(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call with a generator of the caller's own (a layer's ``self.generator``).

        The forward notes its state, draws from a new generator in that state and moves
        the caller's on to where that one ended, as the unwrapped model's draw would; the
        recomputation draws from a new generator in the noted state. Neither draws from
        the caller's itself: a thread outside the pipeline drawing from it (a data thread
        given the default generator) could move it between the note and the draw, and
        the recomputation would replay another state than the forward drew from. Layers
        of several partitions sharing one generator draw from it in the order their
        cells run, which the threads' timing decides, as it would for any threads.
        """
        given = kwargs.get("generator")
        if not isinstance(given, torch.Generator):
            given = next((a for a in args if isinstance(a, torch.Generator)), None)
        if given is None:  # not a generator: the function says what it takes
            return func(*args, **kwargs)
        if self._record is not None:
            with _GIVEN:  # no other worker moves it on between the note and the update
                state = given.get_state()
                twin = _twin(given, state)
                result = _drawn_from(twin, given, func, args, kwargs)
                given.set_state(twin.get_state())
            self._record.append(state)
            return result
        assert self._replay is not None
        noted = next(self._replay, None)
        if noted is None:  # the recomputation draws more than the forward did
            raise RuntimeError(
                f"torchgpipe: the recomputation of a checkpointed cell called "
                f"{getattr(func, '__name__', func)} with a generator of its own more "
                f"often than the cell's forward did: a layer that draws only when "
                f"recomputing, or a schedule's loss_fn drawing from a generator of its "
                f"own (a checkpointed last cell computes its loss in its recomputation "
                f"only). Draw the same in both, let the loss draw from torch's default "
                f"generator (the cell's then), or use checkpoint='never'"
            )
        return _drawn_from(_twin(given, noted), given, func, args, kwargs)


def _twin(given: torch.Generator, state: Tensor) -> torch.Generator:
    """A new generator on ``given``'s device, in ``state``."""
    twin = torch.Generator(device=given.device)
    twin.set_state(state)
    return twin


def _drawn_from(
    twin: torch.Generator,
    given: torch.Generator,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``func`` called with ``twin`` wherever its arguments hold ``given``."""
    args = tuple(twin if a is given else a for a in args)
    kwargs = {k: twin if v is given else v for k, v in kwargs.items()}
    return func(*args, **kwargs)


class _RandomOperators(TorchDispatchMode):
    """Random operators (below autograd) draw from a cell's generators.

    Used only around the few functions whose random draws happen in C++: a dispatch
    mode costs a Python call per operator. ``native_dropout`` takes no generator, and is
    computed from ``bernoulli_`` (``random_functions.native_dropout``); its autograd
    node, recorded above, uses the mask returned.
    """

    def __init__(self, cell: _CellGenerators) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated
        self._cell = cell

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if func is torch.ops.aten.native_dropout.default:
            return native_dropout(self._cell, func, args, kwargs)
        if kwargs.get("generator") is None and _takes_generator(func):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            device = tensors[0].device if tensors else kwargs.get("device")
            generator = self._cell.generator(device)
            if generator is not None:
                kwargs = {**kwargs, "generator": generator}
        return func(*args, **kwargs)


_TAKES_GENERATOR: dict[Any, bool] = {}


def _takes_generator(func: Any) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        known = _TAKES_GENERATOR[func] = any(
            argument.name == "generator" for argument in func._schema.arguments
        )
    return known


class CellRandomness:
    """The random numbers of one cell: its forward and its recomputation draw alike.

    Args:
        seed: the cell's seed (:func:`cell_seed`).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._forward: _CellGenerators | None = None

    def forward(self) -> _CellGenerators:
        """Enter around the cell's forward; entered again, it draws on from where it was.

        A schedule's last stage computes the loss after its forward, as part of the cell:
        the recomputation then draws what the forward and the loss drew, in that order.
        """
        if self._forward is None:
            self._forward = _CellGenerators(self.seed)
        return self._forward

    def replay(self, loss: bool = False) -> _CellGenerators:
        """Enter around the recomputation: it draws the numbers the forward drew.

        The recomputation must call the forward's random functions in the forward's
        order; it may call fewer, and with ``loss`` (it computes a loss the forward did
        not) more.

        Raises:
            RuntimeError: at a call of another random function than the forward's.
        """
        forward = self._forward
        given = forward._record if forward is not None else None
        return _CellGenerators(self.seed, given if given is not None else [], forward, loss)


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


_Site = tuple[tuple[Any, int], ...]  # the user's frames of a call: code and line, innermost first
_Call = tuple[Any, _Site]  # a random function, and where the user called it
# With the separator: installed beside torch, this library's path starts with torch's.
_TORCH = os.path.join(os.path.dirname(torch.__file__), "")
_HERE = os.path.join(os.path.dirname(__file__), "")
_CELL = os.path.join(_HERE, "cell.py")  # where the layers are called: _in_torch_checkpoint
_TORCH_CHECKPOINT = torch.utils.checkpoint.__file__


def _site() -> _Site:
    """Where the user's code made a random call: its frames outside torch, up to the cell.

    Up to 4 of them, innermost first (a helper that draws, called from two lines, is
    two sites). Empty where torch's own module is called by this library's cell (an
    ``nn.Dropout`` right in the ``nn.Sequential``): no user code between.
    """
    frames: list[tuple[Any, int]] = []
    frame: FrameType | None = sys._getframe(2)
    for _ in range(64):
        if frame is None or len(frames) == 4:
            break
        path = frame.f_code.co_filename
        if path.startswith(_HERE):  # the cell: the user's code is below it
            break
        if not path.startswith(_TORCH):
            frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(frames)


def _in_torch_checkpoint() -> bool:
    """Whether the random call under way is inside ``torch.utils.checkpoint`` in a cell."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path == _CELL:  # up to the cell that called the layer
            return False
        if path == _TORCH_CHECKPOINT:
            return True
        frame = frame.f_back
    return False


def _wants_grad(value: Any) -> bool:
    """Whether a random function's result (a tensor, or tuples of them) wants a gradient."""
    if isinstance(value, Tensor):
        return value.requires_grad
    return isinstance(value, (tuple, list)) and any(_wants_grad(v) for v in value)


def _refuse_torch_checkpoint() -> NoReturn:
    raise RuntimeError(
        "torchgpipe: a random function drew inside torch.utils.checkpoint in a "
        "pipeline cell, whose random numbers come from the cell's own generator; torch's "
        "checkpoint recomputes that code in the backward from torch's default generator, "
        "so its numbers (Dropout's masks) would not be the forward's and the gradients "
        "would be wrong, silently. GPipe's checkpoint modes recompute each cell already: "
        "take torch.utils.checkpoint out of the layer (a model's own "
        "gradient_checkpointing_disable()), or draw nothing in it (Dropout p=0)"
    )


def _shown(call: _Call) -> str:
    func, site = call
    lines = [f"{code.co_filename}:{line}" for code, line in site[:2]]
    return _name(func) + "".join(f" {w} {at}" for w, at in zip(["at", "from"], lines, strict=False))


def _resolve(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return _default_device()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")  # one CPU generator, whatever the index
    return device


def _default_device() -> torch.device:
    if hasattr(torch, "get_default_device"):  # torch >= 2.3
        return _resolve(torch.get_default_device())
    return torch.empty(()).device  # pragma: no cover - torch < 2.3
