"""Random numbers of cells: each cell draws from generators of its own.

What a cell (micro-batch ``i`` on partition ``j``) draws depends only on a seed taken
from the default CPU generator when the forward (or the step) starts, on ``i`` and on
``j``: not on the checkpoint mode, the schedule, how the worker threads interleave, or
what other threads draw. A recomputation draws what the forward drew. Runs repeat under
``torch.manual_seed``.

How: while a cell runs (its forward, and its recomputation in backward), a torch
function mode on the cell's thread gives every random function the cell's own
``torch.Generator`` (one per device, seeded from the cell's seed), as the function's
``generator=`` argument. Forward and recomputation start from the same seed, so they
draw the same numbers. The process-wide generators are never set, only read once per
forward for the seed, so other threads' draws are left as they were::

    forward starts:  seed = draw from torch's default CPU generator
    cell (i, j):     seed_ij = mix(seed, i, j)
                     forward:        torch.rand(...)  ->  torch.rand(..., generator=G_ij)
                     recomputation:  the same calls, on a new G_ij seeded alike

A function mode sees the calls made from Python, not the operators called inside
PyTorch's own C++ code, and costs a Python call per torch function of the cell (not per
operator, and nothing in backward). The functions handled (``random_functions()`` lists
them) are the random factories (``rand``, ``randn``, ``randint``, ``randperm``,
``normal``, ``*_like``), the sampling functions and methods (``bernoulli``,
``multinomial``, ``poisson``, ``rrelu``, ``Tensor.uniform_``, ``normal_``, ``bernoulli_``,
``random_``, ``exponential_``, ``geometric_``, ``cauchy_``, ``log_normal_``), the
``torch.nn.init`` functions, and, rewritten here on top of those because they take no
generator, the dropout family (``F.dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``,
``feature_alpha_dropout`` and their ``torch.*`` forms), ``F.rrelu``,
``F.gumbel_softmax``, ``F.fractional_max_pool2d/3d`` and
``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (its math form, without the
fused kernels). On CUDA, Dropout in a cell therefore runs as ``bernoulli_`` and a
multiply instead of the fused kernel, and keeps its mask in the input's dtype.

What still draws from the default generators, and so holds none of the guarantees above
when several threads draw at once: operators reached from C++ without a Python call of
their own (a custom C++ or Triton kernel that samples, say), and random functions given
an explicit ``generator=``, which keep it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CellRandomness", "cell_seed", "draw_seed", "random_functions"]

_MASK = 2**63 - 1


def draw_seed() -> int:
    """A seed for a forward pass's cells, drawn from the default CPU generator."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def cell_seed(seed: int, i: int, j: int) -> int:
    """The seed of cell ``(i, j)`` (micro-batch, partition) of a run seeded with ``seed``.

    A splitmix64 finalizer over the three numbers: nearby cells get unrelated seeds.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (j << 32) + i) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK


class _CellGenerators(TorchFunctionMode):
    """Hands the cell's own generator to every random function called on this thread."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device | str | int | None) -> torch.Generator:
        """The cell's generator for ``device``, made (and seeded) on first use."""
        device = _resolve(device)
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        if "generator" in kwargs:  # generator=None, as torch.nn.init passes it on
            kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        return handler(self, func, args, kwargs)


class CellRandomness:
    """The random numbers of one cell: its forward and its recomputation draw alike.

    Args:
        seed: the cell's seed (:func:`cell_seed`).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def forward(self) -> _CellGenerators:
        """Enter around the cell's forward."""
        return _CellGenerators(self.seed)

    def replay(self) -> _CellGenerators:
        """Enter around the recomputation: it draws the numbers the forward drew."""
        return _CellGenerators(self.seed)


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


# Handlers: (mode, func, args, kwargs) -> result, for a call without a generator.

Handler = Callable[[_CellGenerators, Any, tuple[Any, ...], dict[str, Any]], Any]


def _on_input(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """A function or method with ``generator=``, drawing on its first tensor's device."""
    tensor = args[0] if args else next(iter(kw.values()))
    return func(*args, **kw, generator=mode.generator(tensor.device))


def _factory(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """A factory with ``generator=``: ``rand``, ``randn``, ``randint``, ``randperm``."""
    return func(*args, **kw, generator=mode.generator(kw.get("device")))


def _normal(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, Tensor)]
    device = tensors[0].device if tensors else kw.get("device")
    return func(*args, **kw, generator=mode.generator(device))


def _like(method: str) -> Handler:
    """``rand_like`` and kin, as an empty tensor filled by ``method`` with the generator."""

    def handler(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        kw = dict(kw)
        source = kw.pop("input") if "input" in kw else args[0]
        rest = list(args[1:])
        low: Any = 0
        high: Any = None
        if method == "random_":  # randint_like(input, high) or (input, low, high)
            high = kw.pop("high") if "high" in kw else rest.pop()
            low = kw.pop("low") if "low" in kw else (rest.pop() if rest else 0)
        grad = kw.pop("requires_grad", False)
        out = torch.empty_like(source, **kw)
        generator = mode.generator(out.device)
        if method == "random_":
            out.random_(int(low), int(high), generator=generator)
        else:
            getattr(out, method)(generator=generator)
        return out.requires_grad_(grad)

    return handler


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


_ALPHA = 1.7580993408473766  # SELU's alpha times its scale: where alpha dropout saturates


def _dropout(
    generator: torch.Generator,
    input: Tensor,
    p: float,
    training: bool,
    inplace: bool,
    *,
    feature: bool = False,
    alpha: bool = False,
) -> Tensor:
    """Dropout with a mask drawn from ``generator``; ``feature`` drops whole channels."""
    _check_p(p)
    if not training or p == 0.0:
        return input
    if feature and input.dim() < 2:
        raise RuntimeError(
            f"feature dropout needs an input of at least 2 dimensions, got {input.dim()}"
        )
    shape = (*input.shape[:2], *[1] * (input.dim() - 2)) if feature else input.shape
    if p == 1.0:
        zeros = input.new_zeros(shape)
        return input.mul_(zeros) if inplace else input * zeros
    noise = input.new_empty(shape).bernoulli_(1.0 - p, generator=generator)
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
        shift = noise.add(-1.0).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return input.mul_(noise).add_(shift) if inplace else input * noise + shift
    noise.div_(1.0 - p)
    return input.mul_(noise) if inplace else input * noise


def _dropout_handler(*, feature: bool, alpha: bool, unbatched: int | None = None) -> Handler:
    """``F.dropout`` and kin: ``(input, p=0.5, training=True, inplace=False)``."""

    def handler(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        bound = _bind(("input", "p", "training", "inplace"), (None, 0.5, True, False), args, kw)
        input = bound["input"]
        lone = unbatched is not None and input.dim() == unbatched
        x = input.unsqueeze(0) if lone else input
        out = _dropout(
            mode.generator(input.device),
            x,
            float(bound["p"]),
            bool(bound["training"]),
            bool(bound["inplace"]),
            feature=feature,
            alpha=alpha,
        )
        return out.squeeze(0) if lone else out

    return handler


def _torch_dropout_handler(*, feature: bool, alpha: bool, inplace: bool) -> Handler:
    """``torch.dropout(input, p, train)`` and kin, the forms under ``F.dropout``."""

    def handler(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        bound = _bind(("input", "p", "train"), (None, None, None), args, kw)
        input = bound["input"]
        return _dropout(
            mode.generator(input.device),
            input,
            float(bound["p"]),
            bool(bound["train"]),
            inplace,
            feature=feature,
            alpha=alpha,
        )

    return handler


def _rrelu(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``F.rrelu``, as ``torch.rrelu`` (which takes a generator)."""
    names = ("input", "lower", "upper", "training", "inplace")
    bound = _bind(names, (None, 1.0 / 8, 1.0 / 3, False, False), args, kw)
    input: Tensor = bound["input"]
    call = torch.rrelu_ if bound["inplace"] else torch.rrelu
    return call(
        input,
        float(bound["lower"]),
        float(bound["upper"]),
        bool(bound["training"]),
        generator=mode.generator(input.device),
    )


def _gumbel_softmax(
    mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    names = ("logits", "tau", "hard", "eps", "dim")
    bound = _bind(names, (None, 1.0, False, 1e-10, -1), args, kw)
    logits: Tensor = bound["logits"]
    dim = int(bound["dim"])
    noise = torch.empty_like(logits).exponential_(generator=mode.generator(logits.device))
    soft = ((logits - noise.log()) / bound["tau"]).softmax(dim)
    if not bound["hard"]:
        return soft
    index = soft.argmax(dim, keepdim=True)
    hard = torch.zeros_like(logits).scatter_(dim, index, 1.0)
    return hard - soft.detach() + soft


def _fractional_max_pool(spatial: int) -> Handler:
    """``F.fractional_max_pool2d/3d``: the random samples drawn from the cell's generator."""

    def handler(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if kw.get("_random_samples") is not None or len(args) > 6:
            return func(*args, **kw)
        input: Tensor = args[0] if args else kw["input"]
        batch = 1 if input.dim() == spatial + 1 else input.size(0)
        samples = torch.rand(
            batch,
            input.size(-spatial - 1),
            spatial,
            dtype=input.dtype,
            device=input.device,
            generator=mode.generator(input.device),
        )
        return func(*args, **{**kw, "_random_samples": samples})

    return handler


def _attention(mode: _CellGenerators, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention``; with ``dropout_p > 0``, its math form."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = _bind(names, (None, None, None, None, 0.0, False, None, False), args, kw)
    p = float(bound["dropout_p"])
    if p == 0.0:
        return func(*args, **kw)
    query, key, value = bound["query"], bound["key"], bound["value"]
    if bound["enable_gqa"]:
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = bound["scale"] if bound["scale"] is not None else 1.0 / math.sqrt(query.size(-1))
    scores = query @ key.transpose(-2, -1) * scale
    length, source = query.size(-2), key.size(-2)
    if bound["is_causal"]:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    mask = bound["attn_mask"]
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else (scores + mask)
        )
    weights = _dropout(mode.generator(query.device), scores.softmax(-1), p, True, False)
    return weights @ value


def _bind(
    names: tuple[str, ...], defaults: tuple[Any, ...], args: tuple[Any, ...], kw: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of a call by name, with the defaults for those not given."""
    bound = dict(zip(names, defaults, strict=True))
    bound.update(zip(names, args, strict=False))
    bound.update(kw)
    return bound


def _has_generator(func: Any) -> bool:
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


def _handlers() -> dict[Any, tuple[str, Handler]]:
    """Every function handled, with its name as users write it and its handler."""
    table: dict[Any, tuple[str, Handler]] = {}

    def add(owner: Any, prefix: str, names: tuple[str, ...], handler: Handler) -> None:
        for name in names:
            table[getattr(owner, name)] = (f"{prefix}.{name}", handler)

    add(torch, "torch", ("rand", "randn", "randint", "randperm"), _factory)
    add(torch, "torch", ("normal",), _normal)
    add(torch, "torch", ("bernoulli", "multinomial", "poisson", "rrelu", "rrelu_"), _on_input)
    methods = (
        "uniform_",
        "normal_",
        "bernoulli_",
        "bernoulli",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "multinomial",
    )
    add(Tensor, "Tensor", methods, _on_input)
    inits: tuple[str, ...] = (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "orthogonal_",
        "sparse_",
    )
    inits = tuple(name for name in inits if _has_generator(getattr(torch.nn.init, name)))
    add(torch.nn.init, "torch.nn.init", inits, _on_input)  # torch >= 2.3 takes generators
    add(torch, "torch", ("rand_like",), _like("uniform_"))
    add(torch, "torch", ("randn_like",), _like("normal_"))
    add(torch, "torch", ("randint_like",), _like("random_"))
    functional = "torch.nn.functional"
    add(F, functional, ("dropout",), _dropout_handler(feature=False, alpha=False))
    add(F, functional, ("alpha_dropout",), _dropout_handler(feature=False, alpha=True))
    add(F, functional, ("dropout1d",), _dropout_handler(feature=True, alpha=False, unbatched=2))
    add(F, functional, ("dropout2d",), _dropout_handler(feature=True, alpha=False))
    add(F, functional, ("dropout3d",), _dropout_handler(feature=True, alpha=False, unbatched=4))
    add(F, functional, ("feature_alpha_dropout",), _dropout_handler(feature=True, alpha=True))
    for feature, alpha, name in (
        (False, False, "dropout"),
        (True, False, "feature_dropout"),
        (False, True, "alpha_dropout"),
        (True, True, "feature_alpha_dropout"),
    ):
        add(
            torch,
            "torch",
            (name,),
            _torch_dropout_handler(feature=feature, alpha=alpha, inplace=False),
        )
        add(
            torch,
            "torch",
            (name + "_",),
            _torch_dropout_handler(feature=feature, alpha=alpha, inplace=True),
        )
    add(F, functional, ("rrelu",), _rrelu)
    add(F, functional, ("gumbel_softmax",), _gumbel_softmax)
    add(
        F,
        functional,
        ("fractional_max_pool2d", "fractional_max_pool2d_with_indices"),
        _fractional_max_pool(2),
    )
    add(
        F,
        functional,
        ("fractional_max_pool3d", "fractional_max_pool3d_with_indices"),
        _fractional_max_pool(3),
    )
    add(F, functional, ("scaled_dot_product_attention",), _attention)
    return table


_TABLE = _handlers()
_HANDLERS = {func: handler for func, (_, handler) in _TABLE.items()}


def random_functions() -> list[str]:
    """The names of the functions that draw from a cell's generators inside a pipeline."""
    return sorted(name for name, _ in _TABLE.values())
