"""Skip errors: the one exception for a skip used against its declaration."""

from __future__ import annotations

__all__ = ["SkipError"]


class SkipError(ValueError, RuntimeError):
    """A skippable module used a skip against its ``@skippable`` declaration.

    Raised when a ``forward`` stashes or pops a name it did not declare, uses a name
    twice in one call, returns without stashing or popping a declared name, or pops a
    skip that no earlier layer stashed. The message names the layer and the skip, and
    says how to fix it.

    It is a ``ValueError`` (misuse, as elsewhere in torchgpipe) and a ``RuntimeError``
    (what torchgpipe 0.0.7 raised), so code that catches either still catches it.
    """
