"""The arguments that ``GPipe`` and ``PipelineStage`` take, checked alike.

Each check turns what torchgpipe 0.0.7 accepted (NumPy integers, whole floats for
``chunks``, ``0``/``1`` for flags) into the plain value, and refuses anything else with
a message that says what to pass. ``chunks`` and ``checkpoint`` are read again at every
call, so they are :class:`Checked` attributes: a value assigned after construction
(``model.chunks = 0``) is refused at once, with the constructor's message, rather than
failing deep inside the next call.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeAlias, TypeVar, get_args, overload

from torch import nn

__all__ = [
    "BalanceError",
    "Checked",
    "Checkpoint",
    "check_balance",
    "check_checkpoint",
    "check_chunks",
    "check_flag",
    "check_layers",
    "checkpoint_stop",
]

Checkpoint: TypeAlias = Literal["always", "except_last", "never"]
"""When micro-batches are checkpointed: all, all but the last, or none."""

_CHECKPOINT_MODES: tuple[str, ...] = get_args(Checkpoint)

_AUTO_BALANCE_HINT = (
    "or compute one with torchgpipe.balance.balance_by_time or torchgpipe.balance.balance_by_size"
)

_T = TypeVar("_T")


class BalanceError(ValueError):
    """The balance does not fit the module: wrong sum, or a non-positive entry."""


class Checked(Generic[_T]):
    """An attribute that ``check`` takes in each time it is set, after construction too.

    The value lives in the instance's ``__dict__`` under the attribute's own name (as a
    plain attribute's would: copies, pickles and ``vars()`` see it as before); this
    descriptor on the class comes first on every read and write.
    """

    def __init__(self, check: Callable[[Any], _T]) -> None:
        self._check = check
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Checked[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object, owner: type | None = None) -> Checked[_T] | _T:
        if instance is None:
            return self
        try:
            return instance.__dict__[self._name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(self._name) from None

    def __set__(self, instance: object, value: Any) -> None:
        instance.__dict__[self._name] = self._check(value)

    def __delete__(self, instance: object) -> None:
        if instance.__dict__.pop(self._name, None) is None:
            raise AttributeError(self._name)


def check_balance(balance: Iterable[int] | None, num_layers: int) -> list[int]:
    """``balance`` as a list of ints: positive counts of layers that sum to ``num_layers``."""
    if balance is None:
        single = f"balance=[{num_layers}] for a single partition"
        raise BalanceError(
            f"balance is required: pass the number of layers of each partition, such as "
            f"{single if num_layers else 'balance=[] for an empty model'}, {_AUTO_BALANCE_HINT}"
        )
    try:
        entries = list(balance)
        if any(isinstance(b, bool) for b in entries):
            raise TypeError
        values = [operator.index(b) for b in entries]
    except TypeError:
        raise TypeError(
            f"balance must be a sequence of ints, got {balance!r}; pass the number of "
            f"layers of each partition, such as [2, 2]"
        ) from None
    if not values and num_layers == 0:
        return []  # an empty model: GPipe passes its input through, as nn.Sequential()
    if not values:
        raise BalanceError(f"balance is empty; give at least one partition, {_AUTO_BALANCE_HINT}")
    bad = [f"balance[{j}] = {b}" for j, b in enumerate(values) if b <= 0]
    if bad:
        raise BalanceError(
            f"every partition needs at least one layer, but {', '.join(bad)}; pass "
            f"positive counts, {_AUTO_BALANCE_HINT}"
        )
    if sum(values) != num_layers:
        raise BalanceError(
            f"balance sums to {sum(values)} but the module has {num_layers} layers; pass a "
            f"balance that sums to {num_layers}, {_AUTO_BALANCE_HINT}"
        )
    return values


def checkpoint_stop(mode: Checkpoint, m: int) -> int:
    """How many micro-batches of ``m`` a checkpoint mode checkpoints (the first ones)."""
    return {"always": m, "except_last": m - 1, "never": 0}[mode]


def check_chunks(chunks: int) -> int:
    """``chunks`` as an int: an int, a NumPy integer, or a whole float (``42.0``).

    Whole floats are taken as torchgpipe 0.0.7 took them; any other value is refused.
    """
    from torchgpipe.balance.blockpartition import whole_number  # balance imports this module

    given: object = chunks
    if isinstance(given, numbers.Real) and not isinstance(given, numbers.Integral):
        value = float(given)  # a float of NumPy's too
        given = int(value) if value.is_integer() else given
    chunks = whole_number(given, "chunks")
    if chunks <= 0:
        raise ValueError(
            f"chunks must be a positive number of micro-batches, got {chunks}; pass "
            f"chunks=1 to run each mini-batch whole"
        )
    return chunks


def check_checkpoint(checkpoint: str) -> Checkpoint:
    """``str(checkpoint)``, if it names a mode (as torchgpipe 0.0.7 read it)."""
    mode = str(checkpoint)
    if mode not in _CHECKPOINT_MODES:
        *others, last = map(repr, _CHECKPOINT_MODES)
        raise ValueError(  # the words of 0.0.7's message first, as its test matches them
            f"checkpoint is not one of {', '.join(others)}, or {last}: unknown checkpoint "
            f"mode {checkpoint!r}"
        )
    return mode  # type: ignore[return-value]


def check_flag(value: bool, name: str) -> bool:
    """``value`` as a bool: a bool, a NumPy bool, or the int 0 or 1 (as 0.0.7 took them)."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if isinstance(value, bool) or numpy_bool:
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(number)


def check_layers(module: nn.Sequential) -> None:
    """Refuse a layer that appears twice (tensors shared by layers are fine: ties).

    And a subclass with a forward of its own, which a pipeline would not call, and
    tensors of the Sequential itself, which it would not keep.
    """
    if type(module).forward is not nn.Sequential.forward:
        raise TypeError(
            f"{type(module).__name__} has a forward of its own, which a pipeline does not "
            f"call: it runs the layers one after another, each on the previous one's "
            f"output. Split the model with torchgpipe.split(model, example_input, ...), "
            f"or move what its forward adds into layers of their own"
        )
    held = {**module._parameters, **module._buffers}  # not a non-persistent buffer: no key
    kept = module._non_persistent_buffers_set
    own = [name for name, t in held.items() if t is not None and name not in kept]
    own += ["parametrizations"] if hasattr(module, "parametrizations") else []
    if own:
        raise ValueError(
            f"the {type(module).__name__} itself holds tensors {own}, which no layer holds: a "
            f"pipeline keeps only the layers (their partitions), so those would be lost from "
            f"its state dict; move them into a layer (one that uses them)"
        )
    problems = []
    first_index: dict[int, int] = {}
    for index, layer in enumerate(module):
        if id(layer) in first_index:
            problems.append(f"layer {index} is the same module as layer {first_index[id(layer)]}")
        else:
            first_index[id(layer)] = index
    if problems:
        raise ValueError(
            f"every layer must appear once, but {'; '.join(problems)}; use separate "
            f"modules (they may share parameters: layer_b.weight = layer_a.weight)"
        )
