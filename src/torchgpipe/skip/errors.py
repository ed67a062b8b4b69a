"""Skip errors: the exception for a skip used against its declaration, the declaration's checks."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SkipError", "declared_names"]


class SkipError(ValueError, RuntimeError):
    """A skippable module used a skip against its ``@skippable`` declaration.

    Raised when a ``forward`` stashes or pops a name it did not declare, uses a name
    twice in one call, returns without stashing or popping a declared name, or pops a
    skip that no earlier layer stashed. The message names the layer and the skip, and
    says how to fix it.

    It is a ``ValueError`` (misuse, as elsewhere in torchgpipe) and a ``RuntimeError``
    (what torchgpipe 0.0.7 raised), so code that catches either still catches it.
    """


def declared_names(names: Iterable[str], what: str) -> tuple[str, ...]:
    """The names of ``@skippable(stash=...)`` or ``(pop=...)`` (``what``), checked.

    Raises:
        TypeError: ``names`` is not a list of strings (a class: ``@skippable`` was used
            without its parentheses).
        ValueError: a name is listed twice.
    """
    if isinstance(names, type):
        raise TypeError(
            f"@skippable was given the class {names.__name__} as its {what} names; "
            f"call it with its parentheses: @skippable(stash=[...], pop=[...])"
        )
    if isinstance(names, str):
        raise TypeError(f"@skippable({what}=...) takes a list of names, got the string {names!r}")
    try:
        result = tuple(names)
    except TypeError:
        raise TypeError(
            f"@skippable({what}=...) takes a list of names, such as {what}=['skip'], got {names!r}"
        ) from None
    bad = [name for name in result if not isinstance(name, str)]
    if bad:
        raise TypeError(f"skip names are strings, got {bad} in @skippable({what}=...)")
    repeated = sorted({name for name in result if result.count(name) > 1})
    if repeated:
        raise ValueError(f"@skippable({what}=...) lists {repeated} more than once")
    return result
