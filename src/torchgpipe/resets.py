"""The resets (or ``init``) of a layer just allocated, and the check that they filled it.

:mod:`torchgpipe.materialize` trusts no reset, nor ``init``, blindly: each tensor a
fill is to fill is marked first (NaN; a pattern for integers), and one the fill left
marked, wholly or in part, is refused once it ran (:func:`reset`, :func:`initialize`).
Which tensors a reset is to fill is decided before, from the layer's modules: a
tensor's holders (:func:`tensor_holders`), a reset above one of them (:func:`under`),
and the hooks that keep values where no reset writes (:func:`legacy_hooks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from torchgpipe.mailbox import add_note

__all__ = [
    "Holder",
    "initialize",
    "join",
    "legacy_hooks",
    "own_tensors",
    "reset",
    "reset_of",
    "tensor_holders",
    "under",
]

Holder = tuple[int, nn.Module, str]
"""The ``id`` of a meta tensor, and a module that holds it under a name of its own."""


def own_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors ``module`` holds itself, parameters and buffers, by name."""
    tables = (module._parameters, module._buffers)
    return [(n, t) for table in tables for n, t in table.items() if t is not None]


def reset(
    layer: nn.Module,
    held: list[Holder],
    watched: dict[int, tuple[int, Tensor]],
    prefix: str,
    *,
    loading: bool = False,
) -> None:
    """Reset the modules of ``layer``, children first, but those filled before; then tie.

    ``held``: the layer's holders before allocation (``materialize``'s ``_holders``);
    ``watched``: the meta tensors a reset is to fill (``Fill.watched``);
    ``prefix``: what the layer's keys start with in the model's, for errors;
    ``loading``: a state dict loads the rest, so only the modules above a watched
    tensor reset (a buffer no state dict holds): a reset costs time, and may need
    arguments that only the model's constructor gave it.

    Allocation gave each holder of a tensor tied inside the layer (a head and an
    embedding, a module and its parent) one of its own, and each module's reset fills
    its own, as the plain model's constructors did. Then every holder takes the tensor
    of the first holder that a reset filled: the first holder's, as ``head.weight =
    embedding.weight`` keeps the embedding's, unless nothing filled it (a parent that
    holds its child's weight and has no reset).

    A module whose tensors were all real already (one an earlier layer of the partition
    holds too, allocated and filled with it) is not reset again, and the resets that
    run cannot change the tensors that were real before: their values are kept and put
    back, as the earlier layer left them (:func:`_fill`).

    Each watched tensor is first marked: NaN when floating (both parts when complex), a
    pattern along the tensor for integers and booleans (:func:`_patterns`). A holder's
    tensor counts as filled when a reset replaced it, or holds no NaN (floating). An
    ``int64`` one must hold no element equal to its mark (marks near the lowest value,
    which no reset plausibly writes), unless it is one value all over (what a reset
    wrote everywhere may be some element's mark). Then, and for booleans and the other
    integers, whose marks are plausible values, a reset that wrote the tensor in place
    (its version counter) or through ``.data`` (its storage) counts, as does any
    element other than its mark: there, a tensor filled only in part passes, and a
    one-element tensor written its mark through ``.data`` is refused.

    Raises:
        ValueError: no reset filled a watched tensor, wholly, in any of its holders.
    """
    before = _filled_before(layer, held)
    modules = [m for _, m in _children_first(layer, "") if id(m) not in before and reset_of(m)]
    if loading:
        mine = {id(m) for key, m, _ in held if watched.get(key, (None,))[0] == id(layer)}
        modules = [m for m in modules if any(id(below) in mine for below in m.modules())]

    def run() -> None:
        for module in modules:
            reset = reset_of(module)
            assert reset is not None  # chosen for having one
            try:
                reset()
            except Exception as error:  # the model is put back whole; say whose reset
                add_note(
                    error,
                    f"torchgpipe: raised by reset_parameters() of {type(module).__name__} "
                    f"in layer {_where(layer, prefix)}, which filling a meta model calls "
                    f"without arguments; "
                    + (
                        "it fills a tensor no state dict holds (a persistent=False "
                        "buffer): pass init= to fill that layer instead"
                        if loading
                        else "pass init= or state_dict= to fill that layer"
                    ),
                )
                raise

    left = _fill(layer, held, watched, run, modules, prefix)
    if left:
        where = _where(layer, prefix)
        raise ValueError(
            f"layer {where}: reset_parameters() left {', '.join(left)} as allocated "
            f"(uninitialized memory, wholly or in part): fill it in the reset of the "
            f"module that holds it, or pass init= or a state dict holding it, or build "
            f"that layer outside the meta device"
        )


def initialize(
    layer: nn.Module,
    held: list[Holder],
    watched: dict[int, tuple[int, Tensor]],
    prefix: str,
    init: Callable[[nn.Module], object],
) -> None:
    """Fill ``layer`` by ``init(layer)``, and check that it filled what it must.

    ``watched``: every tensor ``init`` must fill (``Fill.watched``: all of the layer's
    but a tie's later holders and empty ones), marked before and checked after, as
    :func:`reset` does; the tensors real before (a module an earlier layer holds too)
    keep the values that layer gave them, whatever ``init`` writes to them.

    Raises:
        ValueError: ``init`` left a watched tensor unfilled, wholly or in part.
    """
    try:
        left = _fill(layer, held, watched, lambda: init(layer), [layer], prefix)
    except Exception as error:  # the model is put back whole; say what init was given
        where = _where(layer, prefix)
        add_note(
            error,
            f"torchgpipe: raised by init(layer) on layer {where} ({type(layer).__name__}): "
            f"init is given a whole layer, not a tensor (for a tensor initializer: "
            f"def init(layer): for p in layer.parameters(): nn.init.normal_(p))",
        )
        raise
    if left:
        where = _where(layer, prefix)
        raise ValueError(
            f"layer {where}: init left {', '.join(left)} as allocated (uninitialized "
            f"memory, wholly or in part), and init(layer) must fill every parameter and "
            f"buffer of the layer it is given: fill them there (a batch norm's running "
            f"statistics too: call layer.reset_running_stats(), or layer."
            f"reset_parameters(), in init), or pass state_dict= holding them instead"
        )


def _where(layer: nn.Module, prefix: str) -> str:
    """``layer`` as errors name it: its key prefix in the model, else its type."""
    return prefix.removesuffix(".") or type(layer).__name__


def _fill(
    layer: nn.Module,
    held: list[Holder],
    watched: dict[int, tuple[int, Tensor]],
    run: Callable[[], object],
    reached: list[nn.Module],
    prefix: str,
) -> list[str]:
    """Mark what ``layer`` must fill, ``run`` the fill, and tie what it ties.

    ``reached``: the modules ``run`` may write under; the tensors there that were real
    before (not in ``held``) get their values back once it ran. Returns the keys of
    the watched tensors it left marked (:func:`reset` says when a tensor counts as
    filled); every other holder takes the tensor of its first that is filled.
    """
    paths: dict[int, str] = {}
    for path, module in layer.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    groups: dict[int, list[_Mark]] = {}  # a meta tensor's id: a mark per holder
    for key, module, name in held:
        tensor = _slot(module, name)
        assert tensor is not None  # a holder holds a tensor
        mine = key in watched and watched[key][0] == id(layer) and _markable(tensor.dtype)
        shown = prefix + join(paths[id(module)], name)
        groups.setdefault(key, []).append(_Mark(tensor, module, name, shown, mine))
    for mark in {id(m.tensor): m for group in groups.values() for m in group}.values():
        if mark.watched:
            _mark(mark.tensor)
    for group in groups.values():  # once every tensor is marked: versions as they are now
        for mark in group:
            mark.version, mark.pointer = mark.tensor._version, mark.tensor.data_ptr()
    restore = _keep(reached, held)
    run()
    restore()
    left = []
    for group in groups.values():
        kept = next((mark.now() for mark in group if not mark.watched or mark.filled()), None)
        if kept is None:
            left.append(group[0].shown)
            continue
        for mark in group:
            _table(mark.module, mark.name)[mark.name] = kept
    return left


def _filled_before(layer: nn.Module, held: list[Holder]) -> set[int]:
    """The ``id`` of each module of ``layer`` whose tensors, in and under it, were all real.

    Real before allocation (none in ``held``): an earlier layer of the partition holds
    the module too, and filled them. A module with no tensor at all is not among them:
    its reset runs, as it always did.
    """
    fresh = {(id(module), name) for _, module, name in held}
    found: set[int] = set()

    def visit(module: nn.Module) -> tuple[bool, bool]:  # holds a tensor; a fresh one
        below = [visit(child) for child in module.children()]
        mine = [(id(module), name) in fresh for name, _ in own_tensors(module)]
        tensors = bool(mine) or any(t for t, _ in below)
        new = any(mine) or any(f for _, f in below)
        if tensors and not new:
            found.add(id(module))
        return tensors, new

    visit(layer)
    return found


def _keep(reached: list[nn.Module], held: list[Holder]) -> Callable[[], None]:
    """Keep the tensors under ``reached`` that ``held`` does not hold: real already.

    An earlier layer of the partition allocated and filled them (a module two layers
    hold). Returns what puts each back in its holder, with the values it has now: the
    copies cost their memory while a layer is filled, and only where a later layer
    reaches a module an earlier one holds.
    """
    fresh = {(id(module), name) for _, module, name in held}
    slots = {
        (id(module), name): (module, name, tensor)
        for top in reached
        for module in top.modules()
        for name, tensor in own_tensors(module)
        if (id(module), name) not in fresh
    }
    values = {id(tensor): tensor.detach().clone() for _, _, tensor in slots.values()}

    def restore() -> None:
        for module, name, tensor in slots.values():
            _table(module, name)[name] = tensor
            tensor.detach().copy_(values[id(tensor)])

    return restore


def _table(module: nn.Module, name: str) -> dict[str, Tensor]:
    """Where ``module`` holds ``name``: its parameters, or else its buffers."""
    table = module._parameters if name in module._parameters else module._buffers
    return table  # type: ignore[return-value]  # None entries are never asked for


def _slot(module: nn.Module, name: str) -> Tensor | None:
    """The tensor ``module`` holds as ``name``, a parameter or a buffer."""
    found = module._parameters.get(name)
    return module._buffers.get(name) if found is None else found


@dataclass
class _Mark:
    """A holder's tensor, marked (when ``watched``) before the fill ran."""

    tensor: Tensor
    module: nn.Module
    name: str
    shown: str  # its key, for errors
    watched: bool
    version: int = 0
    pointer: int = 0

    def now(self) -> Tensor:
        """The tensor the holder holds now (a reset may have replaced it)."""
        tensor = _slot(self.module, self.name)
        assert tensor is not None  # a reset replaces a tensor, it does not drop it
        return tensor

    def filled(self) -> bool:
        """Whether a reset replaced the tensor, or wrote all of it (see :func:`reset`)."""
        if self.now() is not self.tensor:
            return True
        tensor = self.tensor.detach()
        if tensor.is_floating_point() or tensor.is_complex():
            return not any(bool(part.isnan().any()) for part in _pieces(tensor))
        dtype, count = tensor.dtype, tensor.numel()
        if _implausible(dtype):
            # A mark left anywhere is a hole, unless the tensor is one value all over
            # (a reset that wrote it everywhere, where it is some element's mark).
            pieces = zip(_pieces(tensor), _patterns(dtype, count), strict=True)
            if not any(bool((part == mark).any()) for part, mark in pieces):
                return True
            if count > 1:
                first = next(_pieces(tensor))[:1]
                return all(bool((part == first).all()) for part in _pieces(tensor))
            # One element, its mark: told from a reset that wrote that value by the write.
        if tensor._version != self.version or tensor.data_ptr() != self.pointer:
            return True
        pieces = zip(_pieces(tensor), _patterns(dtype, count), strict=True)
        return not all(bool((part == mark).all()) for part, mark in pieces)


def _pieces(tensor: Tensor) -> Iterator[Tensor]:
    """``tensor``'s elements in row-major order, :data:`_PIECE` at a time (bounded)."""
    count = tensor.numel()
    for start in range(0, count, _PIECE):
        if tensor.is_contiguous():
            yield tensor.view(-1)[start : start + _PIECE]
        else:  # not laid out in one piece: each element by its place
            index = torch.arange(start, min(start + _PIECE, count))
            yield tensor[torch.unravel_index(index, tensor.shape)]


_PIECE = 1 << 20  # elements looked at a time: a bounded temporary (1 MiB), whatever the tensor
_PERIOD = 4093  # a wide integer's marks: that many values near its lowest


def _patterns(dtype: torch.dtype, count: int) -> Iterator[Tensor]:
    """The mark of an integer or boolean tensor of ``count`` elements, piece by piece.

    A pattern that varies along the tensor, so that a reset writing one value all over
    (0, a mask of ``True``, the lowest integer as minus infinity) differs from it
    somewhere (but where it has one element): booleans alternate from ``True``; unsigned
    integers count down from their highest value; signed ones count up from two above
    their lowest (the lowest, and minus the highest, are values resets write), by
    :data:`_PERIOD` values for wide ones.
    """
    for start in range(0, count, _PIECE):
        index = torch.arange(start, min(start + _PIECE, count), dtype=torch.int64)
        if dtype == torch.bool:
            yield index % 2 == 0
            continue
        info = torch.iinfo(dtype)
        period = min(_PERIOD, info.max - info.min)
        if info.min == 0:
            yield (info.max - index % period).to(dtype)
        else:  # not the lowest, nor one above (minus the highest): values resets write
            yield (info.min + 2 + index % period).to(dtype)


def _implausible(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s marks are no plausible values: ``int64``'s, near its lowest.

    A narrower dtype's may well be what a reset wrote (a mask, a byte; a random fill of
    a large ``int16`` or ``int32`` tensor meets some of them).
    """
    return dtype == torch.int64


@functools.cache
def _markable(dtype: torch.dtype) -> bool:
    """Whether :func:`_mark` and its check work for ``dtype`` (not quantized...)."""
    probe = torch.empty(1, dtype=dtype)
    try:
        _mark(probe)
        if probe.is_floating_point() or probe.is_complex():
            return bool(probe.isnan().all())
        return bool((probe == next(_patterns(dtype, 1))).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False  # left to its reset, unchecked


def _mark(tensor: Tensor) -> None:
    """Fill ``tensor`` with what no reset is likely to write (see :func:`reset`)."""
    if tensor.is_complex():
        tensor.data.fill_(complex(math.nan, math.nan))  # a reset may write one part only
    elif tensor.is_floating_point():
        tensor.data.fill_(math.nan)
    else:
        data = tensor.data
        if data.dtype in _SIGNED:  # index_put is not there for wide unsigned: their bits
            data = data.view(_SIGNED[data.dtype])
        for k, mark in enumerate(_patterns(tensor.dtype, tensor.numel())):
            mark = mark.view(data.dtype)
            if data.is_contiguous():
                data.view(-1)[k * _PIECE : k * _PIECE + mark.numel()] = mark
            else:  # not laid out in one piece: by each element's place, in row-major order
                index = torch.arange(k * _PIECE, k * _PIECE + mark.numel())
                data[torch.unravel_index(index, data.shape)] = mark


# The signed dtype of each wide unsigned one's width (torch >= 2.3 has them).
_SIGNED = {
    getattr(torch, f"uint{bits}"): getattr(torch, f"int{bits}")
    for bits in (16, 32, 64)
    if hasattr(torch, f"uint{bits}")
}


def reset_of(module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters`` (or ``_reset_parameters``, attention's name), if any."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def _children_first(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s submodules, each after its children: the order constructors ran.

    Each with its path under ``path``, as its keys in a state dict start.
    """
    for name, child in module.named_children():
        yield from _children_first(child, join(path, name))
    yield path, module


def join(path: str, name: str) -> str:
    """``name`` under ``path``, as state-dict keys join them."""
    return f"{path}.{name}" if path else name


def legacy_hooks(module: nn.Module) -> list[str]:
    """The hooks on ``module`` that keep its values where its reset does not write.

    ``torch.nn.utils.prune`` (``weight_orig``, ``weight_mask``) and the legacy norms
    (``torch.nn.utils.spectral_norm``, ``weight_norm``).
    """
    kinds = {
        SpectralNorm: "torch.nn.utils.spectral_norm",
        WeightNorm: "torch.nn.utils.weight_norm",
        BasePruningMethod: "torch.nn.utils.prune",
    }
    return [
        name
        for hook in module._forward_pre_hooks.values()
        for kind, name in kinds.items()
        if isinstance(hook, kind)
    ]


def tensor_holders(layer: nn.Module, path: str) -> dict[Tensor, list[tuple[str, nn.Module, str]]]:
    """Each tensor of ``layer`` with its holders: ``(key, module, module's path)``.

    In the order of its state dict: each module before its children; a tensor two
    modules hold (a module and its parent) appears once, with both.
    """
    found: dict[int, tuple[Tensor, list[tuple[str, nn.Module, str]]]] = {}
    for sub, module in layer.named_modules(prefix=path, remove_duplicate=False):
        for n, tensor in own_tensors(module):
            found.setdefault(id(tensor), (tensor, []))[1].append((join(sub, n), module, sub))
    return {tensor: holders for tensor, holders in found.values()}


def under(path: str, resets: set[str]) -> bool:
    """Whether the module at ``path``, or a module above it, is in ``resets``."""
    parts = path.split(".") if path else []
    return any(".".join(parts[:k]) in resets for k in range(len(parts) + 1))
