"""Skippable modules: layers that hand tensors to later layers by name.

A skippable module's ``forward`` is a generator. It yields ``stash(name, tensor)`` to
leave a tensor for a later layer, and ``pop(name)`` to take one left by an earlier
layer (the ``yield`` evaluates to the tensor), then returns its output as usual::

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return self.conv(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return self.conv(x) + skip

Where the tensors go is up to whoever runs the layers (see ``tracker.py``): a plain
``nn.Sequential`` keeps them on the calling thread until they are popped; GPipe sends
each one from the partition that stashes it straight to the partition that pops it.

A ``forward`` that yields nothing may return its output directly, as in torchgpipe
0.0.7. A skip used against the declaration raises :class:`SkipError`.

Names are scoped by a :class:`Namespace`. ``module.isolate(ns)`` moves a module's names
into ``ns``, so that one class can appear several times in a model (a U-Net's levels)
without their skips colliding. Names no namespace was given live in a global one.
"""

from __future__ import annotations

import sys
import threading
import uuid
import weakref
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

from torch import Tensor, nn

from torchgpipe.skip.errors import SkipError, declared_names
from torchgpipe.skip.namespace import (  # the last two: where older pickles look for them
    GLOBAL_NAMESPACE,
    Namespace,
    _global_namespace,  # noqa: F401
    _restore_namespace,  # noqa: F401
)
from torchgpipe.skip.tracker import current_tracker

__all__ = ["Namespace", "SkipKey", "Skippable", "pop", "skippable", "stash"]


@dataclass(frozen=True)
class SkipKey:
    """A skip's identity: its name within its namespace."""

    namespace: Namespace
    name: str

    def __str__(self) -> str:
        if self.namespace is GLOBAL_NAMESPACE:
            return repr(self.name)
        return f"{self.name!r} in {self.namespace!r}"


@dataclass(frozen=True)
class stash:  # lower case: the name torchgpipe users write, stash(name, x)
    """Yielded by a skippable ``forward`` to leave ``tensor`` for a later layer.

    ``tensor`` may be None. The ``yield`` evaluates to None.
    """

    name: str
    tensor: Tensor | None


@dataclass(frozen=True)
class pop:  # lower case: the name torchgpipe users write, pop(name)
    """Yielded by a skippable ``forward`` to take the tensor stashed as ``name``.

    The ``yield`` evaluates to that tensor (or None, if None was stashed).
    """

    name: str


class _NameSet:
    """A read-only frozenset view of a tuple of names, on a class and its instances."""

    def __init__(self, source: str) -> None:
        self._source = source
        self._name = source

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: object, owner: type | None = None) -> frozenset[str]:
        names: tuple[str, ...] = getattr(instance if instance is not None else owner, self._source)
        return frozenset(names)

    def __set__(self, instance: object, value: object) -> NoReturn:
        raise AttributeError(
            f"{self._name} is read-only: it is {self._source} as a set; declare the names "
            f"with @skippable(stash=[...], pop=[...])"
        )


class Skippable(nn.Module):
    """The base that :func:`skippable` adds to a class; drives its generator ``forward``.

    Subclasses get ``stash_names`` and ``pop_names`` (the declared names, in order)
    from the decorator; ``stashable_names`` and ``poppable_names`` are the same names
    as frozensets, under torchgpipe 0.0.7's spelling. A subclass of a skippable class
    may override ``forward`` with another generator: it keeps the declared names,
    unless decorated again.
    """

    stash_names: tuple[str, ...] = ()
    pop_names: tuple[str, ...] = ()
    stashable_names = _NameSet("stash_names")
    """``stash_names`` as a frozenset, read-only: torchgpipe 0.0.7's name for them."""
    poppable_names = _NameSet("pop_names")
    """``pop_names`` as a frozenset, read-only: torchgpipe 0.0.7's name for them."""
    _generator_forward: Callable[..., Generator[Any, Any, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is None:
            return
        # The generator function is kept aside and forward drives it (Skippable.forward),
        # checking when called that it gives a generator: a forward wrapped by a
        # decorator, or returning a helper's generator, is one only by what it returns.
        cls._generator_forward = forward
        cls.forward = _driver(forward)  # type: ignore[method-assign]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as any module, or, when its class is out of pickle's reach, rebuilt.

        ``skippable(...)(Base)`` called as a function (not as a decorator) makes a class
        that takes ``Base``'s name, where the module still holds ``Base``: pickle finds
        ``Base`` under that name, "not the same object". Such a module is pickled as
        the decoration of ``Base`` with the same names, redone when it is loaded.
        """
        cls = type(self)
        made: _Made | None = cls.__dict__.get("_skippable_of")
        if made is None or _reachable(cls):
            return super().__reduce_ex__(protocol)
        state = self.__getstate__()  # type: ignore[no-untyped-call]  # unannotated in torch
        return (_rebuild, made, state)

    def isolate(
        self, ns: Namespace | None, *, only: str | Iterable[str] | None = None
    ) -> Skippable:
        """Put this module's skip names (or the names in ``only``) into namespace ``ns``.

        ``None``: the default namespace, as in torchgpipe 0.0.7.

        ``only`` is one name or several: ``only="h"`` and ``only=["h"]`` are alike.
        Returns the module itself, so that it can be used inline in a Sequential.

        Raises:
            TypeError: ``ns`` is not a :class:`Namespace`, or ``only`` is not a name or an
                iterable of names.
            ValueError: a name in ``only`` is not one this module stashes or pops.
        """
        if ns is None:  # the default namespace, as in torchgpipe 0.0.7
            ns = GLOBAL_NAMESPACE
        if not isinstance(ns, Namespace):
            raise TypeError(f"isolate() takes a Namespace, got {ns!r}; create one: Namespace()")
        declared = (*self.stash_names, *self.pop_names)
        names = declared if only is None else _only_names(only, declared)
        unknown = [name for name in names if name not in declared]
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no skip named {unknown}; the names it declares "
                f"are {list(declared)}"
            )
        namespaces = dict(self._skip_namespaces())
        namespaces.update(dict.fromkeys(names, ns))
        self.__dict__["_namespaces"] = namespaces
        return self

    def _skip_namespaces(self) -> dict[str, Namespace]:
        namespaces: dict[str, Namespace] = self.__dict__.get("_namespaces", {})
        return namespaces

    def skip_key(self, name: str) -> SkipKey:
        """The key of ``name`` for this module: the name in its namespace."""
        return SkipKey(self._skip_namespaces().get(name, GLOBAL_NAMESPACE), name)

    def stash_keys(self) -> tuple[SkipKey, ...]:
        """The keys of the skips this module stashes, in declared order."""
        return tuple(self.skip_key(name) for name in self.stash_names)

    def pop_keys(self) -> tuple[SkipKey, ...]:
        """The keys of the skips this module pops, in declared order."""
        return tuple(self.skip_key(name) for name in self.pop_names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the decorated class's generator ``forward``, serving its stashes and pops.

        A ``forward`` that returns something other than a generator yielded nothing:
        what it returned is the output, as in torchgpipe 0.0.7.

        Raises:
            TypeError: the generator yielded something other than ``stash``/``pop``,
                or stashed something other than a tensor or None.
            SkipError: a name was not declared, was used twice, or a declared name
                was not stashed or popped by the time ``forward`` returned.
        """
        return self._drive(type(self)._generator_forward, args, kwargs)

    def _drive(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``function`` (a class's own forward); a base's shares the outer record."""
        records = _driving.__dict__.setdefault("records", {})
        outer = id(self) not in records
        if outer:  # stashed, popped, and popped but given back by a base that failed
            records[id(self)] = (set(), set(), set())
        record = records[id(self)]
        try:
            return self._serve(function, args, kwargs, record, outer)
        except BaseException:
            if outer:  # the whole call failed: it leaves nothing waiting
                for name in record[0] | record[2]:
                    current_tracker().take_back(self.skip_key(name))
            raise
        finally:
            if outer:
                del records[id(self)]

    def _serve(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        record: tuple[set[str], set[str], set[str]],
        check: bool,
    ) -> Any:
        stashed, popped, given = record
        generator = function(self, *args, **kwargs)
        if not isinstance(generator, Generator):
            if check:
                self._check_all_used(stashed, popped, generator=False)
            return generator
        tracker = current_tracker()
        had = (set(stashed), set(popped))  # a base's forward failing gives back its own
        got: dict[str, Tensor | None] = {}
        try:
            request = next(generator)
            while True:
                reply = None
                if isinstance(request, stash):
                    self._check_use(request.name, self.stash_names, stashed, "stash")
                    if request.tensor is not None and not isinstance(request.tensor, Tensor):
                        raise TypeError(
                            f"{self._where()} stashed {type(request.tensor).__name__} as skip "
                            f"{request.name!r}; a skip is a tensor or None"
                        )
                    tracker.stash(self.skip_key(request.name), request.tensor)
                elif isinstance(request, pop):
                    self._check_use(request.name, self.pop_names, popped, "pop")
                    reply = got[request.name] = tracker.pop(self.skip_key(request.name))
                else:
                    hint = (isinstance(request, Tensor) and _YIELD_FROM_BASE) or ""
                    raise TypeError(
                        f"{self._where()} yielded {request!r}; a skippable forward yields "
                        f"only stash(name, tensor) and pop(name), and returns its output"
                        f"{hint}"
                    )
                request = generator.send(reply)
        except StopIteration as stop:
            output = stop.value
        except BaseException:
            for name in stashed - had[0]:  # a failed call leaves nothing waiting
                tracker.take_back(self.skip_key(name))
            for name in got if not check else ():  # for the subclass's forward to retry
                tracker.give_back(self.skip_key(name), got[name])
                given.add(name)
            stashed &= had[0]
            popped &= had[1]
            raise
        finally:
            generator.close()
        if check:
            self._check_all_used(stashed, popped)
        return output

    def _where(self) -> str:
        return f"{type(self).__name__}.forward"

    def _check_use(self, name: str, declared: tuple[str, ...], used: set[str], verb: str) -> None:
        if name not in declared:
            raise SkipError(
                f"{self._where()} yielded {verb}({name!r}) but {type(self).__name__} "
                f"declares {verb}={list(declared)}; add {name!r} to @skippable({verb}=[...])"
            )
        if name in used:
            raise SkipError(
                f"{self._where()} yielded {verb}({name!r}) twice in one call; each skip is "
                f"stashed once and popped once per forward"
            )
        used.add(name)

    def _check_all_used(
        self, stashed: set[str], popped: set[str], *, generator: bool = True
    ) -> None:
        missing = [f"stash({n!r})" for n in self.stash_names if n not in stashed]
        missing += [f"pop({n!r})" for n in self.pop_names if n not in popped]
        if not missing:
            return
        how = "returned" if generator else "returned its output directly (not a generator),"
        raise SkipError(
            f"{self._where()} {how} without yielding {', '.join(missing)}; each declared "
            f"skip is stashed once and popped once per forward (stash None when there is "
            f"nothing to pass), or leave it out of @skippable(...)"
        )


_YIELD_FROM_BASE = " (a base's super().forward(x) returns its output: call it, not yield from it)"
_driving = threading.local()
"""``records``: by id, what each module running forward on this thread used so far."""


def _driver(function: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` driving ``function``, one class's own: each class has its own."""

    def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
        return self._drive(function, args, kwargs)

    forward.__doc__ = Skippable.forward.__doc__
    forward.__qualname__ = f"{function.__qualname__.rpartition('.')[0] or 'Skippable'}.forward"
    return forward


ModuleType = TypeVar("ModuleType", bound=type[nn.Module])
_Made = tuple[type[nn.Module], tuple[str, ...], tuple[str, ...], str]
"""What :func:`skippable` made a class of: the class decorated, its stash and pop names,
and a token of its own (the class, in this process: :data:`_MADE`)."""

_MADE: weakref.WeakValueDictionary[str, type[Skippable]] = weakref.WeakValueDictionary()
"""Each class :func:`skippable` made, by its token, as long as it lives."""


def _only_names(only: str | Iterable[str], declared: tuple[str, ...]) -> tuple[str, ...]:
    """``isolate``'s ``only`` as a tuple of names: a string is one name, not its letters."""
    if isinstance(only, str):
        return (only,)
    try:
        iterator = iter(only)
    except TypeError:
        names = None
    else:
        names = tuple(iterator)  # an error the iterable raises itself goes through
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"isolate()'s only takes a skip name or an iterable of names, got {only!r}; "
            f"the names this module declares are {list(declared)}"
        )
    return names


def _reachable(cls: type) -> bool:
    """Whether pickle finds ``cls`` itself under its module and qualified name."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _rebuild(
    base: type[nn.Module], stash: tuple[str, ...], pop: tuple[str, ...], token: str
) -> Skippable:
    """An empty module of ``skippable(stash=stash, pop=pop)(base)``, for unpickling.

    Of the very class pickled where it still lives (a copy, a load in the same process);
    elsewhere, of ``base`` decorated again.
    """
    cls = _MADE.get(token)
    if cls is None:  # another process, or the class is gone
        cls = cast(type[Skippable], skippable(stash=stash, pop=pop)(base))
    module: Skippable = cls.__new__(cls)
    return module


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[ModuleType], ModuleType]:
    """Make an ``nn.Module`` class whose ``forward`` is a generator into a skippable one.

    ``stash`` and ``pop`` declare the names its ``forward`` yields ``stash(name,
    tensor)`` and ``pop(name)`` for. The decorated class is a subclass of the original
    and of :class:`Skippable`, with the same name; it works in a plain ``nn.Sequential``
    as well as in GPipe.

    ``forward`` is a generator function, or any callable that returns a generator (a
    generator function wrapped by ``functools.wraps``, or a ``forward`` that returns a
    helper's generator). As in torchgpipe 0.0.7, a ``forward`` may also return its
    output directly: it yields nothing, so the class must declare no names, or calling
    it raises :class:`SkipError`.

    The class gets ``stash_names`` and ``pop_names`` (tuples, in declared order), and
    torchgpipe 0.0.7's ``stashable_names`` and ``poppable_names`` (frozensets).

    Called as a function, ``StashBlock = skippable(stash=["skip"])(Block)``, it leaves
    ``Block`` as it was; modules of ``StashBlock`` still pickle (``torch.save``), as
    ``Block`` decorated with those names again when they are loaded.

    Raises:
        TypeError: the decorated object is not an ``nn.Module`` class; ``stash`` or
            ``pop`` is not a list of strings (``@skippable`` without its parentheses).
        ValueError: a name is listed twice in ``stash`` or in ``pop``.
    """
    # A name both stashed and popped is declared, as in torchgpipe 0.0.7, and refused
    # by verify_skippables (and GPipe): the module would pass a skip to itself.
    stash_names, pop_names = declared_names(stash, "stash"), declared_names(pop, "pop")

    def decorate(cls: ModuleType) -> ModuleType:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {cls!r}")
        # A subclass of a skippable class is decorated again to change its names.
        already = issubclass(cls, Skippable)
        forward: Callable[..., Any] = cls.forward
        if issubclass(cls, Skippable):
            forward = cls._generator_forward
        made: _Made = (cls, stash_names, pop_names, uuid.uuid4().hex)
        namespace = {
            "stash_names": stash_names,
            "pop_names": pop_names,
            "forward": forward,  # taken aside by Skippable.__init_subclass__
            "_skippable_of": made,  # for pickling (Skippable.__reduce_ex__)
            "__repr__": _marked_repr,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        bases = (cls,) if already else (Skippable, cls)
        decorated: type[Skippable] = type(cls.__name__, bases, namespace)
        _MADE[made[3]] = decorated
        return decorated  # type: ignore[return-value]  # a subclass of cls

    return decorate


def _marked_repr(self: nn.Module) -> str:
    """A decorated module's own repr, marked as 0.0.7 marked it: ``@skippable(...)``."""
    reprs = (c.__dict__.get("__repr__") for c in type(self).__mro__)
    return f"@skippable({next(r for r in reprs if r not in (None, _marked_repr))(self)})"


def __getattr__(name: str) -> Any:
    """``verify_skippables``, where torchgpipe 0.0.7 had it (the layout builds on this module)."""
    if name == "verify_skippables":
        from torchgpipe.skip.layout import verify_skippables

        return verify_skippables
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
