"""A layer swapped after wrapping: followed by the partitions, or refused.

A ``GPipe`` (or a ``PipelineStage``) registers its layers as its own children, under
their names in the plain model (``model.fc``), and its partitions hold the same modules.
Assigning a layer under a layer's name (``model.fc = nn.Linear(...)``, as torch's
``convert_sync_batchnorm`` and adapter injectors do to every child they replace) changes
the children alone; assigning into a partition (``model.partitions[1][0] = ...``), the
partition alone. Left so, the forward would run one layer while ``parameters()`` and
``state_dict()`` held another, and an optimizer would train a layer the forward does not
run. So every call compares both with the layers the pipeline was last built with
(:meth:`Layers.follow`, an identity test per layer) and puts a layer assigned under its
name into its partition too, where nothing else needs building again for it: the layer
is on its partition's device, shares no parameter with another layer, is neither
skippable nor a split model's stage, and, with deferred batch norm, has its batch norms
converted already. Anything else is refused, saying what to do: a layer removed or
added, one of those, or a layer swapped in a partition alone (until the next call,
``parameters()`` would not hold it: an optimizer made in between would miss it).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from itertools import chain
from operator import is_
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.guards import RecomputeGuard
from torchgpipe.skip.skippable import Skippable
from torchgpipe.split_stage import Stage
from torchgpipe.tied import Ties

__all__ = ["Layers"]


class Layers:
    """The layers a pipeline runs, and what it keeps per partition that follows them.

    ``partitions``, ``devices`` and ``guards`` per partition (the guards are made anew
    for a partition whose layer was swapped); ``deferred``: whether the batch norms are
    deferred. :attr:`deferred` lists the layers' deferred batch norms, each once.
    """

    def __init__(
        self,
        partitions: Mapping[int, nn.Sequential],
        devices: Mapping[int, torch.device],
        ties: Ties,
        guards: MutableMapping[int, RecomputeGuard],
        deferred: bool,
    ) -> None:
        self.partitions, self.devices, self.guards = partitions, devices, guards
        self.converts = deferred
        # Per layer: the partition holding it, its name there and among the children.
        self.where = [(j, key) for j, part in partitions.items() for key in part._modules]
        self.names = tuple(key for _, key in self.where)  # a child added later is no layer
        # The modules holding a tied weight's copy (not their ids, which a copy of the
        # model would not share): their layers cannot be swapped.
        self.tied = [m for group in ties.holders for copy in group for m, _ in copy]
        self.built: list[nn.Module] = [
            layer for j, key in self.where if (layer := partitions[j]._modules[key]) is not None
        ]
        self.counts = {j: len(part._modules) for j, part in partitions.items()}
        self.deferred: list[DeferredBatchNorm] = self._deferred()

    def _deferred(self) -> list[DeferredBatchNorm]:
        if not self.converts:
            return []
        every = (m for x in self.built for m in x.modules() if isinstance(m, DeferredBatchNorm))
        return list(dict.fromkeys(every))  # a module two layers hold, once

    def present(self, children: Mapping[str, nn.Module | None]) -> list[tuple[str, nn.Module]]:
        """The layers under their names, as the children hold them (but those removed)."""
        return [(n, m) for n in self.names if (m := children.get(n)) is not None]

    def deferred_now(self, children: MutableMapping[str, nn.Module | None]) -> list[Any]:
        """:attr:`deferred`, a layer swapped since followed first (:meth:`follow`)."""
        self.follow(children)
        return self.deferred

    def follow(self, children: MutableMapping[str, nn.Module | None]) -> bool:
        """Put each layer assigned under its name into its partition; whether one was.

        ``children``: the pipeline's ``_modules``, its layers under their names.

        Raises:
            RuntimeError: a layer was removed, added, swapped in a partition alone, or
                for one the pipeline cannot take without being built again.
        """
        partitions = self.partitions
        inside = [layer for part in partitions.values() for layer in part._modules.values()]
        now = list(map(children.get, self.names))
        if len(inside) == len(now) and all(map(is_, chain(now, inside), self.built * 2)):
            return False  # (by identity: a module's own __eq__ could hide a swap)
        tied = {id(m) for m in self.tied}
        counts = {p: len(part._modules) for p, part in partitions.items()}
        if counts != self.counts:
            _refuse(f"its partitions hold {counts} layers, built with {self.counts}")
        swaps = []
        for k, (name, (j, key)) in enumerate(zip(self.names, self.where, strict=True)):
            old, new, held = self.built[k], children.get(name), partitions[j]._modules.get(key)
            if held is not old and held is not new:  # parameters() would not see it
                _refuse(
                    f"layer {name!r} was swapped in partition {j} alone: assign it under its "
                    f"name (setattr(model, {name!r}, layer)), which the partitions follow, "
                    f"and put the partition's back or assign it there too"
                )
            if new is old:
                continue
            if new is None:
                _refuse(f"layer {name!r} was removed")
            if any(id(m) in tied for m in old.modules()):
                _refuse(f"layer {name!r} holds a weight tied to another layer")
            _check(name, old, new, self.devices[j], self.converts)
            swaps.append((k, name, j, key, new))
        # A new layer that another layer is, or holds a parameter of, would be used twice.
        swapped = {k for k, *_ in swaps}
        others = [m for k, m in enumerate(self.built) if k not in swapped]
        seen = {id(t) for m in others for t in chain(m.parameters(), m.buffers(), [m])}
        for _, name, _, _, new in swaps:
            own = {id(t) for t in chain(new.parameters(), new.buffers(), [new])}
            if own & seen:
                _refuse(f"the new layer {name!r} is, or shares a tensor with, another layer")
            seen |= own
        for k, name, j, key, new in swaps:
            children[name] = partitions[j]._modules[key] = self.built[k] = new
            self.guards[j] = RecomputeGuard(partitions[j])  # what it learned was the old's
        self.deferred = self._deferred()
        return True


def _check(name: str, old: nn.Module, new: nn.Module, device: torch.device, deferred: bool) -> None:
    if any(isinstance(m, Skippable | Stage) for m in chain(old.modules(), new.modules())):
        _refuse(f"layer {name!r} (old or new) is skippable or a split model's stage")
    misplaced = [
        str(t.device) for t in chain(new.parameters(), new.buffers()) if t.device != device
    ]
    if misplaced:
        _refuse(
            f"the new layer {name!r} is on {misplaced[0]}, its partition on {device}: "
            f"move it there (.to({str(device)!r})) before assigning it"
        )
    if deferred and any(
        isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm) for m in new.modules()
    ):
        _refuse(
            f"the new layer {name!r} holds batch norms not converted for deferred batch "
            f"norm: assign DeferredBatchNorm.convert_deferred_batch_norm(layer) instead"
        )


def _refuse(why: str) -> NoReturn:
    raise RuntimeError(
        f"torchgpipe: the layers changed after wrapping, in a way the pipeline cannot "
        f"follow: {why}. Its partitions were built from the layers it was given; build "
        f"it again from your nn.Sequential, changed the same way"
    )
