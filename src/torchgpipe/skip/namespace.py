"""Namespaces: the scopes of skip names (``torchgpipe.skip.namespace``, as in 0.0.7)."""

from __future__ import annotations

import abc
import uuid
from functools import total_ordering
from typing import Any

__all__ = ["GLOBAL_NAMESPACE", "Namespace"]


@total_ordering
class Namespace(metaclass=abc.ABCMeta):  # noqa: B024  # ABCMeta: to register None
    """A scope for skip names, so that one skippable class can be used many times.

    Two ``Namespace()`` are always different. A copy of one (``copy.deepcopy``, pickle,
    ``torch.save``) equals it, as in torchgpipe 0.0.7: layers isolated in one namespace
    and copied one by one still find each other's skips. As there too, namespaces are
    ordered (by an id drawn at random: any order, but always the same), and ``None``
    counts as one (``isinstance(None, Namespace)``): the default, where
    ``layer.isolate(None)`` puts names back (:data:`GLOBAL_NAMESPACE` here).

    Example::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Down().isolate(ns1), Down().isolate(ns2),
                              Up().isolate(ns2), Up().isolate(ns1))
    """

    def __init__(self, label: str | None = None) -> None:
        self.label = label
        self._id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"Namespace({self.label!r})" if self.label else f"<Namespace {self._id.hex[:8]}>"

    def __eq__(self, other: object) -> bool:
        return other is not None and isinstance(other, Namespace) and other._id == self._id

    def __lt__(self, other: object) -> bool:
        if other is None or not isinstance(other, Namespace):
            return NotImplemented
        return self._id < other._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __setstate__(self, state: Any) -> None:
        # torchgpipe 0.0.7 pickled a namespace as its slot ``id`` alone: (None, {"id": ...}).
        slots = state[1] if isinstance(state, tuple) else state
        self.label, self._id = None, slots["id"]

    def __reduce__(self) -> tuple[Any, ...]:
        # deepcopy and pickle keep the identity; the global namespace stays the one object.
        if self is GLOBAL_NAMESPACE:
            return (_global_namespace, ())
        return (_restore_namespace, (self.label, self._id))


def _restore_namespace(label: str | None, id: uuid.UUID) -> Namespace:
    namespace = Namespace(label)
    namespace._id = id
    return namespace


def _global_namespace() -> Namespace:
    return GLOBAL_NAMESPACE


Namespace.register(type(None))  # the default namespace, as in torchgpipe 0.0.7

GLOBAL_NAMESPACE = Namespace("global")
"""Where names live that no :meth:`Skippable.isolate` put in a namespace of their own."""
