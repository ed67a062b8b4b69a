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
from typing import Any, TypeVar, overload

import torch
from torch import Tensor, nn
from torch.nn.functional import batch_norm
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.lazy import LazyModuleMixin

from torchgpipe.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "freeze_running_stats"]

TModule = TypeVar("TModule", bound=nn.Module)

# What a layer has merged of its j-th calls: samples per channel, mean, and the sum of
# squared deviations from the mean.
Moments = tuple[Tensor, Tensor, Tensor]


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
        self._cell: object | None = None  # the enter_cell() token of the latest call
        self._begun = 0  # the micro-batches of the mini-batch begun
        self._calls = 0  # the calls in the current one
        self._moments: dict[int, Moments] = {}  # what the j-th calls merged, by j
        # torch's class of the layer this one replaces (from_batch_norm), whose check of
        # the input's dimensions this one keeps: BatchNorm2d takes only 4-D input, say.
        self._checks_as: type[_BatchNorm] | None = None
        self.expect(chunks)

    def _check_input_dim(self, input: Tensor) -> None:
        if self._checks_as is not None:
            self._checks_as._check_input_dim(self, input)  # the same ValueError as it
        elif input.dim() < 2:
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
        self._cell, self._begun, self._calls, self._moments = None, 0, 0, {}

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
            self._merge(input.detach())  # once batch_norm took it: a refused call counts not
        return output

    def _merge(self, x: Tensor) -> None:
        cell = getattr(_cells, "token", None)
        if cell is None or cell is not self._cell:  # a micro-batch begins
            self._cell = cell
            if self._begun >= self.chunks:  # on its own: no expect() between mini-batches
                self._begun, self._moments = 0, {}
            self._begun += 1
            self._calls = 0
        j = self._calls
        self._calls += 1
        moments = _merged(self._moments.pop(j, None), x)
        if self._begun == self.chunks:  # the last micro-batch: the j-th calls are complete
            self._commit(*moments)
        else:
            self._moments[j] = moments

    def _commit(self, count: Tensor, mean: Tensor, m2: Tensor) -> None:
        """Track the mini-batch's statistics as ``BatchNorm`` tracks a batch's.

        What is None is skipped, as ``BatchNorm`` skips it: a running mean or variance
        set to None is not updated, and without ``num_batches_tracked``,
        ``momentum=None`` averages with a factor of 0 (the statistics stay as they are).
        """
        variance = m2 / (count - 1) if count > 1 else m2 / count
        factor = 0.0 if self.momentum is None else self.momentum
        with torch.no_grad():
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # a cumulative average over the mini-batches
                    factor = 1.0 / float(self.num_batches_tracked)
            if self.running_mean is not None:
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
            if self.running_var is not None:
                self.running_var.lerp_(variance.to(self.running_var.dtype), factor)

    @classmethod
    def from_batch_norm(cls, module: _BatchNorm) -> DeferredBatchNorm:
        """A deferred copy of ``module`` that shares its parameters and buffers."""
        deferred = cls(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            device="meta",
        )
        deferred.weight, deferred.bias = module.weight, module.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            deferred.register_buffer(name, getattr(module, name))
        deferred.train(module.training)
        # The check of torch's class among its bases (BatchNorm2d's: 4-D input), if one
        # has its own: a subclass's may read attributes of its own, which this layer
        # lacks, and _NormBase's raises NotImplementedError (a class built on
        # _BatchNorm directly, as mmengine's _BatchNormXd, gets the check for 2-D up).
        deferred._checks_as = next(
            (
                c
                for c in type(module).__mro__
                if c.__module__.startswith("torch.nn.")
                and "_check_input_dim" in vars(c)
                and c is not _NormBase
            ),
            None,
        )
        return deferred

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
        """``module`` with every batch-norm layer deferred over ``chunks`` micro-batches.

        The layers inside ``module`` are replaced in place, as by
        :func:`convert_deferred_batch_norm`, sharing their parameters and buffers;
        ``module`` itself is returned, or a deferred copy of it when it is a batch-norm
        layer (which cannot replace itself in place). Deferred layers already there
        now expect ``chunks`` micro-batches too. Example::

            model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)

        Raises:
            TypeError: ``chunks`` is not an int.
            ValueError: ``chunks`` is not positive, or a lazy batch-norm layer has not
                been initialized yet.
        """
        chunks = _check_chunks(chunks)  # before anything is replaced
        layers = convert_deferred_batch_norm(module)
        if isinstance(module, _BatchNorm) and not isinstance(module, DeferredBatchNorm):
            module = cls.from_batch_norm(module)
            layers.append(module)
        for layer in layers:
            layer.expect(chunks)
        return module

    def extra_repr(self) -> str:
        """BatchNorm's description, and the micro-batches of a mini-batch."""
        base = super().extra_repr()  # type: ignore[no-untyped-call]  # unannotated in torch
        return f"{base}, chunks={self.chunks}"


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
    """Replace, in place, every batch-norm layer inside ``module`` with a deferred one.

    Parameters and buffers are shared with the layers replaced, so ``state_dict()``
    keys and values stay as they were. A layer under several names is replaced by one
    deferred layer under all of them. Returns the deferred layers, each once.

    In a pipeline, a layer called several times per micro-batch tracks each call apart
    (see the module's docstring); called on its own, each call is a micro-batch.

    Layers that do not track running statistics are replaced too (torchgpipe 0.0.7
    left them alone): a deferred layer follows ``BatchNorm``'s rules as they stand at
    each call, so it computes what the layer replaced would, even if tracking is turned
    on or off after the conversion. It keeps the replaced class's check of the input's
    dimensions (``BatchNorm2d`` takes 4-D input only).

    Raises:
        ValueError: a lazy batch-norm layer has not been initialized yet.
    """
    lazy = [
        name or "(the module itself)"
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm)
        and isinstance(m, LazyModuleMixin)
        and m.has_uninitialized_params()
    ]
    if lazy:
        raise ValueError(
            f"batch-norm layers {lazy} are lazy and not initialized yet; run the model once "
            f"on a sample batch before converting them to DeferredBatchNorm (as GPipe's "
            f"deferred_batch_norm=True does)"
        )
    # Per layer replaced (kept alive, so that its id stays its own): its deferred layer,
    # one for every name it has (named_children() would skip all names but the first).
    replaced: dict[int, tuple[_BatchNorm, DeferredBatchNorm]] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, _BatchNorm) and not isinstance(child, DeferredBatchNorm):
                if id(child) not in replaced:
                    replaced[id(child)] = (child, DeferredBatchNorm.from_batch_norm(child))
                setattr(parent, name, replaced[id(child)][1])
    converted = [deferred for _, deferred in replaced.values()]
    converted.extend(
        m for m in module.modules() if isinstance(m, DeferredBatchNorm) and m not in converted
    )
    return converted


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
