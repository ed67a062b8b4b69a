"""Deferred batch normalization: running statistics of the mini-batch, not of each piece.

Under GPipe a batch-norm layer sees micro-batches, and it must normalize each with that
micro-batch's statistics (the pipeline cannot wait for the whole mini-batch). Plain
``BatchNorm`` would also fold each micro-batch's statistics into its running mean and
variance, m times per step, with weights that depend on m. :class:`DeferredBatchNorm`
instead merges the statistics of the micro-batches (counts, means and squared
deviations, in float64 and merged pairwise so that large means cost no precision) and updates
the running statistics once, after the last micro-batch of the mini-batch, from the
mean and variance of the whole mini-batch: what plain ``BatchNorm`` tracks when it sees
the mini-batch at once. Recomputation in backward neither merges nor updates.

Conversion changes the class of each layer, not the layer: ``BatchNorm2d`` becomes
``DeferredBatchNorm2d``, a subclass of both ``BatchNorm2d`` and
:class:`DeferredBatchNorm` made once per class, whose ``forward`` is the deferred one::

    DeferredMyNorm -> MyNorm -> BatchNorm2d -> DeferredBatchNorm -> _BatchNorm
                      (its forward,           (the deferred        (BatchNorm's,
                       super().forward ->)     forward)             never reached)

A copy would lose what the layer is beyond its weight and running statistics: a
subclass's forward, parameters and buffers (and the state dict keys with them), hooks,
parametrizations, and ``isinstance(layer, nn.BatchNorm2d)``, which code that freezes
batch norm layers relies on. The deferred state lives in plain attributes, so the state
dict stays the plain model's. A class whose forward is torch's own but not
``BatchNorm``'s cannot be deferred this way and is refused (quantized batch norm, a
subclass's forward over ``SyncBatchNorm``'s); ``SyncBatchNorm`` itself is deferred where
it would not synchronize (one process) and refused in training where it would.

A layer may be called more than once per micro-batch (a block applied twice, one layer
registered under two names). Plain ``BatchNorm`` then updates its running statistics
once per call, from that call's input over the mini-batch; so the deferred layer keeps
the statistics of its j-th call of each micro-batch apart from those of its other calls,
and updates once per call, in the order of the calls. It knows where a micro-batch
starts from the pipeline: every call of a partition in a cell runs inside
:func:`enter_cell`, which gives the thread a new token::

    cell (0, s):  enter_cell  bn(x) bn(y)   j = 0, 1
    cell (1, s):  enter_cell  bn(x) bn(y)   j = 0, 1, the last: update from the merged
                                           j = 0, then from the merged j = 1

A layer called outside a pipeline (on its own, as in torchgpipe 0.0.7) counts each
call as a micro-batch. Where the micro-batches call a layer unequally often, the calls
of the last one update the running statistics. Where a call's input depends on an
earlier normalization, it differs from the plain model's as that normalization does:
each micro-batch is normalized with its own statistics.

:func:`freeze_running_stats` serves plain batch norm under checkpointing: the
recomputation of a cell would update the running statistics a second time, so the
pipeline puts back what they were before it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, TypeVar, cast, overload

import torch
from torch import Tensor, nn
from torch.nn.functional import batch_norm
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from torchgpipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "freeze_running_stats"]

TModule = TypeVar("TModule", bound=nn.Module)

# What a layer has merged of its j-th calls: samples per channel, mean, and the sum of
# squared deviations from the mean.
Moments = tuple[Tensor, Tensor, Tensor]


@dataclass
class _Tally:
    """Where a deferred layer is in its mini-batch.

    One attribute for all of it, with a name no subclass of ``BatchNorm`` is likely to
    use: a converted layer keeps its own attributes beside it.
    """

    cell: object | None = None  # the enter_cell() token of the latest call
    begun: int = 0  # the micro-batches of the mini-batch begun
    calls: int = 0  # the calls in the current one
    moments: dict[int, Moments] = field(default_factory=dict)  # the j-th calls', by j


class DeferredBatchNorm(_BatchNorm):
    """Batch norm that updates its running statistics once per mini-batch.

    A mini-batch is ``chunks`` micro-batches in a row, in training mode: the running
    statistics are updated after the last of them, as plain ``BatchNorm`` would update
    them seeing the mini-batch at once (once per call, for a layer called several times
    in a micro-batch of a converted module: see the module's docstring).
    ``GPipe(..., deferred_batch_norm=True)`` sets the number itself, calling
    :meth:`expect` before each mini-batch (without that flag, a layer of yours inside
    GPipe keeps its own ``chunks``). Otherwise it follows
    ``BatchNorm``'s rules as they stand at each call: ``track_running_stats`` and the
    running statistics may be changed or set to None, and evaluation uses the running
    statistics, or the batch's where there are none. Example, on its own::

        bn = DeferredBatchNorm(64, chunks=4)
        for micro_batch in batch.chunk(4):
            bn(micro_batch)  # the running statistics change after the fourth

    Converted layers (:func:`convert_deferred_batch_norm`) are instances of this class
    too, and still of their own: ``isinstance(layer, DeferredBatchNorm)`` tells a
    deferred layer, whatever its class was.

    Args:
        *args: ``BatchNorm``'s positional arguments (``num_features``, ``eps``, ...).
        chunks: the micro-batches of a mini-batch, until :meth:`expect` says otherwise.
        **kwargs: ``BatchNorm``'s keyword arguments.

    Raises:
        TypeError: ``chunks`` is not an int, or ``track_running_stats`` not a bool.
        ValueError: ``chunks`` is not positive.
    """

    chunks: int
    """The micro-batches of a mini-batch: the running statistics change after so many."""

    _deferred_tally: _Tally

    def __init__(self, *args: Any, chunks: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.track_running_stats, bool):
            # torchgpipe 0.0.7 took chunks as the fifth positional argument, where
            # BatchNorm has track_running_stats: an int there is most likely chunks.
            raise TypeError(
                f"track_running_stats must be a bool, got {self.track_running_stats!r}; "
                f"pass the number of micro-batches by keyword: "
                f"DeferredBatchNorm({self.num_features}, chunks=...)"
            )
        self.expect(chunks)

    def _check_input_dim(self, input: Tensor) -> None:
        # Only where the class has no check of its own: a converted BatchNorm2d keeps
        # BatchNorm2d's (4-D input), which comes first in its class's order.
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects input of at least 2 dimensions (batch, "
                f"channels, ...), got {input.dim()}"
            )

    def expect(self, chunks: int) -> None:
        """Start a mini-batch of ``chunks`` micro-batches, dropping any partial one.

        Raises:
            TypeError: ``chunks`` is not an int.
            ValueError: ``chunks`` is not positive.
        """
        self.chunks = _check_chunks(chunks)
        self._deferred_tally = _Tally()

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` as ``BatchNorm`` would; in training mode, merge its statistics.

        As ``BatchNorm``: training normalizes with the batch's statistics and, while
        ``track_running_stats`` holds, tracks them (here once per mini-batch: the
        running mean and variance where they are not None, and ``num_batches_tracked``);
        evaluation uses the running statistics, or the batch's if both are None.
        """
        self._check_input_dim(input)
        if not self.training:
            both_none = self.running_mean is None and self.running_var is None
            return batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                both_none,
                0.0,
                self.eps,
            )
        if self.track_running_stats and (self.running_mean is None) != (self.running_var is None):
            # BatchNorm's own refusal (batch_norm raises it for the pair of them).
            raise ValueError(
                "running_mean and running_var must either both be None or neither be None"
            )
        output = batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.track_running_stats and not is_recomputing():
            _merge(self, input.detach())  # once batch_norm took it: a refused call counts not
        return output

    @overload
    @classmethod
    def convert_deferred_batch_norm(
        cls, module: _BatchNorm, chunks: int = 1
    ) -> DeferredBatchNorm: ...

    @overload
    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int = 1) -> TModule: ...

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """``module``, its batch-norm layers deferred over ``chunks`` micro-batches.

        The layers are converted in place, as by :func:`convert_deferred_batch_norm`,
        ``module`` itself too if it is a batch-norm layer; ``module`` is returned.
        Deferred layers already there now expect ``chunks`` micro-batches too. Example::

            model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)

        Raises:
            TypeError: ``chunks`` is not an int.
            ValueError: ``chunks`` is not positive, or a layer cannot be deferred (see
                :func:`convert_deferred_batch_norm`); nothing is converted then.
        """
        chunks = _check_chunks(chunks)  # before anything is converted
        for layer in convert_deferred_batch_norm(module):
            layer.expect(chunks)
        return module

    def extra_repr(self) -> str:
        """BatchNorm's description, and the micro-batches of a mini-batch."""
        base = super().extra_repr()  # type: ignore[no-untyped-call]  # unannotated in torch
        return f"{base}, chunks={self.chunks}"

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """How pickle and ``copy`` rebuild a converted layer: by the class it came from.

        Pickle finds a class by its qualified name, and the deferred classes are made at
        run time, under no name in this module: a converted layer names its own class's
        base, from which the unpickling process makes the deferred class again.
        """
        base = type(self).__bases__[0]
        if _derived.get(base) is not type(self):
            return super().__reduce_ex__(protocol)
        return (_remade, (base,), self.__getstate__())  # type: ignore[no-untyped-call]  # torch's


def _merge(layer: DeferredBatchNorm, x: Tensor) -> None:
    # Functions, not methods: a converted layer's class may have methods of any name.
    tally = layer._deferred_tally
    cell = getattr(_cells, "token", None)
    if cell is None or cell is not tally.cell:  # a micro-batch begins
        tally.cell = cell
        if tally.begun >= layer.chunks:  # on its own: no expect() between mini-batches
            tally.begun, tally.moments = 0, {}
        tally.begun += 1
        tally.calls = 0
    j = tally.calls
    tally.calls += 1
    moments = _merged(tally.moments.pop(j, None), x)
    if tally.begun == layer.chunks:  # the last micro-batch: the j-th calls are complete
        _commit(layer, *moments)
    else:
        tally.moments[j] = moments


def _commit(layer: _BatchNorm, count: Tensor, mean: Tensor, m2: Tensor) -> None:
    """Track the mini-batch's statistics as ``BatchNorm`` tracks a batch's.

    What is None is skipped, as ``BatchNorm`` skips it: a running mean or variance
    set to None is not updated, and without ``num_batches_tracked``,
    ``momentum=None`` averages with a factor of 0 (the statistics stay as they are).
    """
    variance = m2 / (count - 1) if count > 1 else m2 / count
    factor = 0.0 if layer.momentum is None else layer.momentum
    with torch.no_grad():
        if layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
            if layer.momentum is None:  # a cumulative average over the mini-batches
                factor = 1.0 / float(layer.num_batches_tracked)
        if layer.running_mean is not None:
            layer.running_mean.lerp_(mean.to(layer.running_mean.dtype), factor)
        if layer.running_var is not None:
            layer.running_var.lerp_(variance.to(layer.running_var.dtype), factor)


def _merged(moments: Moments | None, x: Tensor) -> Moments:
    """``moments`` with the statistics of ``x`` merged in (Chan et al.'s pairwise merge)."""
    dims = [0, *range(2, x.dim())]
    # In float64 whatever the input: a float32 mean of data around 1e4 is off by 1e-3,
    # and the merge's squared differences of means would carry that error.
    stats = x.to(torch.float64)
    count = torch.tensor(x.numel() / x.size(1), dtype=stats.dtype, device=x.device)
    mean = stats.mean(dims)
    m2 = stats.var(dims, unbiased=False) * count
    if moments is None:
        return count, mean, m2
    count_before, mean_before, m2_before = moments
    total = count_before + count
    delta = mean - mean_before
    return (
        total,
        mean_before + delta * (count / total),
        m2_before + m2 + delta.square() * (count_before * count / total),
    )


# Per thread: the token of the cell whose partition runs (enter_cell), if any.
_cells = threading.local()


def enter_cell() -> object | None:
    """Before a partition's call in a cell: one micro-batch's calls of deferred layers.

    See the module's docstring. Returns what :func:`leave_cell` takes. Two plain calls
    rather than a context manager: this runs once per cell.
    """
    outer = getattr(_cells, "token", None)
    _cells.token = object()
    return outer


def leave_cell(outer: object | None) -> None:
    """After a partition's call in a cell (it may have raised)."""
    _cells.token = outer


def _check_chunks(chunks: int) -> int:
    # Imported here, as GPipe's own check: gpipe.py imports this module.
    from torchgpipe.gpipe import check_chunks

    return check_chunks(chunks)


def convert_deferred_batch_norm(module: nn.Module) -> list[DeferredBatchNorm]:
    """Defer, in place, every batch-norm layer inside ``module`` (``module`` too, if one).

    Each layer stays the object it was, with its parameters, buffers, hooks and
    parametrizations, and stays an instance of its class (``nn.BatchNorm2d``, a subclass
    of yours): its class becomes a subclass of that class and of
    :class:`DeferredBatchNorm`, whose ``forward`` is the deferred one (a subclass's
    forward still runs, and its ``super().forward(x)`` is deferred). ``state_dict()``
    keys and values stay as they were. Returns the deferred layers, each once, those
    deferred before included.

    In a pipeline, a layer called several times per micro-batch tracks each call apart
    (see the module's docstring); called on its own, each call is a micro-batch.

    Layers that do not track running statistics are converted too (torchgpipe 0.0.7
    left them alone): a deferred layer follows ``BatchNorm``'s rules as they stand at
    each call, so it computes what the plain layer would, even if tracking is turned on
    or off after the conversion.

    Raises:
        ValueError: a lazy batch-norm layer has not been initialized yet, or a layer's
            forward is torch's own but not ``BatchNorm``'s (quantized batch norm, a
            subclass's forward over ``SyncBatchNorm``'s), so that no deferred forward
            can take its place. Every such layer is named, and nothing is converted.
    """
    layers = [
        (name or "(the module itself)", m)
        for name, m in module.named_modules()  # each layer once, under its first name
        if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm)
    ]
    lazy = [
        name
        for name, m in layers
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
    ]
    if lazy:
        raise ValueError(
            f"batch-norm layers {lazy} are lazy and not initialized yet; run the model once "
            f"on a sample batch before converting them to DeferredBatchNorm (as GPipe's "
            f"deferred_batch_norm=True does)"
        )
    refused = [
        f"{name} ({why})" for name, m in layers if (why := _refusal(_own_class(m))) is not None
    ]
    if refused:
        raise ValueError(
            f"batch-norm layers cannot be deferred: {'; '.join(refused)}; use torch's "
            f"BatchNorm1d/2d/3d there, or a subclass whose forward calls BatchNorm's "
            f"(super().forward), or pass deferred_batch_norm=False"
        )
    for _, layer in layers:
        layer.__class__ = _deferred_class_of(layer)
        cast(DeferredBatchNorm, layer).expect(1)
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]


# Per batch-norm class, its deferred class: made once, kept as long as the process (as
# classes are). A parametrized layer's class is its own (see _deferred_class_of).
_derived: dict[type, type[DeferredBatchNorm]] = {}
_derived_lock = threading.Lock()


def _deferred_class(cls: type) -> type[DeferredBatchNorm]:
    with _derived_lock:
        derived = _derived.get(cls)
        if derived is None:
            namespace: dict[str, Any] = {"__module__": __name__, "__doc__": cls.__doc__}
            if _forward_of(cls, from_torch=False) is nn.SyncBatchNorm:
                namespace["forward"] = _unsynchronized_forward
            bases = (cls, DeferredBatchNorm)
            derived = cast(
                type[DeferredBatchNorm], type(f"Deferred{cls.__name__}", bases, namespace)
            )
            _derived[cls] = derived
    return derived


def _remade(base: type) -> DeferredBatchNorm:
    """An empty layer of ``base``'s deferred class, for pickle to fill (``__reduce_ex__``)."""
    cls = _deferred_class(base)
    return cls.__new__(cls)


def _own_class(layer: nn.Module) -> type:
    """``layer``'s class, beneath the one a parametrization gave it."""
    return parametrize.type_before_parametrizations(layer)


def _deferred_class_of(layer: _BatchNorm) -> type[DeferredBatchNorm]:
    if not parametrize.is_parametrized(layer):
        return _deferred_class(type(layer))
    # torch.nn.utils.parametrize gave the layer a class of its own on top of its class,
    # with a property per parametrized tensor. The deferred class goes beneath a copy of
    # it: removing the last parametrization puts back the class beneath, deferred still.
    parametrized = type(layer)
    namespace = {
        k: v for k, v in vars(parametrized).items() if k not in ("__dict__", "__weakref__")
    }
    base = _deferred_class(_own_class(layer))
    return cast(type[DeferredBatchNorm], type(f"Parametrized{base.__name__}", (base,), namespace))


def _forward_of(cls: type, *, from_torch: bool) -> type:
    """The first class in ``cls``'s order with a ``forward`` (of torch's, if ``from_torch``)."""
    return next(
        c
        for c in cls.__mro__
        if "forward" in vars(c) and (not from_torch or c.__module__.startswith("torch."))
    )


def _refusal(cls: type) -> str | None:
    """Why no deferred forward can take the place of ``cls``'s batch norm, or None."""
    theirs = _forward_of(cls, from_torch=True)
    if theirs is _BatchNorm or (
        theirs is nn.SyncBatchNorm and _forward_of(cls, from_torch=False) is theirs
    ):
        return None
    if theirs is nn.SyncBatchNorm:
        return f"{cls.__qualname__}'s forward runs SyncBatchNorm's, not BatchNorm's"
    return f"{cls.__qualname__}'s forward is {theirs.__module__}.{theirs.__qualname__}'s"


def _unsynchronized_forward(self: DeferredBatchNorm, input: Tensor) -> Tensor:
    """A deferred ``SyncBatchNorm``'s forward: where it would not synchronize, BatchNorm's.

    ``SyncBatchNorm`` synchronizes in training where ``torch.distributed`` runs a group
    of several processes, and otherwise is ``BatchNorm``. Deferred batch norm does not
    synchronize: there, it would silently normalize with one process's statistics.
    """
    if self.training and (size := _synchronized_processes(self)) > 1:
        raise ValueError(
            f"a deferred SyncBatchNorm would synchronize its statistics across the {size} "
            f"processes of its group, which deferred batch norm does not do; replace the "
            f"model's SyncBatchNorm layers with BatchNorm1d/2d/3d, or pass "
            f"deferred_batch_norm=False to keep them synchronizing per micro-batch"
        )
    return DeferredBatchNorm.forward(self, input)


def _synchronized_processes(layer: nn.Module) -> int:
    """The processes a ``SyncBatchNorm`` in training synchronizes with: 1, where none."""
    # Read only, as SyncBatchNorm reads it: the core never starts torch.distributed.
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    group = getattr(layer, "process_group", None) or distributed.group.WORLD
    return int(distributed.get_world_size(group))


@contextmanager
def freeze_running_stats(modules: Sequence[_BatchNorm]) -> Iterator[None]:
    """Put the running statistics of ``modules`` back as they were when the block ends."""
    saved = [
        [t.clone() for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]
        for m in modules
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, tensors in zip(modules, saved, strict=True):
                current = [
                    t
                    for t in (m.running_mean, m.running_var, m.num_batches_tracked)
                    if t is not None
                ]
                for now, before in zip(current, tensors, strict=True):
                    # Through .data: the graphs of other micro-batches saved these
                    # tensors (batch norm's backward in training mode does not read
                    # them), and a version bump would fail their backward's checks.
                    now.data.copy_(before)
