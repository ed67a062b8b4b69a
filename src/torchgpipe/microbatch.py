"""Micro-batches: split a mini-batch along dim 0, and gather it back.

A value passed through the pipeline (the input, the output, anything one layer hands to
the next) is a tensor or any nesting of tuples, lists and dicts. Tensor leaves carry the
batch on dim 0; every other leaf (None, ints, strings, ...) reaches each micro-batch
unchanged.

The split is balanced (``torch.tensor_split``): a batch of 10 in 4 chunks gives sizes
3, 3, 2, 2, and a batch smaller than ``chunks`` gives one sample per micro-batch. Even
sizes keep the cells of one clock tick equally long, which is what the pipeline needs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Spec", "device_of", "flatten", "gather", "map_tensors", "scatter", "unflatten"]


@dataclass(frozen=True)
class Spec:
    """The shape of a nested value: which containers, in which order, around the leaves.

    ``kind`` is ``"leaf"``, ``"tuple"``, ``"list"`` or ``"dict"``; ``cls`` rebuilds the
    container (so named tuples and dict subclasses keep their type); ``keys`` are a
    dict's keys in order. ``template`` is an emptied shallow copy of a list or dict of a
    subclass, which keeps what the subclass holds besides its items (the factory of a
    ``defaultdict``, say) and whose constructor may not take the items.
    """

    kind: str
    cls: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[Spec, ...] = ()
    template: Any = field(default=None, compare=False)

    @property
    def num_leaves(self) -> int:
        """How many leaves a value of this shape has."""
        if self.kind == "leaf":
            return 1
        return sum(child.num_leaves for child in self.children)


_LEAF = Spec("leaf")


def flatten(value: Any) -> tuple[list[Any], Spec]:
    """Return the leaves of ``value`` in order, and the spec that rebuilds it."""
    if isinstance(value, Tensor):  # the common case, on the path of every cell
        return [value], _LEAF
    leaves: list[Any] = []
    return leaves, _flatten_into(value, leaves)


def _flatten_into(value: Any, leaves: list[Any]) -> Spec:
    if isinstance(value, tuple):
        children = tuple(_flatten_into(v, leaves) for v in value)
        return Spec("tuple", type(value), (), children)
    if isinstance(value, list):
        children = tuple(_flatten_into(v, leaves) for v in value)
        return Spec("list", type(value), (), children, _template(value, list))
    if isinstance(value, dict):
        keys = tuple(value)
        children = tuple(_flatten_into(value[key], leaves) for key in keys)
        return Spec("dict", type(value), keys, children, _template(value, dict))
    leaves.append(value)
    return _LEAF


def _template(value: list[Any] | dict[Any, Any], base: type) -> Any:
    """An emptied shallow copy of ``value`` when it is of a subclass of ``base``, or None."""
    if type(value) is base:
        return None
    template = copy.copy(value)
    template.clear()
    return template


def unflatten(leaves: Sequence[Any], spec: Spec) -> Any:
    """Rebuild the value that :func:`flatten` took apart."""
    if spec is _LEAF and len(leaves) == 1:
        return leaves[0]
    it = iter(leaves)
    value = _unflatten_from(it, spec)
    if next(it, _END) is not _END:
        raise ValueError(f"more leaves than the spec holds ({spec.num_leaves})")
    return value


_END = object()


def _unflatten_from(it: Iterator[Any], spec: Spec) -> Any:
    if spec.kind == "leaf":
        leaf = next(it, _END)
        if leaf is _END:
            raise ValueError("fewer leaves than the spec holds")
        return leaf
    children = [_unflatten_from(it, child) for child in spec.children]
    assert spec.cls is not None  # every container spec records its type
    if spec.template is not None:  # a subclass of list or dict: fill a copy of the template
        rebuilt = copy.copy(spec.template)
        # The subclass's own update and extend: OrderedDict keeps its order only so; an
        # empty Counter updated from a mapping takes the values as they are.
        if spec.kind == "dict":
            rebuilt.update(dict(zip(spec.keys, children, strict=True)))
        else:
            rebuilt.extend(children)
        return rebuilt
    if spec.kind == "dict":
        return spec.cls(zip(spec.keys, children, strict=True))
    if spec.kind == "tuple" and hasattr(spec.cls, "_fields"):  # a named tuple
        return spec.cls(*children)
    return spec.cls(children)


def leaf_paths(spec: Spec, root: str) -> list[str]:
    """Name every leaf of ``spec`` like Python would index it: ``input[1]['mask']``."""
    if spec.kind == "leaf":
        return [root]
    paths: list[str] = []
    for index, child in enumerate(spec.children):
        key = spec.keys[index] if spec.kind == "dict" else index
        paths.extend(leaf_paths(child, f"{root}[{key!r}]"))
    return paths


def map_tensors(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``value``, keeping everything else."""
    if isinstance(value, Tensor):
        return fn(value)
    leaves, spec = flatten(value)
    return unflatten([fn(x) if isinstance(x, Tensor) else x for x in leaves], spec)


def scatter(value: Any, chunks: int) -> list[Any]:
    """Split ``value`` along dim 0 of its tensor leaves into at most ``chunks`` values.

    Raises:
        TypeError: ``value`` has no tensor leaf, so there is no batch to split.
        ValueError: a tensor leaf is 0-dim, the leaves disagree on the batch size, or the
            batch is empty.
    """
    leaves, spec = flatten(value)
    paths = leaf_paths(spec, "input")
    tensors = [(path, x) for path, x in zip(paths, leaves, strict=True) if isinstance(x, Tensor)]
    if not tensors:
        raise TypeError(
            f"the input holds no tensor, so there is no batch to split into micro-batches "
            f"(got {type(value).__name__}); pass a tensor, or tuples, lists or dicts of "
            f"tensors whose first dimension is the batch"
        )
    batch_size = _batch_size(tensors)
    n = min(chunks, batch_size)
    pieces = [x.tensor_split(n) if isinstance(x, Tensor) else None for x in leaves]
    return [
        unflatten([x if p is None else p[i] for x, p in zip(leaves, pieces, strict=True)], spec)
        for i in range(n)
    ]


def _batch_size(tensors: list[tuple[str, Tensor]]) -> int:
    scalars = [path for path, x in tensors if x.dim() == 0]
    if scalars:
        raise ValueError(
            f"cannot split a 0-dim tensor into micro-batches: {', '.join(scalars)}; give it "
            f"a batch dimension, or pass it as a Python number instead of a tensor"
        )
    first_path, first = tensors[0]
    size = first.size(0)
    mismatched = [f"{path} has {x.size(0)}" for path, x in tensors if x.size(0) != size]
    if mismatched:
        raise ValueError(
            f"tensor leaves of the input disagree on the batch size (dim 0): {first_path} "
            f"has {size} but {'; '.join(mismatched)}; every tensor leaf must share dim 0"
        )
    if size == 0:
        raise ValueError(f"the batch is empty ({first_path} has size 0 in dim 0)")
    return size


def gather(values: Sequence[Any]) -> Any:
    """Concatenate micro-batch values back into one, in order, keeping their shape.

    Non-tensor leaves are taken from the first micro-batch.

    Raises:
        TypeError: the micro-batches have different shapes, or a leaf is a tensor in some
            micro-batches and not in others.
        ValueError: a tensor leaf is 0-dim, so it has no batch dimension to join along.
    """
    flat = [flatten(v) for v in values]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise TypeError(
                f"micro-batch {i} produced an output of a different structure than "
                f"micro-batch 0, so the outputs cannot be gathered; return the same "
                f"nesting of tuples, lists and dicts for every micro-batch"
            )
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True))
    paths = leaf_paths(spec, "output")
    return unflatten([_gather_leaf(p, c) for p, c in zip(paths, columns, strict=True)], spec)


def _gather_leaf(path: str, column: tuple[Any, ...]) -> Any:
    is_tensor = [isinstance(x, Tensor) for x in column]
    if not any(is_tensor):
        return column[0]
    if not all(is_tensor):
        raise TypeError(f"{path} is a tensor in some micro-batches and not in others")
    if any(x.dim() == 0 for x in column):
        raise ValueError(
            f"{path} is a 0-dim tensor, which has no batch dimension to gather along; "
            f"return per-sample values (shape [batch, ...]) and reduce them after the "
            f"pipeline"
        )
    if len(column) == 1:
        return column[0]
    return torch.cat(column)


def device_of(value: Any) -> torch.device:
    """The device of the first tensor in ``value``; the CPU if it holds none."""
    for leaf in flatten(value)[0]:
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")
