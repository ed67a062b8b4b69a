"""What a transport is: the calls every one makes, and what a failure to reach a peer raises.

:mod:`torchgpipe.distributed.transport` says what the two channels carry and holds
:class:`~torchgpipe.distributed.transport.ProcessGroupTransport`; ``local.py`` holds
the transport of threads of one process that tests use.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

__all__ = [
    "BUILD_FIRST",
    "GREETING",
    "Message",
    "Pending",
    "Transfer",
    "Transport",
    "TransportError",
    "wait_apart",
]

GREETING = ("greet",)  # the header of a transport's first message to each peer
BUILD_FIRST = (
    "build the stages in every process at once, before any call, and make the same calls in each"
)

Message = tuple[Any, list[Tensor]]


class TransportError(ConnectionError):
    """A peer cannot be reached: it died, closed its transport, or did not answer in time.

    Attributes:
        peer: the rank that cannot be reached; -1 when it is not known which.
        started: raised by :meth:`Transport.issue`, the transfers of the group that had
            started before it failed, each with its :class:`Pending`: they must still
            be waited for (gloo delivers no send left unwaited).
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer
        self.started: list[tuple[Transfer, Pending]] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.peer))


@dataclass(frozen=True)
class Transfer:
    """One operation of a group: send ``buffer`` to ``peer``, or receive into it.

    ``buffer`` is a flat ``uint8`` tensor on the transport's ``wire`` device; a receive
    must be given as many bytes as the matching send moves.
    """

    kind: Literal["send", "recv"]
    peer: int
    buffer: Tensor


class Pending(Protocol):
    """A transfer in flight."""

    def wait(self) -> None:
        """Wait until it is done (on CUDA: make the current stream wait for it).

        Raises:
            TransportError: the peer cannot be reached.
        """


class Transport(ABC):
    """Ordered messages and transfers between the ranks of one pipeline.

    Attributes:
        rank: this process's rank among the pipeline's ``world_size`` processes.
        world_size: how many processes the pipeline has.
        device: where received tensors are put.
        wire: where the buffers of transfers live (the device, or the CPU for gloo).
        global_ranks: the ranks' in the default group, if the pipeline's is not all of it.
    """

    rank: int
    world_size: int
    device: torch.device
    wire: torch.device
    global_ranks: tuple[int, ...] | None = None

    @property
    def reads_marks(self) -> bool:
        """Whether a received buffer's mark is read at once (a CPU wire; see ``transfers.py``).

        Then a step on a remembered input layout sends no metadata. A subclass may say
        False (metadata at every step, as on a GPU), never True on another wire.
        """
        return self.wire.type == "cpu"

    @abstractmethod
    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Send ``header`` and ``tensors`` to rank ``peer`` on the side channel.

        May block until ``peer`` receives it. The tensors may be changed once this
        returns.

        Raises:
            TransportError: ``peer`` cannot be reached.
        """

    @abstractmethod
    def recv(self, peer: int) -> Message:
        """The next side-channel message from rank ``peer``: its header and its tensors.

        Raises:
            TransportError: ``peer`` cannot be reached, or sent nothing in time.
        """

    @abstractmethod
    def issue(self, transfers: Sequence[Transfer]) -> list[Pending]:
        """Start ``transfers`` as one group; one :class:`Pending` each, in order.

        Call it from one thread per process, in the order of the step's plan
        (``plan.py``): NCCL matches the operations of two ranks in the order each
        issued them. A send's buffer must not change until its transfer is done.

        Raises:
            TransportError: a peer cannot be reached (``started``: those that did start).
        """

    def flush(self, grace: float | None = None) -> None:  # noqa: B027  # no-op: sends wait
        """Wait until every message sent so far has left.

        Once one could not be delivered, the others are waited for ``grace`` seconds
        more at most (None: as long as they take), then that failure is raised.

        Raises:
            TransportError: a message could not be delivered.
        """

    _abandoned: str | None = None  # why a receive was left waiting (abandon)

    @property
    def abandoned(self) -> str | None:
        """Why this transport refuses every call now (:meth:`abandon`); None: it does not."""
        return self._abandoned

    def abandon(self, reason: str) -> None:
        """Refuse later calls: a receive left waiting on a peer would take its next message."""
        self._abandoned = self._abandoned or reason

    def check_open(self) -> None:
        """Refuse to start a call (a step) on channels closed, or given up (``abandon``), since.

        Raises:
            RuntimeError: they were, saying what to do.
        """
        if self._abandoned is not None:
            raise RuntimeError(
                f"{self._abandoned}, and the processes of the pipeline cannot run another "
                f"call together. Start every process anew (torchrun can restart them) and "
                f"resume from the last checkpoint"
            )


def wait_apart(works: Sequence[Any], grace: float | None, *, keep: Any = None) -> None:
    """Wait for each of ``works`` (its ``wait()``), whatever fails, ``grace`` s at most.

    For what is in flight once one transfer failed: gloo never delivers a send whose work
    is dropped unwaited, and the live peers would miss what was sent them. The waits run
    on a thread of their own, left after ``grace`` seconds (None: as long as they take;
    gloo's ``wait(timeout)`` would close every pair of the process), holding ``keep``
    (the buffers, which gloo's works may not hold) until they are done.
    """

    def wait_all() -> None:
        for work in works:
            with contextlib.suppress(Exception):
                work.wait()
        del keep_alive[:]

    keep_alive = [keep]
    waiter = threading.Thread(target=wait_all, daemon=True)
    waiter.start()
    waiter.join(grace)
