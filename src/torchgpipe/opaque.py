"""Objects that hold tensors where the pipeline cannot see them, and their refusal.

The pipeline splits into micro-batches, and cuts between partitions, the tensors in
tuples, lists, dicts and dataclass fields (``microbatch.flatten``). Any other object is
a leaf it passes on whole: one that holds a tensor in its attributes (or in the tuples,
lists and dicts there) is refused, since that tensor would be neither split nor given
its gradient. An object held in its attributes is not looked into. A tensor subclass
whose instances carry attributes of their own is refused where torch's split into
micro-batches drops them (:func:`check_split_keeps`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PLAIN", "OpaqueLeaf", "check_opaque", "check_split_keeps", "opaque_error"]

# Leaves that hold no tensor, checked by type before anything slower.
PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})


class OpaqueLeaf(Exception):
    """A leaf holding tensors where the pipeline cannot see them (raised as TypeError)."""

    def __init__(self, leaf: Any, attributes: list[str], dataclass_: bool) -> None:
        super().__init__()
        self.leaf, self.attributes, self.dataclass_ = leaf, attributes, dataclass_


def check_split_keeps(paths: Sequence[str], leaves: Sequence[Any], pieces: Sequence[Any]) -> None:
    """Refuse a tensor leaf whose own attributes its first piece lost in the split.

    ``pieces`` holds, per leaf, its pieces (``tensor_split``), or anything for a leaf
    that is no tensor. A parameter's attributes are flags of the framework's, not data.

    Raises:
        TypeError: a tensor subclass instance carries attributes the split drops.
    """
    for path, x, piece in zip(paths, leaves, pieces, strict=True):
        if type(x) is Tensor or not isinstance(x, Tensor) or isinstance(x, nn.Parameter):
            continue
        if not vars(x):
            continue
        lost = sorted(set(vars(x)) - set(vars(piece[0])))
        if lost:
            raise TypeError(
                f"{path} is a {type(x).__name__} whose attributes {lost} do not survive "
                f"its split into micro-batches (torch's tensor_split drops them); pass "
                f"them beside the tensor (in a tuple or dataclass), batched if per sample"
            )


def check_opaque(obj: Any, leaf: Any) -> None:
    """Refuse ``obj`` if its attributes hold tensors; ``leaf`` is where it came from."""
    attributes = [name for name, v in _state(obj).items() if _Search().holds_tensor(v)]
    if isinstance(obj, AbstractSet | deque) and _Search().holds_tensor(list(obj)):
        attributes.append("items")  # a set or deque: neither split nor given gradients
    if attributes:
        raise OpaqueLeaf(leaf, attributes, dataclass_=obj is not leaf)


def _state(obj: Any) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and its slots (none it cannot read)."""
    try:
        state = dict(getattr(obj, "__dict__", None) or {})
        for cls in type(obj).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
    except Exception:  # an attribute that raises when read: nothing known there
        return {}
    return state


# How far one attribute's search goes: containers deep, and values looked at (a config's
# large table is not read through at every cell; what lies past them is taken as none).
_DEPTH, _LOOKS = 32, 256


class _Search:
    """One attribute's search for tensors in its tuples, lists, dicts, sets and deques.

    Not in the attributes of another object there: looking into every object an
    attribute reaches (a logger, a module, a config) would cost each cell more than it
    saves.
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.looks = 0

    def holds_tensor(self, value: Any, depth: int = 0) -> bool:
        """Whether ``value`` is a tensor or has one in its containers."""
        self.looks += 1
        if isinstance(value, Tensor):
            return True
        if not isinstance(value, tuple | list | dict | AbstractSet | deque):
            return False
        if id(value) in self.seen or depth >= _DEPTH:
            return False
        self.seen.add(id(value))
        for item in value.values() if isinstance(value, dict) else value:
            if self.looks >= _LOOKS:
                return False
            if self.holds_tensor(item, depth + 1):
                return True
        return False


def opaque_error(value: Any, name: str, opaque: OpaqueLeaf) -> TypeError:
    """The error that names where in ``value`` (called ``name``) the object lies, and why."""
    path = _path_to(value, opaque.leaf, name) or name
    kind = ("dataclass " if opaque.dataclass_ else "") + type(opaque.leaf).__name__
    if opaque.attributes == ["items"]:
        return TypeError(
            f"{path} is a {kind} holding tensors; the pipeline splits into micro-batches "
            f"and cuts between partitions only the tensors in tuples, lists, dicts and "
            f"dataclass fields, so these would be neither split nor given gradients; "
            f"hold them in a tuple or list instead"
        )
    where = ", ".join(repr(a) for a in opaque.attributes if a != "items")
    fields = " but are not fields" if opaque.dataclass_ else ""
    if opaque.dataclass_ and isinstance(opaque.leaf, dict):
        fields = (
            " but are not among its items (of a dict that is a dataclass, only the items are split)"
        )
    return TypeError(
        f"{path} is a {kind}, whose attributes {where} hold tensors{fields}; the pipeline "
        f"splits into micro-batches and cuts between partitions only the tensors in "
        f"tuples, lists, dicts and dataclass fields, so these would be neither split nor "
        f"given gradients; hold them in a tuple, list, dict or dataclass (as fields) instead"
    )


def _path_to(value: Any, leaf: Any, path: str) -> str | None:
    """Where ``leaf`` lies in ``value``, indexed like Python would: ``input[0].h``."""
    if value is leaf:
        return path
    if isinstance(value, tuple | list):
        children = [(f"{path}[{k}]", v) for k, v in enumerate(value)]
    elif isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if hasattr(value, f.name)]  # set ones
        children = [(f"{path}.{name}", getattr(value, name)) for name in fields]
    else:
        return None
    for child_path, child in children:
        found = _path_to(child, leaf, child_path)
        if found is not None:
            return found
    return None
