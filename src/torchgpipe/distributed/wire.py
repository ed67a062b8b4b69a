"""The wire form of a message's tensors: their bytes, one after another, in one buffer.

A message between processes moves its tensors as one flat ``uint8`` buffer (one
transfer, however many tensors it holds), and their layout (shapes and dtypes) apart:
on the side channel, or known from the last step on an input laid out alike. :func:`pack` makes
the buffer, :func:`unpack` gives the tensors back, each over its own part of it;
:func:`shell` and :func:`filled` take a value's tensors out of its leaves and put them
back (the rest of the value, its structure and the leaves that are not tensors, travels
pickled). A buffer may end with a mark that tells real data from the zeros a sender sends
in its place: its action failed, or the value moved to the side channel (``transfers.py``).
"""

from __future__ import annotations

import ctypes
import math
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchgpipe.microbatch import Spec, distinct_tensors, flatten, unflatten

__all__ = [
    "DATA",
    "FAILED",
    "MARK",
    "MOVED",
    "Layout",
    "as_bytes",
    "filled",
    "pack",
    "packed_size",
    "shell",
    "tensor_bytes",
    "unpack",
]

_ALIGN = 16  # each tensor's bytes start at a multiple of this in the buffer

Layout = list[tuple[tuple[int, ...], torch.dtype]]
MARK = 16  # the bytes of the mark at the end of a marked buffer (see pack)
# What a mark's first byte says of its buffer: real data; zeros in place of a value
# that a failed action never made; zeros in place of a value that went on the side
# channel, not laid out as its receiver expected (``transfers.py``).
DATA, FAILED, MOVED = 1, 0, 2


def packed_size(layout: Layout) -> int:
    """The bytes of the buffer that :func:`pack` makes for tensors of ``layout``."""
    return sum(_aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in layout)


def pack(tensors: Sequence[Tensor], wire: torch.device, *, mark: bool = False) -> Tensor | None:
    """The tensors' bytes one after another (each aligned) in one buffer on ``wire``.

    None when they have no bytes at all. Their layout (shapes and dtypes) travels apart.
    ``mark``: :data:`MARK` more bytes at the end, the first of them :data:`DATA`, as
    opposed to the zeros a sender may send in its place (``transfers.py``).
    The buffer is made by one ``torch.cat`` of the parts: a message is packed per cell,
    and filling a buffer part by part costs several dispatches more per tensor.
    """
    marked, zeros = _constants(wire)
    parts = []
    for t in tensors:
        data = tensor_bytes(t)
        size = data.numel()
        if not size:
            continue
        if data.device != wire:
            data = data.to(wire)
        parts.append(data)
        if pad := _aligned(size) - size:
            parts.append(zeros[:pad])
    if mark:
        parts.append(marked)
    if not parts:
        return None
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


_CONSTANTS: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _constants(wire: torch.device) -> tuple[Tensor, Tensor]:
    """A mark (a 1 and zeros), and zeros to pad with, on ``wire``; made once per device.

    The mark is kept as it is used (slicing it at each message would cost a dispatch
    more); the zeros are sliced to each pad, rare (a tensor of 4-byte items whose
    count is not a multiple of 4, say).
    """
    found = _CONSTANTS.get(wire)
    if found is None:
        both = torch.zeros(MARK + _ALIGN, dtype=torch.uint8, device=wire)
        both[0] = DATA
        if wire.type == "cuda":  # written on this stream; read on any
            torch.cuda.synchronize(wire)
        found = _CONSTANTS[wire] = (both[:MARK], both[MARK:])
    return found


def unpack(buffer: Tensor | None, layout: Layout, device: torch.device) -> list[Tensor]:
    """The tensors of a buffer made by :func:`pack`, on ``device``, in its memory.

    Each is a tensor of its own over its part of the buffer, not a view of the buffer:
    views would share one version counter, so a layer changing one tensor in place
    (``relu_``) would fail autograd's check on another that a layer saved, where the
    sender's tensors were independent.
    """
    if buffer is not None and buffer.device != device:
        buffer = buffer.to(device)
    tensors, offset = [], 0
    for shape, dtype in layout:
        size = math.prod(shape) * dtype.itemsize
        if size == 0 or buffer is None:
            tensors.append(torch.empty(shape, dtype=dtype, device=device))
        else:
            # Parts start at multiples of _ALIGN, itself a multiple of every item size.
            start = (buffer.storage_offset() + offset) // dtype.itemsize
            tensor = torch.empty(0, dtype=dtype, device=buffer.device)
            tensors.append(tensor.set_(buffer.untyped_storage(), start, shape, ()))  # contiguous
        offset += _aligned(size)
    return tensors


def shell(value: Any) -> tuple[list[Tensor], bytes]:
    """The distinct tensors of ``value``, and the pickled rest that rebuilds it from them.

    A tensor found twice (a stage returning ``(h, h)``) travels once and arrives as one
    tensor in both places (``microbatch.distinct_tensors``). The rest: the structure, the
    leaves that are not tensors, where the tensors were, which want a gradient, and
    which of the distinct tensors each one is.

    Raises:
        TypeError: ``value`` holds tensors where the pipeline cannot see them (``flatten``).
        Exception: what ``pickle.dumps`` raises for a leaf that cannot be pickled.
    """
    # The common cases, an activation and its gradient: their bodies made once.
    if isinstance(value, Tensor):
        return [value], _BARE[value.requires_grad]
    if type(value) is list and len(value) == 1 and isinstance(value[0], Tensor):
        return [value[0]], _LISTED[value[0].requires_grad]
    leaves, spec = flatten(value)
    tensors, which = distinct_tensors(leaves)
    slots = [k for k, x in enumerate(leaves) if isinstance(x, Tensor)]
    wants = [leaves[k].requires_grad for k in slots]
    rest = [None if isinstance(x, Tensor) else x for x in leaves]
    return tensors, _dumped(spec, rest, slots, wants, which)


def filled(body: bytes, tensors: list[Tensor]) -> Any:
    """The value that :func:`shell` took apart: its tensors back, wanting grad as sent.

    Raises:
        Exception: what ``pickle.loads`` raises (a class this process cannot import).
    """
    spec, rest, slots, wants, which = _loaded(body)
    leaves = list(rest)
    for slot, k, grad in zip(slots, which, wants, strict=True):
        leaves[slot] = tensors[k].requires_grad_(True) if grad else tensors[k]
    return unflatten(leaves, spec)


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def tensor_bytes(t: Tensor) -> Tensor:
    """The bytes of ``t``'s values, flat, as uint8; a sparse ``t`` is refused (TypeError).

    A conjugate or negative view (``z.conj()``, its ``.imag``) keeps the memory it views
    and a bit that says to flip it: its values are resolved first.
    """
    if t.layout != torch.strided:
        raise TypeError(
            f"a tensor of layout {t.layout} (shape {list(t.shape)}) cannot pass between "
            f"stages on different processes, only dense ones: return it dense from its "
            f"stage (.to_dense()), or give the layers that make and use it one stage"
        )
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


# Pickled rests of values, both ways, for rests that pickle alike whenever they are equal
# (see _reusable): a cell's message has the same structure at every step, and pickling
# or unpickling it, between two cells whose layers filled the caches, costs 60 to 80 us
# (4 warm), a dict lookup 9: a few times per cell.
_DUMPED: dict[tuple[Any, ...], bytes] = {}
_LOADED: dict[bytes, tuple[Any, ...]] = {}
_REMEMBERED = 256  # entries of each, at most: a model has few structures


def _dumped(
    spec: Spec, rest: list[Any], slots: list[int], wants: list[bool], which: list[int]
) -> bytes:
    key = None
    if _reusable(spec, rest):
        key = (spec, len(rest), tuple(slots), tuple(wants), tuple(which))
        found = _DUMPED.get(key)
        if found is not None:
            return found
    body = pickle.dumps((spec, rest, slots, wants, which), protocol=pickle.HIGHEST_PROTOCOL)
    if key is not None:
        if len(_DUMPED) >= _REMEMBERED:
            _DUMPED.clear()
        _DUMPED[key] = body
    return body


def _loaded(body: bytes) -> tuple[Any, ...]:
    """What :func:`_dumped` pickled; a tuple read before is returned again, not to be changed."""
    found = _LOADED.get(body)
    if found is not None:
        return found
    loaded: tuple[Any, ...] = pickle.loads(body)
    if _reusable(loaded[0], loaded[1]):
        if len(_LOADED) >= _REMEMBERED:
            _LOADED.clear()
        _LOADED[body] = loaded
    return loaded


def _reusable(spec: Spec, rest: list[Any]) -> bool:
    """Whether a rest is one to remember: the places of its tensors alone.

    So that equal keys mean equal bytes, and a remembered rest is never changed: no leaf
    that is not a tensor (``1`` equals ``True`` but pickles otherwise; a layer could
    change a leaf object it gets), no template (a container's attributes, which
    :class:`Spec` does not compare), and dict keys that are strings (``1`` again).
    """
    return all(leaf is None for leaf in rest) and _plain(spec)


def _plain(spec: Spec) -> bool:
    if spec.kind == "leaf":
        return True
    return (
        spec.template is None
        and all(type(key) is str for key in spec.keys)
        and all(_plain(child) for child in spec.children)
    )


# The bodies of a tensor, and of a list of one, by whether it wants a gradient (shell's
# common cases): what the general way pickles for them.
_BARE, _LISTED = (
    {grad: _dumped(flatten(value)[1], [None], [0], [grad], [0]) for grad in (False, True)}
    for value in (torch.empty(0), [torch.empty(0)])
)


def as_bytes(t: Tensor) -> bytes:
    """The bytes of a uint8 tensor; ``bytes(storage)`` would read them one at a time."""
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())
