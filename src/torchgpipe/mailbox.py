"""The mailbox of a step: messages between its actions, and the failures that stop it."""

from __future__ import annotations

import threading
from typing import Any

from torchgpipe.schedules import (
    Action,
)

__all__ = ["KIND_NAMES", "Mailbox", "Stopped", "real_failures", "where"]


class Stopped(Exception):
    """Raised in a worker waiting for a message that will not come: a peer failed."""


class Mailbox:
    """Messages between the actions of a step, and the failures that stop it.

    ``put`` leaves a value under a key, ``take`` waits for the value under a key and
    raises :class:`Stopped` once the step is halted: by a failure here (``fail``) or
    one reported from elsewhere (``halt``).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[tuple[Any, ...], Any] = {}
        self.failures: list[tuple[BaseException, Action]] = []
        self.halted = False

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        """Leave ``value`` under ``key``, waking whoever waits for it."""
        with self._cond:
            self._box[key] = value
            self._cond.notify_all()

    def take(self, key: tuple[Any, ...]) -> Any:
        """Wait for the value under ``key`` and take it out.

        Raises:
            Stopped: the step was halted before the value came.
        """
        with self._cond:
            while key not in self._box:
                if self.halted:
                    raise Stopped
                self._cond.wait()
            return self._box.pop(key)

    def fail(self, error: BaseException, action: Action) -> None:
        """Record that ``action`` raised ``error``, and halt the step."""
        with self._cond:
            self.failures.append((error, action))
            self.halted = True
            self._cond.notify_all()

    def halt(self) -> None:
        """Stop the step: every ``take`` still waiting, or to come, raises :class:`Stopped`."""
        with self._cond:
            self.halted = True
            self._cond.notify_all()


KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def where(action: Action, place: str, m: int) -> str:
    """The note on an error raised in ``action``, ``place`` saying where it ran."""
    return (
        f"torchgpipe: raised in {action} (stage {action.stage} {place}, "
        f"{KIND_NAMES[action.kind]} of micro-batch {action.i} of {m})"
    )


def real_failures(step: Mailbox) -> list[tuple[BaseException, Action]]:
    """The step's failures, less the actions that only stopped because of them."""
    return [(e, a) for e, a in step.failures if not isinstance(e, Stopped)]
