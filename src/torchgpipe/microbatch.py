"""Micro-batches: split a mini-batch along dim 0, and gather it back.

A value passed through the pipeline (the input, the output, anything one layer hands to
the next) is a tensor or any nesting of tuples, lists, dicts and dataclass instances (by
their fields, in order). Tensor leaves carry the batch on dim 0; every other leaf (None,
ints, strings, ...) reaches each micro-batch unchanged, and must come out of every
micro-batch equal to be gathered.

Any other object is a leaf the pipeline cannot look into, so one that keeps tensors in its
attributes is refused: its tensors would be neither split into micro-batches nor cut
between partitions, and their gradients would be silently wrong.

The split is balanced (``torch.tensor_split``): a batch of 10 in 4 chunks gives sizes
3, 3, 2, 2, and a batch smaller than ``chunks`` gives one sample per micro-batch. Even
sizes keep the cells of one clock tick equally long, which is what the pipeline needs.
"""

from __future__ import annotations

import copy
import dataclasses
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from torchgpipe.opaque import PLAIN, OpaqueLeaf, check_opaque, check_split_keeps, opaque_error

__all__ = [
    "Spec",
    "count_tensors",
    "distinct_tensors",
    "flatten",
    "gather",
    "map_tensors",
    "per_tensor",
    "scatter",
    "unflatten",
]


@dataclass(frozen=True)
class Spec:
    """The shape of a nested value: which containers, in which order, around the leaves.

    ``kind`` is ``"leaf"``, ``"tuple"``, ``"list"``, ``"dict"`` or ``"dataclass"``;
    ``cls`` rebuilds the container (so named tuples and dict subclasses keep their type);
    ``keys`` are a dict's keys or a dataclass's field names, in order. ``template`` is an
    emptied shallow copy of a list or dict of a subclass, which keeps what the subclass
    holds besides its items (the factory of a ``defaultdict``, say) and whose constructor
    may not take the items (a dict that is a dataclass too, as transformers'
    ``ModelOutput``, is a dict, its fields mirroring the items emptied); of a dataclass
    instance, a shallow copy with every field set
    to None, filled in place, so that neither ``__init__`` (which may not take every
    field) nor ``__post_init__`` runs again, and a frozen one is rebuilt too.
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


def flatten(value: Any, name: str = "value") -> tuple[list[Any], Spec]:
    """Return the leaves of ``value`` in order, and the spec that rebuilds it.

    ``name`` is what errors call ``value``: ``input``, say, gives ``input[1].mask``.

    Raises:
        TypeError: a leaf that is not a tuple, list, dict or dataclass holds tensors in
            its attributes, where the pipeline cannot see them.
    """
    if isinstance(value, Tensor):  # the common case, on the path of every cell
        return [value], _LEAF
    leaves: list[Any] = []
    try:
        return leaves, _flatten_into(value, leaves)
    except OpaqueLeaf as opaque:
        raise opaque_error(value, name, opaque) from None


def _flatten_into(value: Any, leaves: list[Any]) -> Spec:
    if isinstance(value, Tensor) or type(value) in PLAIN:
        leaves.append(value)
        return _LEAF
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
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A field left unset (init=False, never assigned) is not part of the value.
        names = tuple(f.name for f in dataclasses.fields(value) if hasattr(value, f.name))
        template = _dataclass_template(value, names)
        children = tuple(_flatten_into(getattr(value, name), leaves) for name in names)
        return Spec("dataclass", type(value), names, children, template)
    check_opaque(value, value)
    leaves.append(value)
    return _LEAF


def _dataclass_template(value: Any, names: tuple[str, ...]) -> Any:
    template = copy.copy(value)
    for name in names:
        object.__setattr__(template, name, None)  # frozen dataclasses too
    check_opaque(template, value)  # tensors kept outside the fields
    return template


def _template(value: list[Any] | dict[Any, Any], base: type) -> Any:
    """An emptied shallow copy of ``value`` when it is of a subclass of ``base``, or None."""
    if type(value) is base:
        return None
    template = copy.copy(value)
    template.clear()
    if dataclasses.is_dataclass(value):
        # A dict that is a dataclass too (transformers' ModelOutput) mirrors its items in
        # its fields: the template keeps none of them, and refuses tensors in the others.
        for f in dataclasses.fields(value):
            mirrored = f.name in value and getattr(value, f.name, None) is value[f.name]
            if mirrored:
                object.__setattr__(template, f.name, None)
        check_opaque(template, value)
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
    if spec.kind == "dataclass":
        rebuilt = copy.copy(spec.template)
        for name, child in zip(spec.keys, children, strict=True):
            object.__setattr__(rebuilt, name, child)
        return rebuilt
    if spec.template is not None:  # a subclass of list or dict: fill a copy of the template
        rebuilt = copy.copy(spec.template)
        if spec.kind == "dict":
            _fill_dict(rebuilt, spec.keys, children)
        else:
            rebuilt.extend(children)
        return rebuilt
    if spec.kind == "dict":
        return spec.cls(zip(spec.keys, children, strict=True))
    if spec.kind == "tuple" and hasattr(spec.cls, "_make"):  # a named tuple: its values as
        return cast(Any, spec.cls)._make(children)  # they are, not through its own __new__
    try:
        return spec.cls(children)
    except TypeError as error:  # a subclass whose __new__ takes other arguments
        raise TypeError(
            f"a {spec.cls.__name__} (a subclass of {spec.kind}) could not be rebuilt from "
            f"its items as {spec.cls.__name__}(items) ({error}); hand "
            f"on a plain {spec.kind} or a named tuple, and make the {spec.cls.__name__} in "
            f"the layer that uses it"
        ) from error


def _fill_dict(rebuilt: Any, keys: tuple[Any, ...], values: list[Any]) -> None:
    """Set the items of an emptied dict of a subclass, one key at a time, in order.

    Key by key, not ``update()``: a subclass may refuse ``update()`` (transformers'
    ``ModelOutput`` does); in order, as an ``OrderedDict`` must be; and values as they
    are, as a ``Counter`` takes them. The fields of a dataclass mirroring its items,
    emptied in the template, get their items back where ``__setitem__`` did not set them.
    """
    for key, value in zip(keys, values, strict=True):
        rebuilt[key] = value
    fields = dataclasses.fields(rebuilt) if dataclasses.is_dataclass(rebuilt) else ()
    for f in fields:
        if f.name in rebuilt and getattr(rebuilt, f.name, None) is None:
            object.__setattr__(rebuilt, f.name, rebuilt[f.name])


def leaf_paths(spec: Spec, root: str) -> list[str]:
    """Name every leaf of ``spec`` like Python would index it: ``input[1]['mask'].h``."""
    if spec.kind == "leaf":
        return [root]
    paths: list[str] = []
    for index, child in enumerate(spec.children):
        if spec.kind == "dataclass":
            paths.extend(leaf_paths(child, f"{root}.{spec.keys[index]}"))
            continue
        key = spec.keys[index] if spec.kind == "dict" else index
        paths.extend(leaf_paths(child, f"{root}[{key!r}]"))
    return paths


def map_tensors(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """Apply ``fn`` to every tensor of ``value``, once each, keeping everything else.

    A tensor found twice gets one result, in both places (:func:`per_tensor`).
    """
    if isinstance(value, Tensor):
        return fn(value)
    leaves, spec = flatten(value)
    return unflatten(per_tensor(fn, leaves), spec)


def count_tensors(value: Any) -> int:
    """How many tensor leaves ``value`` holds (a tensor found twice counts twice)."""
    return sum(isinstance(x, Tensor) for x in flatten(value)[0])


def distinct_tensors(leaves: Sequence[Any]) -> tuple[list[Tensor], list[int]]:
    """The distinct tensors among ``leaves``, and which of them each tensor leaf is.

    A layer may hand on one tensor in two places (``return h, h``); the next layer then
    gets one tensor twice, and changing one in place changes the other. What the
    pipeline does to a value's tensors (detach, copy, send, recompute) it does once per
    distinct tensor, so the value stays one tensor where it was one.
    """
    tensors: list[Tensor] = []
    which: list[int] = []
    index: dict[int, int] = {}
    for x in leaves:
        if isinstance(x, Tensor):
            k = index.setdefault(id(x), len(tensors))
            if k == len(tensors):
                tensors.append(x)
            which.append(k)
    return tensors, which


def per_tensor(fn: Callable[[Tensor], Any], leaves: Sequence[Any]) -> list[Any]:
    """``leaves`` with ``fn`` applied once per distinct tensor (see :func:`distinct_tensors`).

    A tensor found twice gets one result, in both places.
    """
    if len(leaves) == 1:  # the common case, on the path of every cell
        x = leaves[0]
        return [fn(x) if isinstance(x, Tensor) else x]
    tensors, which = distinct_tensors(leaves)
    results = [fn(x) for x in tensors]
    it = iter(which)
    return [results[next(it)] if isinstance(x, Tensor) else x for x in leaves]


Batched = Literal["input", "target"]
"""What :func:`scatter` splits: a model's input, or a schedule step's target."""

# How to give what every micro-batch shares, which needs no batch dimension.
_SHARED_ADVICE: dict[str, str] = {
    "input": "pass a value that every micro-batch shares as a Python number beside the "
    "batched tensors (it reaches each micro-batch unchanged)",
    "target": "close over a value that every sample shares in loss_fn instead (such as "
    "loss_fn=lambda output, target: loss(output, target) * scale)",
}


def scatter(value: Any, chunks: int, *, name: Batched = "input") -> list[Any]:
    """Split ``value`` along dim 0 of its tensor leaves into at most ``chunks`` values.

    ``name`` says what ``value`` is, for the errors: ``"input"`` or ``"target"``.

    Raises:
        TypeError: ``value`` has no tensor leaf, so there is no batch to split, or holds
            tensors in an object the pipeline cannot look into (see :func:`flatten`).
        ValueError: a tensor leaf is 0-dim, the leaves disagree on the batch size, or the
            batch is empty.
    """
    if type(value) is Tensor:  # the common case, at the start of every run
        return list(value.tensor_split(min(chunks, _batch_size([(name, value)], name))))
    leaves, spec = flatten(value, name)
    paths = leaf_paths(spec, name)
    tensors = [(path, x) for path, x in zip(paths, leaves, strict=True) if isinstance(x, Tensor)]
    if not tensors:
        raise TypeError(
            f"the {name} holds no tensor, so there is no batch to split into micro-batches "
            f"(got {type(value).__name__}); pass a tensor, or tuples, lists, dicts or "
            f"dataclasses of tensors whose first dimension is the batch"
            + (f", or {_SHARED_ADVICE[name]}" if name == "target" else "")
        )
    batch_size = _batch_size(tensors, name)
    n = min(chunks, batch_size)
    # A tensor there twice is split once: each micro-batch gets one piece in both places.
    pieces = per_tensor(lambda x: x.tensor_split(n), leaves)
    check_split_keeps(paths, leaves, pieces)  # a tensor subclass's own attributes
    return [
        unflatten(
            [p[i] if isinstance(x, Tensor) else x for x, p in zip(leaves, pieces, strict=True)],
            spec,
        )
        for i in range(n)
    ]


def _batch_size(tensors: list[tuple[str, Tensor]], name: Batched) -> int:
    scalars = [path for path, x in tensors if x.dim() == 0]
    if scalars:
        raise ValueError(
            f"cannot split a 0-dim tensor into micro-batches: {', '.join(scalars)}; give the "
            f"{name} a batch dimension (shape [batch, ...]; x.expand(batch_size) repeats "
            f"a 0-dim x), or {_SHARED_ADVICE[name]}"
        )
    odd = [
        f"{path} ({'nested' if x.is_nested else x.layout})"
        for path, x in tensors
        if x.layout != torch.strided or x.is_nested
    ]
    if odd:  # tensor_split cannot cut them (sparse ones give no gradient back through it)
        raise TypeError(
            f"the {name} holds tensors that cannot be split into micro-batches: "
            f"{', '.join(odd)}; pass them dense (x.to_dense(), a nested tensor padded: "
            f"x.to_padded_tensor(0)), and make them so in the first layer if it wants them"
        )
    first_path, first = tensors[0]
    size = first.size(0)
    mismatched = [f"{path} has {x.size(0)}" for path, x in tensors if x.size(0) != size]
    if mismatched:
        raise ValueError(
            f"tensor leaves of the {name} disagree on the batch size (dim 0): {first_path} "
            f"has {size} but {'; '.join(mismatched)}; every tensor leaf must share dim 0"
        )
    if size == 0:
        raise ValueError(
            f"the {name} is an empty batch ({first_path} has size 0 in dim 0), which "
            f"splits into no micro-batch; skip empty batches before the pipeline"
        )
    level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)
    if level() is not None:  # the partitions' threads and cut graphs are out of its reach
        raise NotImplementedError(
            "a pipeline runs inside a torch.func transform (grad, vmap, jacrev...), whose "
            "tensors do not reach its partitions; apply the transform to the plain model"
        )
    if getattr(forward_ad, "_current_level", -1) >= 0:  # a dual level is entered
        dual = [path for path, x in tensors if forward_ad.unpack_dual(x).tangent is not None]
        if dual:  # the cells cut their inputs apart: the tangents were lost, silently
            raise NotImplementedError(
                f"the {name} carries a forward-mode tangent ({', '.join(dual)}), which "
                f"does not pass between a pipeline's partitions; compute forward-mode "
                f"derivatives (torch.autograd.forward_ad) with the plain model"
            )
    return size


def gather(values: Sequence[Any], *, stack_scalars: bool = False) -> Any:
    """Concatenate micro-batch values back into one, in order, keeping their shape.

    A non-tensor leaf must be equal (or the same object) in every micro-batch, and is
    taken once. With ``stack_scalars``, a 0-dim tensor leaf (a step's output holding an
    auxiliary loss) becomes one value per micro-batch, stacked (shape ``[m]``).

    Raises:
        TypeError: the micro-batches have different shapes, a leaf is a tensor in some
            micro-batches and not in others, or holds tensors in an object the pipeline
            cannot look into (see :func:`flatten`).
        ValueError: a tensor leaf is 0-dim, so it has no batch dimension to join along,
            its shapes differ beyond dim 0 or its dtypes differ, or a non-tensor leaf
            differs between micro-batches.
    """
    if values and all(isinstance(v, Tensor) for v in values):  # the common case: a run's end
        return _gather_leaf("output", tuple(values), stack_scalars)
    flat = [flatten(v, "output") for v in values]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise TypeError(
                f"micro-batch {i} produced an output of a different structure than "
                f"micro-batch 0, so the outputs cannot be gathered; return the same "
                f"nesting of tuples, lists, dicts and dataclasses for every micro-batch"
            )
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True))
    paths = leaf_paths(spec, "output")
    # A tensor a micro-batch returns in two places is one joined tensor in both, as the
    # plain model's is one tensor (``return y, y``).
    joined: dict[tuple[int, ...], Any] = {}
    leaves = []
    for path, column in zip(paths, columns, strict=True):
        if not isinstance(column[0], Tensor):
            leaves.append(_gather_leaf(path, column, stack_scalars))
            continue
        key = tuple(map(id, column))
        if key not in joined:
            joined[key] = _gather_leaf(path, column, stack_scalars)
        leaves.append(joined[key])
    return unflatten(leaves, spec)


def _gather_leaf(path: str, column: tuple[Any, ...], stack_scalars: bool) -> Any:
    is_tensor = [isinstance(x, Tensor) for x in column]
    if not any(is_tensor):
        first = column[0]
        for i, x in enumerate(column[1:], start=1):
            if not _same(x, first):
                raise ValueError(
                    f"{path} is {reprlib.repr(first)} in micro-batch 0 but "
                    f"{reprlib.repr(x)} in micro-batch {i}; only tensors are joined along "
                    f"the batch, so a non-tensor leaf of the output must be the same in "
                    f"every micro-batch: return it as a tensor with a batch dimension, or "
                    f"compute it after the pipeline"
                )
        return first
    if not all(is_tensor):
        raise TypeError(
            f"{path} is a tensor in some micro-batches and not in others; the outputs "
            f"are joined leaf by leaf: return a tensor there from every micro-batch"
        )
    if stack_scalars and all(x.dim() == 0 for x in column):
        if len({x.dtype for x in column}) > 1:  # stack would promote them
            dtypes = ", ".join(str(x.dtype) for x in column)
            raise ValueError(f"{path} has other dtypes in other micro-batches ({dtypes})")
        return torch.stack(column)
    if any(x.dim() == 0 for x in column):
        raise ValueError(
            f"{path} is a 0-dim tensor, which has no batch dimension to gather along; "
            f"return per-sample values (shape [batch, ...]) and reduce them after the "
            f"pipeline"
        )
    if len(column) == 1:
        return column[0]
    first = column[0]
    if first.layout != torch.strided and any(x.requires_grad for x in column):
        raise TypeError(
            f"{path} is a {first.layout} tensor, which torch joins along the batch with no "
            f"gradient back through the join; return it dense (x.to_dense()) from the last "
            f"layer, and make it sparse after the pipeline"
        )
    # One memory in every micro-batch, not a constant expanded along the batch (stride 0,
    # or of one sample, which expand(1, ...) leaves as it is: a cls token's).
    one = first.layout == torch.strided and first.numel() and first.data_ptr()
    one = one and first.stride(0) and first.size(0) > 1
    if one and all(x.data_ptr() == first.data_ptr() and x.shape == first.shape for x in column):
        raise ValueError(
            f"{path} is one tensor in every micro-batch (a parameter or a constant "
            f"returned as it is): joined along the batch it would repeat "
            f"{len(column)} times, where the plain model returns it once; return it "
            f"from outside the pipeline, or per-sample values"
        )
    if len({(x.shape[1:], x.dtype) for x in column}) > 1:  # cat would promote the dtypes
        raise ValueError(
            f"{path} cannot be joined along dim 0: its micro-batches differ beyond it "
            f"({', '.join(f'{list(x.shape)} {x.dtype}' for x in column)}); the outputs are "
            f"joined along the batch, so give the tensor one dtype and one shape but for "
            f"dim 0 in every micro-batch (pad or cast in the model, or join after it)"
        )
    return torch.cat(column)


def _same(x: Any, y: Any) -> bool:
    """Whether two micro-batches' non-tensor leaves are one value.

    NaN is NaN here (a layer returning ``float("nan")`` returns the same each time), and
    arrays (NumPy's) are the same when every element is.
    """
    if x is y:
        return True
    try:
        equal = x == y
        if isinstance(equal, bool):
            return equal or bool(x != x and y != y)  # two NaNs
        if getattr(x, "shape", None) != getattr(y, "shape", None):
            return False
        return bool((equal | ((x != x) & (y != y))).all())  # elementwise, NaN as NaN
    except Exception:  # an == that cannot say: not the same
        return False
