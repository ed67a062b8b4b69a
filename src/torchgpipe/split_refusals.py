"""What ``torch.fx`` would capture wrongly, refused while it traces (``split_capture.py``).

fx runs the Python of a forward once, at trace time, and records only the calls on
proxies: a random draw on no traced value, or from Python's ``random``, would be kept
as a constant (or a branch) for every call; a value the forward stores on a module
would be a proxy the module keeps; a custom ``autograd.Function`` would lose its
backward. These refuse them, naming the user's line.
:func:`refuse_lost_state` refuses what the stages would not keep of the model's state.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from torchgpipe.microbatch import flatten, map_tensors
from torchgpipe.random_functions import HANDLERS
from torchgpipe.rng import own_generators
from torchgpipe.split_buffers import kept_buffers
from torchgpipe.split_stage import SplitError, own_method

__all__ = [
    "TORCH_DIR",
    "ConstantDraws",
    "captured_as_computed",
    "leaves",
    "python_draws_refused",
    "refuse_lost_state",
    "stored_values_refused",
    "torch_class",
    "trace_failure",
    "user_line",
    "where_made",
]

TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


# Refused while tracing: frozen random draws, values stored on modules.


@functools.cache
def _draws(name: str) -> bool:
    """Whether the ATen operator called ``name`` draws random numbers."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    overloads = packet.overloads() if isinstance(packet, torch._ops.OpOverloadPacket) else []
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in overloads)


def user_line() -> str:
    """The innermost line outside torch and this package, as `` at file:line (`code`)``."""
    for f in reversed(traceback.extract_stack()):
        if not f.filename.startswith((TORCH_DIR, _HERE)):
            return f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
    return ""


class ConstantDraws(TorchFunctionMode):
    """Refuses a random function called on no traced value while fx traces.

    fx runs a call that has no proxy among its arguments (``torch.randn(4)``) once, at
    trace time, and keeps its result as a constant: every call would get the same draw.
    """

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (func in HANDLERS or _draws(name)) and not _traced(args, kwargs):
            raise SplitError(
                f"cannot split {self.model}: {name}(...){user_line()} draws random numbers "
                f"from no input of the forward, and torch.fx would draw them once, at split time, "
                f"and reuse them on every call; draw from a tensor of the forward instead "
                f"(torch.randn_like(x), x.new_empty(shape).normal_(), torch.randn(shape, "
                f"device=x.device)), or keep that code in a submodule split calls whole"
            )
        return func(*args, **kwargs)


_PYTHON_DRAWS = (
    *("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample"),
    *("gauss", "normalvariate", "lognormvariate", "expovariate", "betavariate"),
    *("gammavariate", "triangular", "vonmisesvariate", "paretovariate", "weibullvariate"),
)


class _PythonDraws(threading.local):
    """Which model this thread is tracing (None: none), for the wrappers of ``random``."""

    model: str | None = None


_TRACING = _PythonDraws()
_INSTALLED: dict[str, Any] = {}  # name: the original function, while wrappers are in
_USERS = [0]  # splits under way, in any thread
_LOCK = threading.Lock()


def _refusing(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        model = _TRACING.model
        if model is None:  # another thread, or after the split: as ever
            return original(*args, **kwargs)
        raise SplitError(
            f"cannot split {model}: random.{name}(...){user_line()} draws a Python "
            f"random number, and torch.fx runs Python code once, at split time: every "
            f"call would take the branch drawn then; draw from torch instead "
            f"(torch.rand((), device=x.device) < p), or keep that code in a submodule "
            f"split calls whole"
        )

    draw.__torchgpipe_wraps__ = original  # type: ignore[attr-defined]
    return draw


_FUNCTION = torch.autograd.Function
_APPLY = _FUNCTION.__dict__["apply"]  # a classmethod: what every subclass's apply is


def _traced(args: Any, kwargs: Any) -> bool:
    """Whether a call's arguments hold a value torch.fx is tracing."""
    return any(isinstance(x, fx.Proxy) for x in pytree.tree_leaves((args, kwargs)))


def _apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply``, refused on a traced value (fx would keep no backward)."""
    model = _TRACING.model
    if model is not None and _traced(args, kwargs):
        raise SplitError(
            f"cannot split {model}: {cls.__name__}.apply(...){user_line()} calls a custom "
            f"torch.autograd.Function, whose backward torch.fx cannot capture (it records "
            f"what the forward computes, if anything: a gradient reversal would vanish, "
            f"silently); call it from a submodule that split calls whole (one with no "
            f"split point inside)"
        )
    return _APPLY.__func__(cls, *args, **kwargs)


_APPLY_REFUSING = classmethod(_apply)


@contextmanager
def python_draws_refused(model: str) -> Iterator[None]:
    """Refuse a draw from Python's ``random`` module by the traced forward.

    fx runs Python code once, at trace time: a draw there (LayerDrop's
    ``random.random() < p``) would pick one branch for every call. The module's
    functions are wrapped while any split is under way; a wrapper refuses only in a
    thread that is tracing, so other threads (and code that imported a wrapper) keep
    drawing as they did. The last split to end puts back each function still wrapped.
    ``torch.autograd.Function.apply`` is wrapped alike: fx would record what a custom
    function's forward computes, and never its backward.
    """
    with _LOCK:
        if not _USERS[0]:
            for name in _PYTHON_DRAWS:
                original = getattr(random, name)
                _INSTALLED[name] = original
                setattr(random, name, _refusing(name, original))
            if _FUNCTION.__dict__["apply"] is _APPLY:
                _FUNCTION.apply = _APPLY_REFUSING  # type: ignore[method-assign,assignment]
        _USERS[0] += 1
    outer, _TRACING.model = _TRACING.model, model
    drawn: list[str] = []  # where, in the user's code
    watched = sys.getprofile() is None  # a profiler of the user's own is left alone
    if watched:  # the frame that entered this (split's), below any the trace makes
        sys.setprofile(partial(_watch_draws, drawn, sys._getframe(2)))
    try:
        yield
    finally:
        if watched:
            sys.setprofile(None)
        _TRACING.model = outer
        with _LOCK:
            _USERS[0] -= 1
            if not _USERS[0]:
                for name, original in _INSTALLED.items():
                    if getattr(getattr(random, name), "__torchgpipe_wraps__", None) is original:
                        setattr(random, name, original)  # not if someone replaced it since
                _INSTALLED.clear()
                if _FUNCTION.__dict__["apply"] is _APPLY_REFUSING:
                    _FUNCTION.apply = _APPLY  # type: ignore[method-assign]
    if drawn:  # through a name imported before the split, or a generator of its own
        raise SplitError(
            f"cannot split {model}: its forward draws Python random numbers (by a name "
            f"imported from random, or a random.Random of its own) at {drawn[0]}, and "
            f"torch.fx runs Python code once, at split time: every call would take the "
            f"branch drawn then; draw from torch instead "
            f"(torch.rand((), device=x.device) < p), or keep that code in a submodule "
            f"split calls whole"
        )


_RANDOM_FILE = random.__file__
_THEIRS = (TORCH_DIR, _HERE)


def _watch_draws(
    drawn: list[str], entry: FrameType, frame: FrameType, event: str, arg: Any
) -> None:
    """A profile function (this thread's, while fx traces): note each Python random draw.

    Every draw of Python's ``random`` (module or ``random.Random`` instance, whatever
    name it was imported under) ends in a method of C of a ``Random``: the ``c_call``
    event names it. Noted at the innermost caller outside ``random.py``, unless that is
    torch's or this library's code, or a module being imported. (NumPy's draws, methods
    compiled by Cython, make no event.)
    """
    if event != "c_call":
        return
    owner, name = getattr(arg, "__self__", None), getattr(arg, "__name__", "")
    if not isinstance(owner, random.Random) or name not in ("random", "getrandbits"):
        return  # (every draw of Python's ends in one of those two)
    caller: FrameType | None = frame
    while caller is not None and caller.f_code.co_filename == _RANDOM_FILE:
        caller = caller.f_back
    if caller is None or caller.f_code.co_filename.startswith(_THEIRS):
        return
    outer: FrameType | None = caller
    while outer is not None and outer is not entry:  # not in an import the trace made
        if outer.f_code.co_filename.startswith("<frozen importlib"):  # (sympy draws)
            return
        outer = outer.f_back
    drawn.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")


def _holds_proxy(value: Any, depth: int = 0) -> fx.Proxy | None:
    if isinstance(value, fx.Proxy):
        return value
    if depth < 4 and isinstance(value, list | tuple | set | frozenset | dict):
        items = value.values() if isinstance(value, dict) else value
        return next((p for v in items if (p := _holds_proxy(v, depth + 1)) is not None), None)
    return None


def _refill(container: Any, contents: Any) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(contents)
    else:
        container.update(contents)


@contextmanager
def stored_values_refused(module: nn.Module) -> Iterator[None]:
    """Put back what a traced forward stored on the modules, and refuse it if it did."""
    kept = {
        m: (
            dict(vars(m)),
            {k: copy.copy(v) for k, v in vars(m).items() if type(v) in (list, dict, set)},
        )
        for m in module.modules()
    }
    stored: list[tuple[str, fx.Proxy]] = []
    try:
        yield
    finally:
        paths = {m: name for name, m in module.named_modules()}
        for m, (attrs, contents) in kept.items():
            for name, value in list(vars(m).items()):
                proxy = _holds_proxy(value)
                if proxy is None:
                    continue
                shown = name
                if name in ("_buffers", "_parameters") and isinstance(value, dict):
                    shown = next(k for k, v in value.items() if _holds_proxy(v) is not None)
                stored.append((f"{paths[m]}.{shown}".lstrip("."), proxy))
                if name not in attrs:
                    del m.__dict__[name]
                elif attrs[name] is value and name in contents:  # changed in place
                    _refill(value, contents[name])
                else:
                    m.__dict__[name] = attrs[name]
    if stored:
        name, proxy = stored[0]
        raise SplitError(
            f"cannot split {type(module).__name__}: its forward stores a value on the "
            f"module (self.{name}{where_made(proxy.node)}); split cannot carry values a "
            f"forward keeps on its modules, and the split model would never set it: return "
            f"it as an output of forward instead (a buffer, such as a running average: "
            f"update it in place, self.{name.rpartition('.')[2]}.mul_(m).add_(...), without "
            f"assigning it), or keep that code in a submodule that split calls whole"
        )


def where_made(node: fx.Node) -> str:
    """Where in the user's code ``node`` was made, as `` (file:line)``, if known."""
    frames = []
    for line in (node.stack_trace or "").splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            if not path.startswith((TORCH_DIR, _HERE)):  # the user's own frames
                frames.append(f"{path}:{rest.split(',')[0]}")
    return f" ({frames[-1]})" if frames else ""


# Refused after tracing: a graph that computes other values than the module.


def captured_as_computed(
    module: nn.Module,
    run_graph: Callable[[], Any],
    again: Callable[[], Any],
    example: Any,
    kind: str,
) -> None:
    """Run the captured graph on ``example``; refuse it where the module computes otherwise.

    ``run_graph`` runs it once (the run whose values ``split`` learns), ``again`` once
    more; then the module itself, on a copy of ``example``: all as they are called (eval
    mode and no grad, the caller's), each with generators of its own seeded alike. fx
    stands a proxy in for each input while it traces, not a tensor, so code that looks
    at an input's type (``isinstance(mask, torch.Tensor)``, ``torch.is_tensor``) takes
    another branch than on tensors, silently; or reads a tensor kept in a module's
    attribute (``self.aux_loss``, which fx keeps as it was). Each run starts from the
    buffers as they were (:func:`kept_buffers`). Not compared: a graph whose two runs
    differ (it draws from what no run's own generators replace: a layer's own generator,
    Python's or NumPy's in a submodule called whole).

    Raises:
        SplitError: an output differs (in number, shape, dtype or beyond rounding).
    """
    with kept_buffers(module), own_generators():
        captured = leaves(run_graph())
    with kept_buffers(module), own_generators():
        if not _all_close(captured, leaves(again())):
            return
    args, kwargs = {"one": ((example,), {}), "args": (tuple(example), {})}.get(kind, ((), example))
    args, kwargs = map_tensors(Tensor.clone, (args, kwargs))  # a forward may change its input
    with kept_buffers(module), own_generators():
        plain = module(*args, **kwargs)
    if not _all_close(captured, leaves(plain)):
        raise SplitError(
            f"cannot split {type(module).__name__}: on the example input the captured "
            f"forward computes other outputs than the module itself. torch.fx stands a "
            f"proxy in for each input while it traces: code that looks at an input's type "
            f"(isinstance(x, torch.Tensor), torch.is_tensor(x)) takes another branch "
            f"there: test for None instead (x is not None). And it keeps a tensor read "
            f"from a module's attribute as it was then (a value a submodule stored on "
            f"itself, self.aux_loss): return it from the submodule instead. Or keep that "
            f"code in a submodule split calls whole (name no split point inside it)"
        )


def _all_close(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(_close(a, b) for a, b in zip(got, want, strict=True))


def leaves(value: Any) -> list[Any]:
    """``value``'s leaves as the pipeline sees them (dataclasses too), else pytree's."""
    try:
        return flatten(value)[0]
    except TypeError:  # an object the pipeline would refuse to carry anyway
        return pytree.tree_leaves(value)


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        try:
            return type(a) is type(b) and (a is b or bool(a == b) or (a != a and b != b))  # NaN
        except Exception:  # no verdict from a value that compares oddly: not a difference
            return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_meta or a.layout != torch.strided:  # no values to compare
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def refuse_lost_state(module: nn.Module, path: str) -> None:
    """Refuse a module whose own state-dict behaviour no stage would keep.

    The model, or a module split cuts inside (a ``Placeholder`` stands for it): its extra
    state, state-dict hooks or state-dict methods of its class (not torch's, of its
    tensors, which the stages hold) would be lost: no stage holds it, only its parts. A
    ``_load_from_state_dict`` of a cut module's class, which converts older checkpoints,
    is refused at a load that needs it (``split_stage._refuse_unconverted``); the model's
    own, here.
    """
    kinds = ("state_dict_", "state_dict_pre_", "load_state_dict_pre_", "load_state_dict_post_")
    what = ["state-dict hooks"] if any(getattr(module, f"_{k}hooks") for k in kinds) else []
    methods = ["get_extra_state", "state_dict", "load_state_dict", "_save_to_state_dict"]
    methods += [] if path else ["_load_from_state_dict"]  # the model's: no stage knows it
    what += [f"its own {name}" for name in methods if own_method(module, name)]
    if what:
        raise SplitError(
            f"{type(module).__name__}{f' at {path!r}' if path else ''} has "
            f"{' and '.join(what)}, which split cannot keep: no stage holds the module, "
            f"only its parts, so the split model's state dict would not be the model's "
            f"(checkpoints would not load both ways); keep that state in a submodule that "
            f"one stage calls whole"
            + (", or split at its boundaries" if path else "")
            + ", or convert checkpoints with the plain model and leave it out"
        )


# The machinery between a forward's line and the tracer's error: not where it failed.
_MACHINERY = (
    os.path.join(TORCH_DIR, "fx", ""),
    os.path.join(TORCH_DIR, "nn", "modules", "module.py"),
    os.path.join(TORCH_DIR, "__init__.py"),
    os.path.join(TORCH_DIR, "_tensor.py"),
    os.path.join(_HERE, "split_capture.py"),
    os.path.join(_HERE, "split_refusals.py"),  # ConstantDraws, around every torch call
)


def trace_failure(module: nn.Module, error: Exception, through: set[str]) -> str:
    """What ``split`` says where torch.fx could not capture ``module``'s forward."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_MACHINERY)
    ]
    where = ""
    if frames:  # the last line run before the tracer's machinery: a forward's
        f = frames[-1]
        where = f" at {f.filename}:{f.lineno} in {f.name} (`{(f.line or '').strip()}`)"
        users = [g for g in frames if not g.filename.startswith(_THEIRS)]
        if f.filename.startswith(TORCH_DIR) and users:  # a function of torch's: from where
            g = users[-1]
            where += f", called at {g.filename}:{g.lineno} (`{(g.line or '').strip()}`)"
    if "control flow" in str(error) or "iterate" in str(error):
        cause = (
            "The likely cause: code that branches on, or loops over, a value made from "
            "the forward's arguments (a tensor's value or size, or an argument given in "
            "example_input, which split traces: a flag given there is traced too; leave "
            "it out so that it keeps its default, or fix it in a wrapper module)"
            + (
                "; an assert on an input's size (`assert t <= block_size`) is one: take "
                "it out of the forward, or check the size before calling the model"
                if "assert" in where
                else ""
            )
        )
    elif "positional argument" in str(error):  # ones() takes 1 positional argument but 2...
        cause = (
            "The likely cause: a factory (torch.ones, zeros, empty, rand, ...) given its "
            "sizes one by one, one of them from a tensor (x.size(1)), which fx captures "
            "only as one tuple: write torch.ones((T, T), ...) for torch.ones(T, T, ...)"
        )
    elif "finfo" in str(error) or "iinfo" in str(error):
        cause = (
            "The likely cause: torch.finfo or torch.iinfo of a traced tensor's dtype "
            "(h.dtype), which fx has as a proxy: name the dtype (torch.finfo(torch.float32)"
            "), or compute the value in a submodule"
        )
    else:
        cause = "The likely cause: code that needs a real value where fx has a proxy"
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # traced through as any
    inside = [(n, module.get_submodule(n)) for n in sorted(through)]
    torchs = [n for n, m in inside if torch_class(m) and not isinstance(m, containers)]
    if frames and frames[-1].filename.startswith(TORCH_DIR) and torchs:
        return (  # torch's own forward, which the user cannot move: no cut inside it
            f"cannot split {type(module).__name__} inside {', '.join(map(repr, torchs))}: "
            f"torch.fx could not capture torch's own forward there{where}: "
            f"{type(error).__name__}: {error}. Put no split point inside "
            f"{'it' if len(torchs) == 1 else 'them'} (cut at its boundaries), or call its "
            f"layers from a forward of your own (a loop over an nn.ModuleList)"
        )
    return (
        f"cannot split {type(module).__name__}: torch.fx could not capture its forward{where}: "
        f"{type(error).__name__}: {error}. {cause}. Move that code into a submodule "
        f"(split runs a submodule as one call, with any control flow), or out of the model"
    )


def torch_class(module: nn.Module) -> bool:
    """Whether ``module`` is of one of torch's own classes (nn.TransformerEncoder, ...)."""
    return type(module).__module__.startswith("torch.")
