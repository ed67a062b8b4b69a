"""Deferred batch normalization: running statistics of the mini-batch, not of each piece.

Under GPipe a batch-norm layer sees micro-batches and must normalize each with its own
statistics; plain ``BatchNorm`` would also fold each into its running statistics, m
times per step, with weights that depend on m. :class:`DeferredBatchNorm` merges the
micro-batches' counts, means and squared deviations (in float64, pairwise, so that
large means cost no precision) and updates the running statistics once, after the last
micro-batch, from the whole mini-batch's: what plain ``BatchNorm`` tracks seeing it at
once. Recomputation in backward neither merges nor updates.

Conversion changes the class of each layer, not the layer, to a subclass of its class
and of :class:`DeferredBatchNorm`, made once per class::

    DeferredMyNorm -> MyNorm -> BatchNorm2d -> DeferredBatchNorm -> _BatchNorm
                      (its forward,           (the deferred        (BatchNorm's,
                       super().forward ->)     forward)             never reached)

A copy would lose a subclass's forward, parameters and buffers (and state dict keys),
hooks, parametrizations, and ``isinstance(layer, nn.BatchNorm2d)``. The layer stays the
user's: whatever else holds it sees it deferred. The deferred state is one attribute
(``_deferred_tally``) that module functions drive (:func:`expect_micro_batches`): the
state dict stays the plain model's, a subclass's own ``chunks`` or ``expect`` its own.
Refused: a forward of torch's other than ``BatchNorm``'s (quantized batch norm, a
subclass's over ``SyncBatchNorm``'s), ``SyncBatchNorm`` in training where it would
synchronize, and a subclass's forward that does batch norm itself (``F.batch_norm``, as
timm's ``BatchNormAct2d``) where a training call changed the running statistics
(:func:`_checked_forward`).

A layer called several times per micro-batch (a block applied twice, a layer under two
names) updates, as plain ``BatchNorm`` does, once per call, from that call's input over
the mini-batch: it merges its j-th calls apart from its others (the tally of a
mini-batch: ``batchnorm_tally.py``). The pipeline marks where a micro-batch starts:
every call of a partition in a cell runs inside ``enter_cell``, which gives the thread
a new token::

    cell (0, s):  enter_cell  bn(x) bn(y)   j = 0, 1
    cell (1, s):  enter_cell  bn(x) bn(y)   j = 0, 1, the last: update from the merged
                                           j = 0, then from the merged j = 1

Outside a pipeline (on its own, as in torchgpipe 0.0.7) each call is a micro-batch.
In a pipeline, what the last micro-batch's calls did not take (a layer it does not
call, or calls less often than another) updates once the pipeline's forwards are done. Where a
call's input depends on an earlier normalization, it differs from the plain model's as
that normalization does (per micro-batch).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, SupportsIndex, TypeVar, cast, overload

import torch
from torch import Tensor, nn
from torch.nn.functional import batch_norm
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from torchgpipe.arguments import check_chunks
from torchgpipe.batchnorm_tally import Tally, finish, merge
from torchgpipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "expect_micro_batches"]

TModule = TypeVar("TModule", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """Batch norm that updates its running statistics once per mini-batch.

    A mini-batch is ``chunks`` micro-batches in a row, in training mode: the running
    statistics are updated after the last of them, as plain ``BatchNorm`` would update
    them seeing the mini-batch at once (see the module's docstring).
    ``GPipe(..., deferred_batch_norm=True)`` sets the number before each mini-batch
    (:func:`expect_micro_batches`); without that flag, a layer of yours inside GPipe
    keeps its own. Otherwise it follows ``BatchNorm``'s rules as they stand at each
    call (``track_running_stats``, running statistics set to None). Example::

        bn = DeferredBatchNorm(64, chunks=4)
        for micro_batch in batch.chunk(4):
            bn(micro_batch)  # the running statistics change after the fourth

    Converted layers (:func:`convert_deferred_batch_norm`) are instances of this class
    too, and still of their own, whose names come first.

    Args:
        *args: ``BatchNorm``'s positional arguments (``num_features``, ``eps``, ...).
        chunks: the micro-batches of a mini-batch, until :meth:`expect` says otherwise.
        **kwargs: ``BatchNorm``'s keyword arguments.

    Raises:
        TypeError: ``chunks`` is not a whole number (an int, or a float such as 4.0),
            or ``track_running_stats`` not a bool.
        ValueError: ``chunks`` is not positive.
    """

    _deferred_tally: Tally

    @property
    def chunks(self) -> int:
        """The micro-batches of a mini-batch: the running statistics change after so many.

        A converted layer's own ``chunks`` (a ghost batch norm's) where it has one.
        """
        return cast(int, vars(self).get("chunks", self._deferred_tally.chunks))

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        if "chunks" in vars(self):
            vars(self)["chunks"] = chunks
        else:
            self._deferred_tally.chunks = check_chunks(chunks)

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
        expect_micro_batches(self, chunks)

    def _check_input_dim(self, input: Tensor) -> None:
        # Only where the class has no check of its own: a converted BatchNorm2d keeps
        # BatchNorm2d's (4-D input), which comes first in its class's order.
        if input.dim() < 2:
            raise ValueError(
                f"DeferredBatchNorm expects input of at least 2 dimensions (batch, "
                f"channels, ...), got {input.dim()}"
            )

    def expect(self, chunks: int) -> None:
        """Start a mini-batch of ``chunks`` micro-batches (:func:`expect_micro_batches`)."""
        expect_micro_batches(self, chunks)

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` as ``BatchNorm`` would; in training mode, merge its statistics.

        As ``BatchNorm``: training normalizes with the batch's statistics and, while
        ``track_running_stats`` holds, tracks them (here once per mini-batch);
        evaluation uses the running statistics, or the batch's if both are None.
        """
        self._deferred_tally.forwards += 1
        self._check_input_dim(input)
        mean, var = self.running_mean, self.running_var
        if not self.training:
            both_none = mean is None and var is None
            return batch_norm(input, mean, var, self.weight, self.bias, both_none, 0.0, self.eps)
        if self.track_running_stats and (mean is None) != (var is None):
            # BatchNorm's own refusal (batch_norm raises it for the pair of them).
            raise ValueError(
                "running_mean and running_var must either both be None or neither be None"
            )
        output = batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if self.track_running_stats and not is_recomputing():
            merge(self, input.detach())  # once batch_norm took it: a refused call counts not
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

        The layers are converted in place, as by :func:`convert_deferred_batch_norm`
        (``module`` too); ``module`` is returned. Deferred layers already there now
        expect ``chunks`` micro-batches too.

        Raises:
            TypeError: ``chunks`` is not a whole number (an int, or a float such as 4.0).
            ValueError: ``chunks`` is not positive, or a layer cannot be deferred (see
                :func:`convert_deferred_batch_norm`); nothing is converted then.
        """
        chunks = check_chunks(chunks)  # before anything is converted
        for layer in convert_deferred_batch_norm(module):
            expect_micro_batches(layer, chunks)
        return module

    def extra_repr(self) -> str:
        """BatchNorm's description, and the micro-batches of a mini-batch."""
        base = super().extra_repr()  # type: ignore[no-untyped-call]  # unannotated in torch
        return f"{base}, chunks={self._deferred_tally.chunks}"

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickle a converted layer by its base: its class, made at run time, has no name."""
        base = type(self).__bases__[0]
        if _derived.get(base) is not type(self):
            return super().__reduce_ex__(protocol)
        return (_remade, (base,), self.__getstate__())  # type: ignore[no-untyped-call]  # torch's

    def __copy__(self) -> DeferredBatchNorm:
        """A shallow copy with a tally of its own: sharing one, two layers would mix."""
        copied, tally = type(self).__new__(type(self)), self._deferred_tally
        copied.__dict__.update(self.__dict__)
        copied._deferred_tally = replace(tally, moments=dict(tally.moments))
        return copied


def expect_micro_batches(layer: DeferredBatchNorm, chunks: int) -> None:
    """Start ``layer``'s next mini-batch, of ``chunks`` micro-batches, dropping any partial one.

    A function, not a method: a converted layer's class may have an ``expect`` or a
    ``chunks`` of its own, which this leaves alone.

    Raises:
        TypeError: ``chunks`` is not a whole number (an int, or a float such as 4.0).
        ValueError: ``chunks`` is not positive.
    """
    layer._deferred_tally = Tally(chunks=check_chunks(chunks))


def start_mini_batch(layers: list[DeferredBatchNorm], m: int) -> Callable[[], None] | None:
    """Each of ``layers`` expects ``m`` micro-batches; return what ends the mini-batch.

    A pipeline calls what this returns once its forwards of the mini-batch all ended
    well (:func:`torchgpipe.batchnorm_tally.finish`), on the caller's streams, which
    wait for the pipeline's first. None: no layers.
    """
    for layer in layers:
        expect_micro_batches(layer, m)
    return functools.partial(finish, layers) if layers else None


def convert_deferred_batch_norm(module: nn.Module) -> list[DeferredBatchNorm]:
    """Defer, in place, every batch-norm layer inside ``module`` (``module`` too, if one).

    Each layer stays the object it was, with all it holds, and an instance of its class:
    its class becomes a subclass of that class and of :class:`DeferredBatchNorm` (see
    the module's docstring). Whatever else holds a layer sees it deferred. Returns the
    deferred layers, each once, those deferred before included. Layers that do not
    track running statistics are converted too (torchgpipe 0.0.7 left them alone): a
    deferred layer follows ``BatchNorm``'s rules as they stand at each call.

    Raises:
        ValueError: a layer is lazy and not initialized yet, its forward is torch's own
            but not ``BatchNorm``'s (quantized batch norm, a subclass's over
            ``SyncBatchNorm``'s), or its class refuses a subclass (its
            ``__init_subclass__`` raised). Every such layer is named; none is converted.
    """
    layers = [
        (name or "(the module itself)", m)
        for name, m in module.named_modules()  # each layer once, under its first name
        if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm)
    ]
    refused, classes = [], []
    for name, m in layers:
        why = _refusal(parametrize.type_before_parametrizations(m))
        if why is None and isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            why = "lazy, not initialized yet: run the model once on a sample batch first"
        if why is None:
            try:  # every class made before any layer changes: a refusal changes none
                classes.append(_deferred_class_of(m))
                continue
            except Exception as error:  # the class's __init_subclass__ or metaclass: any
                why = f"{type(m).__qualname__} refused a subclass: {error!r}"
        refused.append(f"{name} ({why})")
    if refused:
        raise ValueError(
            f"batch-norm layers cannot be deferred: {'; '.join(refused)}; use torch's "
            f"BatchNorm1d/2d/3d there, or a subclass whose forward calls BatchNorm's "
            f"(super().forward) and that takes subclasses without arguments, or pass "
            f"deferred_batch_norm=False"
        )
    for (_, layer), cls in zip(layers, classes, strict=True):
        layer.__class__ = cls
        expect_micro_batches(cast(DeferredBatchNorm, layer), 1)
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
            own = _forward_of(cls, from_torch=False)
            if own is nn.SyncBatchNorm:
                namespace["forward"] = _unsynchronized_forward
            elif not own.__module__.startswith("torch."):  # a subclass's (or a mixin's)
                namespace["forward"] = _checked_forward(cls.__qualname__, vars(own)["forward"])
            made = type(f"Deferred{cls.__name__}", (cls, DeferredBatchNorm), namespace)
            derived = _derived[cls] = cast(type[DeferredBatchNorm], made)
    return derived


def _remade(base: type) -> DeferredBatchNorm:
    """An empty layer of ``base``'s deferred class, for pickle to fill (``__reduce_ex__``)."""
    cls = _deferred_class(base)
    return cls.__new__(cls)


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
    base = _deferred_class(parametrize.type_before_parametrizations(layer))
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


def _checked_forward(name: str, own: Callable[..., Any]) -> Callable[..., Any]:
    """The forward ``own`` of class ``name``, refused where it bypasses the deferred one.

    A forward that does batch norm itself (``F.batch_norm``, as timm's
    ``BatchNormAct2d``) updates the running statistics per micro-batch. A forward may
    rightly skip the deferred one (statistics frozen in training): a call is refused
    where it also changed them, by value (torch's kernels count no version there).
    """

    @functools.wraps(own)
    def forward(self: DeferredBatchNorm, *args: Any, **kwargs: Any) -> Any:
        if not self.training or is_recomputing():  # the recomputation's are put back
            return own(self, *args, **kwargs)
        tally = self._deferred_tally
        forwards, before = tally.forwards, _running_stats(self)
        output = own(self, *args, **kwargs)
        if tally.forwards == forwards and not _same(before, _running_stats(self)):
            raise ValueError(
                f"{name}.forward changed its running statistics without reaching the "
                f"deferred forward (it calls F.batch_norm, or BatchNorm's forward by name, "
                f"not super().forward): they were updated for this micro-batch, not once "
                f"per mini-batch. Make {name}.forward call super().forward(input); or build "
                f"the model anew (its layers stay converted), with deferred_batch_norm=False"
            )
        return output

    return forward


def _running_stats(layer: _BatchNorm) -> Tensor:
    """A copy of the running statistics, flat, in float64 (exact, counts included)."""
    tensors = (layer.running_mean, layer.running_var, layer.num_batches_tracked)
    flat = [t.detach().reshape(-1).to(torch.float64) for t in tensors if t is not None]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)


def _same(before: Tensor, after: Tensor) -> bool:
    """Equal, NaN and all: frozen statistics may be NaN."""
    return before.shape == after.shape and torch.allclose(before, after, 0.0, 0.0, True)


def _unsynchronized_forward(self: DeferredBatchNorm, input: Tensor) -> Tensor:
    """A deferred ``SyncBatchNorm``'s forward: where it would not synchronize, BatchNorm's.

    ``SyncBatchNorm`` synchronizes in training over a group of several processes; a
    deferred one would silently normalize with one process's statistics there.
    """
    distributed = torch.distributed  # read as SyncBatchNorm reads it; never started here
    if self.training and distributed.is_available() and distributed.is_initialized():
        group = getattr(self, "process_group", None) or distributed.group.WORLD
        if (size := distributed.get_world_size(group)) > 1:
            raise ValueError(
                f"a deferred SyncBatchNorm would synchronize its statistics across the "
                f"{size} processes of its group, which deferred batch norm does not do; "
                f"replace the model's SyncBatchNorm layers with BatchNorm1d/2d/3d, or pass "
                f"deferred_batch_norm=False to keep them synchronizing per micro-batch"
            )
    return DeferredBatchNorm.forward(self, input)
