"""Skip connections: layers that pass tensors to later layers by name, across partitions.

Decorate a module class with :func:`skippable`; its ``forward`` yields
``stash(name, tensor)`` and ``pop(name)``. In GPipe, a skip goes straight from the
partition that stashes it to the one that pops it. See ``skippable.py`` for an example.
"""

from torchgpipe.skip.errors import SkipError
from torchgpipe.skip.layout import SkipLayout, SkipRoute, verify_skippables
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.skippable import pop, skippable, stash

__all__ = [
    "Namespace",
    "SkipError",
    "SkipLayout",
    "SkipRoute",
    "pop",
    "skippable",
    "stash",
    "verify_skippables",
]
