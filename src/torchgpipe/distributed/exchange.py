"""The exchange: one process's mailbox for a step, whose messages may cross processes.

The actions of a step put and take messages by key (``("F", s, i)``: the input of
stage ``s`` for micro-batch ``i``). A key whose stage runs here stays in the local
mailbox; any other is sent to the rank that runs it. Each peer has a listener thread
that receives its messages, in the order sent, into the mailbox, so a send never waits
for the receiving rank to reach the matching action::

    rank 0                               rank 1
    actions ──put(F,1,i)── send ───────▶ listener(0) ──▶ mailbox ──take(F,1,i)──▶ actions
    mailbox ◀── listener(1) ◀───────── send ──put(G,0,i)──────────────────────── actions
    ...
    end(status) ──────────────────────▶ listener(0) stops      (and the other way round)

A step ends with every rank sending ``end`` to every other, with its status: whether it
failed or stopped, where and why, and what it lost track of. A listener stops at its
peer's ``end``, and a rank's step is over when all its listeners have stopped: then it
knows every rank's status. A failing rank sends ``end`` at once, which stops the takes
waiting on the others; they send theirs in turn. So a failure anywhere makes every rank
fail, naming the rank, the stage and the action where it started. A rank that dies is
seen by the transport (``TransportError``) and reported the same way.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from torchgpipe.distributed.transport import Transport, TransportError
from torchgpipe.mailbox import KIND_NAMES, Mailbox, Stopped
from torchgpipe.microbatch import flatten, unflatten
from torchgpipe.schedules import Action
from torchgpipe.worker import WorkerPool

__all__ = ["RemoteError"]

Key = tuple[Any, ...]


class RemoteError(RuntimeError):
    """A step failed on another process of the pipeline, or a process was lost.

    Attributes:
        rank: the rank where the failure started.
        stages: the stages that rank runs.
        action: the action that failed there (``"2F3"``), if one did.
        remote_traceback: the traceback printed on that rank, if it raised.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        stages: tuple[int, ...],
        action: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.stages = stages
        self.action = action
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _remote_error,
            (self.args[0], self.rank, self.stages, self.action, self.remote_traceback),
        )


def _remote_error(
    message: str, rank: int, stages: tuple[int, ...], action: str | None, tb: str | None
) -> RemoteError:
    return RemoteError(message, rank=rank, stages=stages, action=action, remote_traceback=tb)


def describe(
    error: BaseException, action: Action | None, rank: int, stages: tuple[int, ...], m: int | None
) -> dict[str, Any]:
    """What other ranks are told of ``error``, raised here in ``action`` (if any)."""
    where = ""
    if action is not None:
        where = f" in {action} ({KIND_NAMES[action.kind]} of micro-batch {action.i} of {m})"
    return {
        "rank": rank,
        "stages": stages,
        "action": None if action is None else str(action),
        "text": f"{type(error).__name__}: {error}",
        "where": where,
        "traceback": "".join(traceback.format_exception(error)),
    }


class Exchange(Mailbox):
    """The mailbox of this rank for one step; see the module's documentation.

    Args:
        transport: the messages' way to the other ranks.
        pool: a worker per peer, which listens to it for the step.
        owner: the rank a key's message is for.
        stages: the stages of each rank, to name them in errors.
        wire: the form of a key that crosses processes (skip keys hold namespaces, which
            are objects of one process), and ``unwire`` its inverse.
    """

    def __init__(
        self,
        transport: Transport,
        pool: WorkerPool,
        *,
        owner: Callable[[Key], int],
        stages: list[tuple[int, ...]],
        wire: Callable[[Key], Key] = lambda key: key,
        unwire: Callable[[Key], Key] = lambda key: key,
    ) -> None:
        super().__init__()
        self.transport = transport
        self.rank = transport.rank
        self.peers = [p for p in range(transport.world_size) if p != self.rank]
        self._owner = owner
        self._wire = wire
        self._unwire = unwire
        self.stages = stages
        self.ends: dict[int, tuple[dict[str, Any], list[Tensor]]] = {}
        self.lost: dict[int, str] = {}
        self._listening = {p: threading.Event() for p in self.peers}
        for k, peer in enumerate(self.peers):
            pool.submit(k, self._listener(peer), partial(self._listener_failed, peer))

    # Messages

    def put(self, key: Key, value: Any) -> None:
        owner = self._owner(key)
        if owner == self.rank:
            super().put(key, value)
        else:
            self.send(owner, key, value)

    def send(self, peer: int, key: Key, value: Any) -> None:
        """Send ``value`` under ``key`` to rank ``peer``'s mailbox.

        Raises:
            Stopped: ``peer`` cannot be reached; the step halts.
        """
        leaves, spec = flatten(value)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        slots = [k for k, x in enumerate(leaves) if isinstance(x, Tensor)]
        header = (
            "data",
            self._wire(key),
            spec,
            [None if isinstance(x, Tensor) else x for x in leaves],
            slots,
            [x.requires_grad for x in tensors],
        )
        try:
            self.transport.send(peer, header, tensors)
        except TransportError as error:
            self._lose(peer, _unreachable(error))
            raise Stopped from error

    def _listener(self, peer: int) -> Callable[[], None]:
        def listen() -> None:
            try:
                while self._receive(peer):
                    pass
            except TransportError as error:
                self._lose(peer, _unreachable(error))
            except BaseException as error:  # the transport could not decode a message
                self._lose(peer, f"sent a message that could not be read: {error!r}")
            finally:
                self._listening[peer].set()

        return listen

    def _receive(self, peer: int) -> bool:
        """Receive one message from ``peer``; False once it was the step's last."""
        header, tensors = self.transport.recv(peer)
        if header[0] == "end":
            status = header[1]
            self.ends[peer] = (status, tensors)
            if status["failed"]:
                self.halt()
            return False
        try:
            _, wire_key, spec, leaves, slots, wants = header
            for slot, tensor, grad in zip(slots, tensors, wants, strict=True):
                leaves[slot] = tensor.requires_grad_(True) if grad else tensor
            super().put(self._unwire(wire_key), unflatten(leaves, spec))
        except BaseException as error:  # keep listening: the peer goes on sending
            self._lose(peer, f"sent a message that could not be read: {error!r}")
        return True

    def _listener_failed(self, peer: int, error: BaseException) -> None:
        self.lost.setdefault(peer, f"could not be listened to: {error!r}")
        self._listening[peer].set()
        self.halt()

    def _lose(self, peer: int, reason: str) -> None:
        self.lost.setdefault(peer, reason)
        self.halt()

    # The end of the step

    def finish(self, status: dict[str, Any], tensors: list[Tensor]) -> None:
        """Send this rank's ``end`` to every peer and wait for theirs (or their loss).

        ``status`` says whether this rank ``failed`` (it raised, or stopped because
        another did) and ``error``: the description of its own failure, if it raised.
        """
        status = {**status, "lost": dict(self.lost)}
        for peer in self.peers:
            if peer in self.lost:
                continue
            try:
                self.transport.send(peer, ("end", status), tensors)
            except TransportError as error:
                self._lose(peer, _unreachable(error))
        try:
            self.transport.flush()
        except TransportError as error:
            self.lost.setdefault(error.peer, _unreachable(error))
        for peer in self.peers:
            self._listening[peer].wait()

    def remote_failure(self) -> RemoteError | None:
        """The failure of another rank that stopped this step, or None if none did."""
        errors = [s["error"] for s, _ in self.ends.values() if s.get("error") is not None]
        if errors:
            first = min(errors, key=lambda e: e["rank"])
            more = len(errors) - 1
            also = f" (and {more} other rank{'s' * (more > 1)} failed too)" if more else ""
            return RemoteError(
                f"rank {first['rank']} (stages {list(first['stages'])}) raised "
                f"{first['text']}{first['where']}{also}\n\n"
                f"Traceback on rank {first['rank']}:\n{first['traceback']}",
                rank=first["rank"],
                stages=tuple(first["stages"]),
                action=first["action"],
                remote_traceback=first["traceback"],
            )
        lost = dict(self.lost)
        for status, _ in self.ends.values():
            for peer, reason in status["lost"].items():
                lost.setdefault(int(peer), reason)
        lost.pop(self.rank, None)
        if lost:
            peer = min(lost)
            return RemoteError(
                f"rank {peer} (stages {list(self.stages[peer])}) {lost[peer]}",
                rank=peer,
                stages=self.stages[peer],
            )
        if self.halted:  # pragma: no cover - a halt always has a cause above
            return RemoteError("the step stopped on another rank", rank=-1, stages=())
        return None


def _unreachable(error: TransportError) -> str:
    return (
        f"died or cannot be reached; see its own output for the cause. The transport said: {error}"
    )
