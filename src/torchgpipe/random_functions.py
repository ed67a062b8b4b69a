"""Torch's random functions, each called with a cell's generator: the table ``rng.py`` uses.

A handler gets the cell's draws (:class:`Draws`), the function and a call's arguments
(made without a generator), and returns what the function would. Functions that take
``generator=`` get it. Those that take none are rewritten on top of ones that do (the
dropout family, ``rrelu``, ``gumbel_softmax``, ``fractional_max_pool``, attention
dropout), or, where they are C++ or too long to rewrite (multi-head attention, the
recurrent layers), run with :meth:`Draws.operators` on, which hands the generators to
the random operators inside them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["GENERATOR_AT", "HANDLERS", "NAMES", "Draws", "Handler", "native_dropout"]


class Draws(Protocol):
    """Where a cell's random numbers come from."""

    def generator(self, device: torch.device | str | int | None) -> torch.Generator | None:
        """The cell's generator for ``device`` (None on the meta device, which draws nothing)."""

    def operators(self) -> AbstractContextManager[Any]:
        """A scope in which random operators reached from C++ draw from the cell too."""


Handler = Callable[[Draws, Any, tuple[Any, ...], dict[str, Any]], Any]


def _with(kw: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
    return kw if generator is None else {**kw, "generator": generator}


def _first_tensor(args: tuple[Any, ...], kw: dict[str, Any]) -> Tensor:
    for value in (*args, kw.get("input"), kw.get("self"), *kw.values()):
        if isinstance(value, Tensor):
            return value
    raise TypeError("a random function called without a tensor to draw for")


def _on_input(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """A function or method with ``generator=``, drawing on its tensor's device."""
    return func(*args, **_with(kw, draws.generator(_first_tensor(args, kw).device)))


def _factory(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """A factory with ``generator=``: ``rand``, ``randn``, ``randint``, ``randperm``."""
    out = kw.get("out")
    device = out.device if isinstance(out, Tensor) else kw.get("device")
    return func(*args, **_with(kw, draws.generator(device)))


def _normal(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, Tensor)]
    device = tensors[0].device if tensors else kw.get("device")
    return func(*args, **_with(kw, draws.generator(device)))


def _like(method: str) -> Handler:
    """``rand_like`` and kin, as an empty tensor filled by ``method`` with the generator."""

    def handler(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
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
        more = _with({}, draws.generator(out.device))
        if method == "random_":
            out.random_(int(low), int(high), **more)
        else:
            getattr(out, method)(**more)
        # Only where asked: under torch.func's transforms requires_grad_ raises at all.
        return out.requires_grad_(True) if grad else out

    return handler


# The dropout family.

_ALPHA = 1.7580993408473766  # SELU's alpha times its scale: where alpha dropout saturates


def _dropout(
    generator: torch.Generator | None,
    input: Tensor,
    p: float,
    training: bool,
    inplace: bool,
    *,
    feature: bool = False,
    alpha: bool = False,
    error: type[Exception] = ValueError,
) -> Tensor:
    """Dropout with a mask drawn from ``generator``; ``feature`` drops whole channels."""
    if not 0.0 <= p <= 1.0:
        raise error(f"dropout probability has to be between 0 and 1, but got {p}")
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
    noise = input.new_empty(shape).bernoulli_(1.0 - p, **_with({}, generator))
    if alpha:
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
        shift = noise.add(-1.0).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return input.mul_(noise).add_(shift) if inplace else input * noise + shift
    if input.device.type == "cuda" and not (inplace or feature):
        # As CUDA's fused dropout, which torch uses for this case alone: the scale
        # applied in float, one rounding (the other cases divide the mask in the input's
        # dtype, as below, on CUDA too).
        scale = 1.0 / (1.0 - p)
        return input.mul_(noise).mul_(scale) if inplace else input * noise * scale
    noise.div_(1.0 - p)  # as torch's unfused dropout, to the bit
    return input.mul_(noise) if inplace else input * noise


def native_dropout(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``torch.native_dropout(input, p, train)``: the output and the mask, drawn by ``draws``.

    The operator takes no generator. The function mode's table and, below autograd, the
    dispatch mode (``native_dropout`` reached from C++) both call this handler.
    """
    values = dict(zip(("input", "p", "train"), args, strict=False)) | kw
    input: Tensor = values["input"]
    p, train = float(values["p"]), values.get("train")
    if train is False or p == 0.0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    generator = draws.generator(input.device)
    mask = torch.empty_like(input, dtype=torch.bool).bernoulli_(1.0 - p, **_with({}, generator))
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return input * mask * scale, mask


def _dropout_handler(*, feature: bool, alpha: bool, batched: int | None = None) -> Handler:
    """``F.dropout`` and kin: ``(input, p=0.5, training=True, inplace=False)``.

    ``batched``: the number of dimensions of a batched input of a feature dropout that
    adds a batch dimension to any other (``dropout1d``: 3, ``dropout3d``: 5).
    """

    def handler(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        bound = _bind(func, args, kw)
        input: Tensor = bound["input"]
        if func is F.dropout1d and input.dim() not in (2, 3):
            raise RuntimeError(
                f"dropout1d: Expected 2D or 3D input, but received a {input.dim()}D input; "
                f"give it (N, C, L) or (C, L)"
            )
        lone = batched is not None and input.dim() != batched
        x = input.unsqueeze(0) if lone else input
        inplace = bool(bound["inplace"])
        out = _dropout(
            draws.generator(input.device),
            x,
            float(bound["p"]),
            bool(bound["training"]),
            inplace,
            feature=feature,
            alpha=alpha,
        )
        if inplace:
            return input
        return out.squeeze(0) if lone else out

    return handler


def _torch_dropout_handler(*, feature: bool, alpha: bool, inplace: bool) -> Handler:
    """``torch.dropout(input, p, train)`` and kin, the forms under ``F.dropout``."""

    def handler(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        values = dict(zip(("input", "p", "train"), args, strict=False)) | kw
        input: Tensor = values["input"]
        return _dropout(
            draws.generator(input.device),
            input,
            float(values["p"]),
            bool(values["train"]),
            inplace,
            feature=feature,
            alpha=alpha,
            error=RuntimeError,
        )

    return handler


# Other functions that take no generator.


def _rrelu(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``F.rrelu``, as ``torch.rrelu`` (which takes a generator)."""
    bound = _bind(func, args, kw)
    input: Tensor = bound["input"]
    call = torch.rrelu_ if bound["inplace"] else torch.rrelu
    more = _with({}, draws.generator(input.device))
    return call(
        input, float(bound["lower"]), float(bound["upper"]), bool(bound["training"]), **more
    )


def _gumbel_softmax(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    bound = _bind(func, args, kw)
    logits: Tensor = bound["logits"]
    dim = int(bound["dim"])
    noise = torch.empty_like(logits, memory_format=torch.legacy_contiguous_format)
    noise.exponential_(**_with({}, draws.generator(logits.device)))
    soft = ((logits - noise.log()) / bound["tau"]).softmax(dim)
    if not bound["hard"]:
        return soft
    index = soft.argmax(dim, keepdim=True)
    hard = torch.zeros_like(logits, memory_format=torch.legacy_contiguous_format)
    return hard.scatter_(dim, index, 1.0) - soft.detach() + soft


def _fractional_max_pool(spatial: int) -> Handler:
    """``F.fractional_max_pool2d/3d``: the random samples drawn from the cell's generator."""

    def handler(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if kw.get("_random_samples") is not None or len(args) > 6:
            return func(*args, **kw)
        input = _first_tensor(args, kw)
        batch = 1 if input.dim() == spatial + 1 else input.size(0)
        more = _with({}, draws.generator(input.device))
        samples = torch.rand(
            batch, input.size(-spatial - 1), spatial, dtype=input.dtype, device=input.device, **more
        )
        return func(*args, **{**kw, "_random_samples": samples})

    return handler


def _attention(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention``; with ``dropout_p > 0``, its math form."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    values = dict(zip(names, args, strict=False)) | kw
    p = float(values.get("dropout_p", 0.0))
    if p <= 0.0:
        return func(*args, **kw)
    query, key, value = values["query"], values["key"], values["value"]
    mask, causal = values.get("attn_mask"), bool(values.get("is_causal", False))
    if causal and mask is not None:
        raise RuntimeError(
            "scaled_dot_product_attention: an explicit attn_mask should not be given when "
            "is_causal=True"
        )
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise RuntimeError(
            f"scaled_dot_product_attention: attn_mask must be bool or floating, got {mask.dtype}"
        )
    if values.get("enable_gqa", False):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = values.get("scale")
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    # Scores and softmax in float32 at least, as PyTorch's own math path keeps them.
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(dtype) @ key.to(dtype).transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device)
        mask = mask.tril()
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else scores + mask.to(dtype)
        )
    weights = scores.softmax(-1)
    # A row masked whole attends to nothing: zeros, not NaN, as PyTorch gives.
    weights = weights.masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
    weights = _dropout(draws.generator(query.device), weights, p, True, False)
    return (weights @ value.to(dtype)).to(query.dtype)


# Functions too long to rewrite, whose random operators are reached from C++.


def _multi_head_attention(
    draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """``F.multi_head_attention_forward``: with dropout, its weights path, operators on.

    Without weights it would run the fused attention kernels, whose dropout takes no
    generator; with them it drops out the explicit weights through ``F.dropout``.
    """
    bound = _bind(func, args, kw)
    if not bound["training"] or float(bound["dropout_p"]) <= 0.0:
        return func(*args, **kw)
    wanted = bool(bound["need_weights"])
    with draws.operators():
        output, weights = func(**{**bound, "need_weights": True})
    return output, (weights if wanted else None)


def _recurrent(draws: Draws, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``: dropout between layers.

    Their flags follow the weights: ``has_biases, num_layers, dropout, train``.
    """
    flags = [k for k, a in enumerate(args) if isinstance(a, bool)]
    if flags and len(args) > flags[0] + 3:
        dropout, train = args[flags[0] + 2], args[flags[0] + 3]
        if not (train and dropout > 0):
            return func(*args, **kw)
    with draws.operators():
        return func(*args, **kw)


def _bind(func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
    """A Python function's arguments by name, with its defaults for those not given."""
    bound = _SIGNATURES[func].bind(*args, **kw)
    bound.apply_defaults()
    return dict(bound.arguments)


def _has_generator(func: Any) -> bool:
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


def _table() -> dict[Any, tuple[str, Handler]]:
    """Every function handled, with its name as users write it and its handler."""
    table: dict[Any, tuple[str, Handler]] = {}

    def add(owner: Any, prefix: str, names: tuple[str, ...], handler: Handler) -> None:
        for name in names:
            if hasattr(owner, name):
                table[getattr(owner, name)] = (f"{prefix}.{name}", handler)

    add(torch, "torch", ("rand", "randn", "randint", "randperm"), _factory)
    add(torch, "torch", ("normal",), _normal)
    samplers = (
        "bernoulli",
        "multinomial",
        "poisson",
        "binomial",
        "_standard_gamma",
        "_sample_dirichlet",
        "rrelu",
        "rrelu_",
    )
    add(torch, "torch", samplers, _on_input)
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
    init = torch.nn.init
    # torch >= 2.3 gives them a generator argument.
    inits = tuple(name for name in inits if _has_generator(getattr(init, name)))
    add(init, "torch.nn.init", inits, _on_input)
    add(torch, "torch", ("rand_like",), _like("uniform_"))
    add(torch, "torch", ("randn_like",), _like("normal_"))
    add(torch, "torch", ("randint_like",), _like("random_"))
    nn_f = "torch.nn.functional"
    add(F, nn_f, ("dropout",), _dropout_handler(feature=False, alpha=False))
    add(F, nn_f, ("alpha_dropout",), _dropout_handler(feature=False, alpha=True))
    add(F, nn_f, ("dropout1d",), _dropout_handler(feature=True, alpha=False, batched=3))
    add(F, nn_f, ("dropout2d",), _dropout_handler(feature=True, alpha=False))
    add(F, nn_f, ("dropout3d",), _dropout_handler(feature=True, alpha=False, batched=5))
    add(F, nn_f, ("feature_alpha_dropout",), _dropout_handler(feature=True, alpha=True))
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
    add(torch, "torch", ("native_dropout",), native_dropout)
    add(F, nn_f, ("rrelu",), _rrelu)
    add(F, nn_f, ("gumbel_softmax",), _gumbel_softmax)
    add(
        F,
        nn_f,
        ("fractional_max_pool2d", "fractional_max_pool2d_with_indices"),
        _fractional_max_pool(2),
    )
    add(
        F,
        nn_f,
        ("fractional_max_pool3d", "fractional_max_pool3d_with_indices"),
        _fractional_max_pool(3),
    )
    add(F, nn_f, ("scaled_dot_product_attention",), _attention)
    add(F, nn_f, ("multi_head_attention_forward",), _multi_head_attention)
    add(torch, "torch", ("lstm", "gru", "rnn_tanh", "rnn_relu"), _recurrent)
    return table


_TABLE = _table()
_SIGNATURES = {
    func: inspect.signature(func)
    for func in _TABLE
    if inspect.isfunction(func) and getattr(func, "__module__", "").startswith("torch.nn")
}
HANDLERS: dict[Any, Handler] = {func: handler for func, (_, handler) in _TABLE.items()}
"""What each function handled is called as, in a cell."""

NAMES: tuple[str, ...] = tuple(sorted(name for name, _ in _TABLE.values()))
"""The names of the functions handled, as users write them."""

# torch's samplers that take their generator as their last positional argument, where:
# builtins, whose signatures Python cannot read.
_BUILTIN_GENERATOR_AT = {
    "poisson": 1,
    "binomial": 2,
    "_standard_gamma": 1,
    "_sample_dirichlet": 1,
    "rrelu": 4,
    "rrelu_": 4,
}


def _generator_at(func: Any) -> int | None:
    name = getattr(func, "__name__", "")
    if func is getattr(torch, name, None):
        return _BUILTIN_GENERATOR_AT.get(name)
    try:
        names = [
            name
            for name, p in inspect.signature(func).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a method of Tensor: its generator is keyword-only
        return None
    return names.index("generator") if names[-1:] == ["generator"] else None


GENERATOR_AT: dict[Any, int] = {
    func: at for func in _TABLE if (at := _generator_at(func)) is not None
}
"""Where a function handled may take its generator positionally (its last argument)."""
