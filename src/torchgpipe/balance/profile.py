"""Per-layer costs for balancing: the time of forward and backward, or the memory.

Both profilers work on copies of the layers, made one by one on the profiling device,
so the model's weights, gradients, training mode and device are left as they were.
Each layer gets its input detached (a new leaf that wants a gradient where the input
did, as in training, cloned so that a layer may modify it in place), so that its
backward stops at its own input: a frozen layer fed by no gradient-wanting input runs
no backward and saves nothing for one. Skips stashed by skippable layers are handed on
detached as well.

The layers run under generators of the profiling's own (``rng.own_generators``): a
layer that draws (dropout) advances no process-wide generator, so what a program draws
after balancing does not depend on it, nor on how many passes the timing made.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from torchgpipe.mailbox import add_note
from torchgpipe.microbatch import flatten, map_tensors, scatter
from torchgpipe.rng import own_generators
from torchgpipe.skip.skippable import SkipKey
from torchgpipe.skip.tracker import SkipTracker, use_tracker

__all__ = ["layerwise_size", "layerwise_time"]


class _DetachingTracker(SkipTracker):
    """Keeps stashed skips as fresh leaves, so a popping layer's backward stops there.

    A pop gets a copy of the leaf (``_fresh_input``'s way): the popping layer may
    modify it in place, which a leaf that wants a gradient refuses.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stashed: list[Tensor] = []  # since last emptied: memory a layer left behind

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        if tensor is not None:
            self.stashed.append(tensor)
        super().stash(key, None if tensor is None else _leaf(tensor))

    def pop(self, key: SkipKey) -> Tensor | None:
        tensor = super().pop(key)
        return None if tensor is None else tensor.clone()


def _leaf(x: Tensor) -> Tensor:
    """A new leaf of ``x``'s values, wanting a gradient where ``x`` does.

    As in training: a layer whose input wants no gradient (the sample, the output of
    frozen layers, an attention mask) runs no backward through it and saves nothing
    for one, and profiling must not time or count what training never does.
    """
    return x.detach().requires_grad_(x.requires_grad)


def _fresh_input(value: Any) -> Any:
    """Copies that a layer may modify in place, of new leaves (:func:`_leaf`).

    Integer tensors are copied too: the caller's sample must come out as it went in.
    """
    return map_tensors(lambda x: _leaf(x).clone(), value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copies(
    module: nn.Sequential, device: torch.device, warmed: dict[int, nn.Module] | None = None
) -> Iterator[nn.Module]:
    # Each layer is copied on its own; a stashing layer's copy and the popping layer's
    # copy still name their skip alike, since a copy of a Namespace equals it. A lazy
    # layer is copied from its copy in ``warmed``, which has made its parameters.
    for j, layer in enumerate(module):
        if warmed is not None and j in warmed:
            yield copy.deepcopy(warmed[j])
            continue
        try:
            made = copy.deepcopy(layer).to(device).train()
        except Exception as error:
            add_note(
                error,
                f"torchgpipe: raised while copying layer {j} ({type(layer).__name__}) to "
                f"profile it: balancing runs a copy of each layer, which must deep-copy; "
                f"otherwise pass balance= by hand",
            )
            raise
        yield made


@contextmanager
def _naming(j: int, layer: nn.Module, by: str) -> Iterator[None]:
    """Note on a failure which layer raised, and that it was while profiling it."""
    try:
        yield
    except Exception as error:
        add_note(
            error,
            f"torchgpipe: raised in layer {j} ({type(layer).__name__}) of the "
            f"module, run on its own by {by} to profile it",
        )
        raise


@contextmanager
def _profiling() -> Iterator[_DetachingTracker]:
    # Training records a graph whatever the caller's mode: inference mode too, which
    # enable_grad alone does not leave (no layer would save for a backward, nor run one).
    tracker = _DetachingTracker()
    with use_tracker(tracker), torch.inference_mode(False), torch.enable_grad(), own_generators():
        yield tracker


def layerwise_time(
    module: nn.Sequential, sample: Any, *, timeout: float, device: torch.device
) -> list[float]:
    """Seconds of forward plus backward of each layer on ``sample``, summed over passes.

    After one pass to warm up (first calls allocate and initialize), passes over all
    layers repeat until ``timeout`` seconds have gone by (at least one).
    """
    scatter(sample, 1)  # refuses what the pipeline would (an empty batch), as by size
    totals = [0.0] * len(module)
    # A lazy layer's copy made its parameters in the warm-up: a copy of that one then
    # times the layer as training runs it, not its initialization at every pass.
    warmed: dict[int, nn.Module] = {}
    with _profiling() as tracker:
        _time_pass(module, sample, device, totals, tracker, warmed)  # a warm-up, not counted
        totals = [0.0] * len(module)
        start = time.perf_counter()
        while True:
            _time_pass(module, sample, device, totals, tracker, warmed)
            if time.perf_counter() - start >= timeout:
                return totals


def _time_pass(
    module: nn.Sequential,
    sample: Any,
    device: torch.device,
    totals: list[float],
    tracker: _DetachingTracker,
    warmed: dict[int, nn.Module],
) -> None:
    """One pass over the layers, adding each one's forward and backward time to totals.

    Each layer is copied to the device for its turn only: the model as a whole need not
    fit there (that is what the pipeline is for); a lazy one's first copy that made its
    parameters is kept in ``warmed`` (the first pass fills it).
    """
    value = map_tensors(lambda x: x.to(device), sample)
    first = not warmed
    for j, layer in enumerate(_copies(module, device, warmed)):
        lazy = first and _is_lazy(layer)
        value = _fresh_input(value)
        _synchronize(device)
        begin = time.perf_counter()
        with _naming(j, layer, "balance_by_time"):
            output = layer(value)
            outputs = [y for y in flatten(output)[0] if isinstance(y, Tensor) and y.requires_grad]
            outputs += [y for y in tracker.stashed if y.requires_grad]  # their backward too
            if outputs:
                torch.autograd.backward(outputs, [_ones(y) for y in outputs])
        _synchronize(device)
        totals[j] += time.perf_counter() - begin
        if lazy:
            warmed[j] = layer
        tracker.stashed.clear()  # only sizes want them: kept, every pass's would pile up
        value = map_tensors(_leaf, output)


def layerwise_size(
    module: nn.Sequential, input: Any, *, chunks: int, param_scale: float, device: torch.device
) -> list[float]:
    """Bytes of each layer: activations of one micro-batch, plus parameters times a scale.

    Parameters that need grad count ``param_scale`` times (the gradient and optimizer
    state come with them); frozen ones count once.

    A layer's activations are its output, the skips it stashes (kept until a later
    layer pops them) and the tensors it saves for backward, but neither its input (the
    previous layer's output) nor its parameters, each storage counted once.
    """
    micro_batch = scatter(map_tensors(lambda x: x.to(device), input), chunks)[0]
    sizes = []
    value = micro_batch
    with _profiling() as tracker:
        for j, layer in enumerate(_copies(module, device)):
            value = _fresh_input(value)
            known = {key for x in _tensors(value) for key in _storages(x)}
            saved: dict[tuple[int, str], int] = {}

            def pack(x: Tensor, saved: dict[tuple[int, str], int] = saved) -> Tensor:
                saved.update(_storages(x))
                return x

            with (
                _naming(j, layer, "balance_by_size"),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x),
            ):
                output = layer(value)
            # After the call: a lazy layer makes its parameters there.
            known |= {key for p in layer.parameters() for key in _storages(p)}
            # Its outputs, and its skips: kept until a later layer pops them.
            for y in [*_tensors(output), *tracker.stashed]:
                saved.update(_storages(y))
            tracker.stashed.clear()
            activations = sum(size for key, size in saved.items() if key not in known)
            trained = sum(_bytes(p) for p in layer.parameters() if p.requires_grad)
            frozen = sum(_bytes(p) for p in layer.parameters() if not p.requires_grad)
            sizes.append(activations + trained * param_scale + frozen)
            value = map_tensors(_leaf, output)
    return sizes


def _bytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def _tensors(value: Any) -> list[Tensor]:
    return [x for x in flatten(value)[0] if isinstance(x, Tensor)]


def _storages(x: Tensor) -> dict[tuple[int, str], int]:
    """The storages of ``x`` (a sparse tensor's indices and values), each one's bytes."""
    if x.layout == torch.sparse_coo:
        parts = [x._indices(), x._values()]
    elif x.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [x.crow_indices(), x.col_indices(), x.values()]
    elif x.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [x.ccol_indices(), x.row_indices(), x.values()]
    else:
        parts = [x]
    sizes = {}
    for part in parts:
        storage = part.untyped_storage()
        sizes[(storage.data_ptr(), str(part.device))] = storage.nbytes()
    return sizes


def _ones(y: Tensor) -> Tensor:
    """A gradient of ones for ``y``: dense for a sparse one, which autograd accepts."""
    if y.layout == torch.strided:
        return torch.ones_like(y)
    return torch.ones(y.shape, dtype=y.dtype, device=y.device)


def _is_lazy(layer: nn.Module) -> bool:
    """Whether a module of ``layer`` makes its parameters at its first call."""
    return any(
        isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in layer.modules()
    )
