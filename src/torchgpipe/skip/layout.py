"""Where each skip lives: the static check of a Sequential, and the route of each skip.

:func:`verify_skippables` reads the skippable modules of a Sequential (its layers and
the modules inside them) and checks that every skip is stashed once, popped once, and
stashed before it is popped (or, inside each layer that uses it, stashed and popped in
turn: a block used again). :func:`skip_layout` then says, for a balance, which
partition stashes and which pops each skip: GPipe copies a skip once, from the one to
the other, and the partitions between them never see it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from torchgpipe.skip.skippable import Namespace, SkipKey, Skippable

__all__ = ["SkipLayout", "SkipRoute", "skip_layout", "verify_skippables"]


@dataclass(frozen=True)
class SkipRoute:
    """One skip: its name and namespace, and the partitions that stash and pop it."""

    namespace: Namespace
    name: str
    stash_partition: int
    pop_partition: int

    @property
    def key(self) -> SkipKey:
        """The skip's key, as skippable modules name it."""
        return SkipKey(self.namespace, self.name)

    @property
    def crosses(self) -> bool:
        """Whether the skip leaves the partition that stashes it."""
        return self.stash_partition != self.pop_partition


@dataclass(frozen=True)
class SkipLayout:
    """Which partition stashes and which pops every skip of a model.

    ``str(layout)`` is a table, one skip per line.
    """

    routes: tuple[SkipRoute, ...]

    def inbound(self, j: int) -> tuple[SkipRoute, ...]:
        """The skips partition ``j`` pops that an earlier partition stashed."""
        return tuple(r for r in self.routes if r.pop_partition == j and r.crosses)

    def outbound(self, j: int) -> tuple[SkipKey, ...]:
        """The keys of the skips partition ``j`` stashes for a later partition."""
        return tuple(r.key for r in self.routes if r.stash_partition == j and r.crosses)

    def __str__(self) -> str:
        if not self.routes:
            return "no skips"
        lines = [f"{'skip':<40} {'stashed by':>10} {'popped by':>10}"]
        for r in self.routes:
            name = str(r.key)
            lines.append(f"{name:<40} {r.stash_partition:>10} {r.pop_partition:>10}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Use:
    order: tuple[int, ...]  # positions along the path of Sequentials that hold the module
    where: str  # how to name it in a message

    @property
    def layer(self) -> int:
        """The index of the top-level layer the module is in."""
        return self.order[0]

    def before(self, other: _Use) -> bool:
        """Whether this module surely runs before ``other`` (False when unknown).

        Children of a Sequential run in order; inside any other module, the order in
        which children are called is not known, so their positions are not compared.
        """
        common = min(len(self.order), len(other.order))
        return self.order[:common] < other.order[:common]


def _skippables(module: nn.Sequential) -> Iterator[tuple[_Use, Skippable]]:
    """Every use of a skippable module inside ``module``, with its position and a name.

    A module that appears twice in a Sequential (``Sequential(down, up, down)``) is two
    uses, each in its place: ``named_modules(remove_duplicate=False)`` walks every
    occurrence, where ``named_children()`` gives a repeated child once and would hide a
    second stash. A Sequential calls each of its children; another module may hold one
    under a second name that its forward never calls (``self.first = self.down``): a
    module met again under the same parent, not a Sequential, is not counted again, nor
    anything inside it. Met under another parent, it may be called by both: refused.
    """
    parents: dict[str, tuple[nn.Module, tuple[int, ...]]] = {}
    children: dict[str, int] = {}  # how many children of each parent were walked so far
    first: dict[int, str] = {}  # where each skippable module was first met, by id
    seen: dict[int, int] = {}  # every module met so far: the id of its first parent, by id
    for path, sub in module.named_modules(remove_duplicate=False):  # parents first
        order: tuple[int, ...] = ()
        if path:
            parent_path = path.rpartition(".")[0]
            if parent_path not in parents:  # inside a second name, left out
                continue
            parent, order = parents[parent_path]
            index = children.get(parent_path, 0)
            children[parent_path] = index + 1
            if seen.get(id(sub)) == id(parent) and not isinstance(parent, nn.Sequential):
                continue  # a second name of a module, not a second use
            if isinstance(parent, nn.Sequential):
                order = (*order, index)
            seen.setdefault(id(sub), id(parent))
            if isinstance(sub, Skippable):
                where = f"layer {path} ({type(sub).__name__}"
                if id(sub) in first:  # isolate() cannot tell two uses of one object apart
                    where += f", the same object as layer {first[id(sub)]}; use a new instance"
                first.setdefault(id(sub), path)
                yield _Use(order, f"{where})"), sub
        parents[path] = (sub, order)


def _uses(module: nn.Sequential) -> tuple[dict[SkipKey, list[_Use]], dict[SkipKey, list[_Use]]]:
    stashes: dict[SkipKey, list[_Use]] = {}
    pops: dict[SkipKey, list[_Use]] = {}
    for use, sub in _skippables(module):
        for key in sub.stash_keys():
            stashes.setdefault(key, []).append(use)
        for key in sub.pop_keys():
            pops.setdefault(key, []).append(use)
    return stashes, pops


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every skip of ``module`` is stashed once, popped once, in that order.

    Skippable modules are looked for among the layers and inside them. Every problem is
    reported at once.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or there is a skip that is
            stashed but never popped, popped but never stashed, stashed or popped by
            more than one module, both stashed and popped by one, or popped by a layer
            before the layer that stashes it.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"verify_skippables takes an nn.Sequential, got {type(module).__name__}")
    stashes, pops = _uses(module)
    problems = []
    for key in [*stashes, *(k for k in pops if k not in stashes)]:
        stashed, popped = stashes.get(key, []), pops.get(key, [])
        if len(stashed) > 1 and _pairs_within_layers(stashed, popped):
            continue  # a block that stashes and pops it, used again: its skip stays inside
        if len(stashed) > 1:
            problems.append(f"{key} is stashed by {_list(stashed)}")
        if len(popped) > 1:
            problems.append(f"{key} is popped by {_list(popped)}")
        if not popped:
            problems.append(f"{key} is stashed by {_list(stashed)} but never popped")
        elif not stashed:
            problems.append(f"{key} is popped by {_list(popped)} but never stashed")
        elif popped[0] == stashed[0]:
            problems.append(f"{key} is both stashed and popped by {stashed[0].where}")
        elif popped[0].before(stashed[0]):
            problems.append(
                f"{key} is popped by {popped[0].where} before {stashed[0].where} stashes it"
            )
    if problems:
        raise TypeError(
            "the skip connections do not match up:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nEach skip name is stashed once and popped once, by a later layer; to use "
            "one skippable class more than once, give each use a Namespace of its own "
            "with module.isolate(Namespace())"
        )


def _pairs_within_layers(stashed: list[_Use], popped: list[_Use]) -> bool:
    """Whether each layer that uses the skip stashes it as often as it pops it.

    As a residual block made of skippable modules, used at several depths without
    ``isolate``: each stash is popped inside the one layer (so inside one partition),
    as torchgpipe 0.0.7 ran them (it looked at the layers alone). The order inside a
    layer is not judged (inside a module other than a Sequential it is not known): a
    pop before its stash fails at run time, by its name.
    """
    if {use.where for use in stashed} & {use.where for use in popped}:
        return False  # one module stashes and pops it
    layers = {use.layer for use in [*stashed, *popped]}
    count = Counter(use.layer for use in stashed)
    count.subtract(use.layer for use in popped)
    return all(count[layer] == 0 for layer in layers)


def _list(uses: list[_Use]) -> str:
    return " and ".join(use.where for use in uses)


def skip_layout(module: nn.Sequential, balance: Sequence[int]) -> SkipLayout:
    """The route of every skip of ``module`` when split by ``balance``.

    ``module`` must pass :func:`verify_skippables`.
    """
    partition_of = [j for j, size in enumerate(balance) for _ in range(size)]
    stashes, pops = _uses(module)
    routes = tuple(
        SkipRoute(
            key.namespace,
            key.name,
            partition_of[stashes[key][0].layer],
            partition_of[pops[key][0].layer],
        )
        for key in stashes
    )
    return SkipLayout(routes)
