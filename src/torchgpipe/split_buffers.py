"""The buffers of a module that ``split`` runs: kept as they were, and watched for changes.

``split`` runs the example through the captured graph and the module several times
(``split_capture.value_kinds``, ``split_refusals.captured_as_computed``). Those runs
must leave the module as it came, and must each start from the same buffers, or two
runs of a forward that counts its calls in a buffer would compute two things: so each
goes inside :func:`kept_buffers`. :func:`changed_inside` finds the buffers that a
submodule called whole changes on the example (a step counter), which no change in
place in the graph shows: the split refuses such a buffer read in another stage, whose
copy of it would never change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn

from torchgpipe.rng import own_generators

__all__ = ["changed_inside", "kept_buffers"]


@contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s buffers back as they were when the block ends (values and tensors)."""
    saved = [
        (m, name, b, b._version, b.detach().clone())
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, version, value in saved:
                m._buffers[name] = b
                if b._version != version:
                    b.copy_(value)


def changed_inside(
    module: nn.Module, graph_run: fx.GraphModule, args: tuple[Any, ...]
) -> dict[fx.Node, tuple[str, ...]]:
    """For each call of a submodule in the graph, the buffers it changed (their names).

    And the tensors it keeps in plain attributes that it set (``self.aux_loss = ...``).
    Run as the example's other runs (eval mode, the caller's: a change made in training
    only, batch norm's statistics, is not seen), with generators of its own; the
    buffers put back after.
    """
    inside: dict[fx.Node, tuple[str, ...]] = {}

    class Changes(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op != "call_module":
                return super().run_node(n)
            sub = module.get_submodule(str(n.target))
            before = {name: (t, t._version) for name, t in _held(sub, str(n.target))}
            value = super().run_node(n)
            after = dict(_held(sub, str(n.target)))  # a tensor assigned anew too
            inside[n] = tuple(
                name
                for name, t in after.items()
                if name not in before or before[name][0] is not t or before[name][1] != t._version
            )
            return value

    # The graph's own buffers are the constants fx kept, too.
    with kept_buffers(module), kept_buffers(graph_run), own_generators():
        Changes(graph_run).run(*args)
    return inside


def _held(module: nn.Module, prefix: str) -> list[tuple[str, Tensor]]:
    """The buffers of ``module`` and the tensors its modules keep in plain attributes."""
    kept = [
        (f"{path}.{name}", value)
        for path, m in module.named_modules(prefix=prefix)
        for name, value in vars(m).items()
        if isinstance(value, Tensor) and not isinstance(value, nn.Parameter)
    ]
    return [*module.named_buffers(prefix=prefix), *kept]
