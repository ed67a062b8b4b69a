"""The mailbox of a step: messages between its actions, and the failures that stop it."""

from __future__ import annotations

import sys
import threading
from contextlib import suppress
from typing import Any

from torchgpipe.schedules import (
    Action,
)

__all__ = ["KIND_NAMES", "Mailbox", "Stopped", "add_note", "real_failures", "where"]


class Stopped(Exception):
    """Raised in a worker waiting for a message that will not come: a peer failed."""


class Mailbox:
    """Messages between the actions of a step, and the failures that stop it.

    ``put`` leaves a value under a key, ``take`` waits for the value under a key and
    raises :class:`Stopped` once the step is halted: by a failure here (``fail``) or
    one reported from elsewhere (``halt``).

    A waiting ``take`` sleeps on a lock of its own, which the ``put`` of its key
    releases: a message wakes the one thread that waits for it, not every worker of
    the step (each woken thread would take the GIL from the ones computing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._box: dict[tuple[Any, ...], Any] = {}
        self._waiting: dict[tuple[Any, ...], threading.Lock] = {}
        self.failures: list[tuple[BaseException, Action]] = []
        self.halted = False

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        """Leave ``value`` under ``key``, waking whoever waits for it."""
        with self._lock:
            self._box[key] = value
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.release()

    def take(self, key: tuple[Any, ...]) -> Any:
        """Wait for the value under ``key`` and take it out.

        Raises:
            Stopped: the step was halted before the value came.
        """
        with self._lock:
            if key in self._box:
                return self._box.pop(key)
            if self.halted:
                raise Stopped
            waiter = threading.Lock()
            waiter.acquire()
            self._waiting[key] = waiter
        waiter.acquire()  # released by the put of the key, or by a halt
        with self._lock:
            if key in self._box:
                return self._box.pop(key)
            raise Stopped

    def begin(self, position: int) -> None:
        """Called by a rank before its action ``position`` (of those the run gives it).

        Nothing to do in one process; across processes, the transfers that must be
        issued before that action are (``distributed/exchange.py``).
        """

    def fail(self, error: BaseException, action: Action) -> None:
        """Record that ``action`` raised ``error``, and halt the step."""
        with self._lock:
            self.failures.append((error, action))
        self.halt()

    def halt(self) -> None:
        """Stop the step: every ``take`` still waiting, or to come, raises :class:`Stopped`."""
        with self._lock:
            self.halted = True
            waiters = list(self._waiting.values())
            self._waiting.clear()
        for waiter in waiters:
            waiter.release()


KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def where(action: Action, place: str, m: int) -> str:
    """The note on an error raised in ``action``; ``place`` names its stage and device."""
    return (
        f"torchgpipe: raised in {action} ({place}, "
        f"{KIND_NAMES[action.kind]} of micro-batch {action.i} of {m})"
    )


def real_failures(step: Mailbox) -> list[tuple[BaseException, Action]]:
    """The step's failures, less the actions that only stopped because of them."""
    return [(e, a) for e, a in step.failures if not isinstance(e, Stopped)]


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10, which has no notes, set ``__notes__``.

    Python 3.10 does not print ``__notes__``, but code that catches the exception can
    read them there, as on later versions. An exception whose ``__notes__`` is not a
    list (a tuple set by its code) is left as it is: the error must reach the caller as
    itself, not as the ``TypeError`` that adding a note to it raises.
    """
    if sys.version_info >= (3, 11):
        with suppress(TypeError):
            error.add_note(note)
        return
    if not isinstance(getattr(error, "__notes__", []), list):
        return
    with suppress(AttributeError):  # an exception type with __slots__ and no __dict__
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
