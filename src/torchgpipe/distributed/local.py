"""LocalTransport: the ranks of a pipeline as threads of one process, for tests.

Each thread plays one rank with its own transport from :meth:`LocalTransport.mesh`;
messages and transfers go through queues, copied on the way as between processes. A
checker of NCCL's rules (``tests/nccl_rules.py``) can observe every group of transfers
as a rank issues it.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from torchgpipe.distributed.channel import (
    Message,
    Pending,
    Transfer,
    Transport,
    TransportError,
)

__all__ = ["LocalTransport"]

Observer = Callable[[int, list[tuple[int, Literal["send", "recv"], int]]], object]
Item = TypeVar("Item")


class _Closed:
    """Left in a queue by a closing rank, so that a receiver waiting on it wakes up."""


class _Mesh:
    def __init__(self, world_size: int, observe: Observer | None) -> None:
        pairs = [(s, d) for s in range(world_size) for d in range(world_size) if s != d]
        self.queues = {pair: queue.SimpleQueue[Message | _Closed]() for pair in pairs}
        self.transfers = {pair: queue.SimpleQueue[Tensor | _Closed]() for pair in pairs}
        self.observe = observe
        self.closed: set[int] = set()
        self.broken: set[frozenset[int]] = set()  # pairs given up after a timeout
        self.timed_out: set[tuple[int, int]] = set()  # (sender, receiver) that timed out
        self.lock = threading.Lock()


class LocalTransport(Transport):
    """Messages and transfers between threads of one process; for tests.

    Each thread plays one rank with its own transport from :meth:`mesh`. Tensors are
    copied on the way, as between processes. :meth:`close` plays a rank that dies: its
    peers' ``recv``, ``send`` and transfers raise :class:`TransportError`; a ``recv`` or a
    transfer that times out gives the pair up, as gloo does: what either then sends the
    other, or sent after, is not read, and raises there too. Transfers
    between two ranks are matched in the order each issued them, as NCCL matches them;
    a receive given another byte count than its send fails.
    """

    def __init__(self, mesh: _Mesh, rank: int, world_size: int, *, timeout: float) -> None:
        self._mesh = mesh
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.wire = self.device
        self.timeout = timeout
        # Per peer, the receives issued and not yet filled, in issue order.
        self._receiving: dict[int, list[_LocalReceive]] = {}

    @classmethod
    def mesh(
        cls, world_size: int, *, timeout: float = 60.0, observe: Observer | None = None
    ) -> list[LocalTransport]:
        """One transport per rank, ``world_size`` of them, connected to each other.

        ``timeout`` bounds the seconds a ``recv`` or a transfer waits for its peer.
        ``observe(rank, [(peer, "send" | "recv", bytes), ...])`` is called with every
        group of transfers as a rank issues it, on the issuing thread, before it starts
        (a checker of NCCL's rules raises there to fail the rank).

        Raises:
            ValueError: ``world_size`` is not positive or ``timeout`` not positive.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not timeout > 0 or timeout == float("inf"):
            raise ValueError(
                f"timeout must be a finite positive number of seconds, got {timeout!r}"
            )
        shared = _Mesh(world_size, observe)
        return [cls(shared, r, world_size, timeout=timeout) for r in range(world_size)]

    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Queue a copy of the message for ``peer``; see :meth:`Transport.send`."""
        self._check_open(peer)
        pickle.dumps(header)  # what could not cross a process boundary fails here too
        copies = [t.detach().clone() for t in tensors]
        with self._mesh.lock:  # nothing goes in after the pair was given up
            self._check_pair(peer)
            self._mesh.queues[(self.rank, peer)].put((header, copies))

    def recv(self, peer: int) -> Message:
        """Wait for ``peer``'s next message; see :meth:`Transport.recv`."""
        self._check_open(None)
        return self._next(self._mesh.queues[(peer, self.rank)], peer, "nothing")

    def issue(self, transfers: Sequence[Transfer]) -> list[Pending]:
        """Start a group of transfers; see :meth:`Transport.issue`."""
        if self._mesh.observe is not None:
            self._mesh.observe(self.rank, [(t.peer, t.kind, t.buffer.numel()) for t in transfers])
        pending: list[Pending] = []
        for transfer in transfers:
            self._check_open(transfer.peer)
            if transfer.kind == "send":
                with self._mesh.lock:
                    self._check_pair(transfer.peer)
                    self._mesh.transfers[(self.rank, transfer.peer)].put(transfer.buffer.clone())
                pending.append(_Done())
            else:
                receive = _LocalReceive(self, transfer.peer, transfer.buffer)
                self._receiving.setdefault(transfer.peer, []).append(receive)
                pending.append(receive)
        return pending

    def close(self) -> None:
        """Leave the mesh, as a process that dies would: peers fail to reach this rank."""
        with self._mesh.lock:
            self._mesh.closed.add(self.rank)
        for peer in range(self.world_size):
            if peer != self.rank:
                self._mesh.queues[(self.rank, peer)].put(_Closed())
                self._mesh.transfers[(self.rank, peer)].put(_Closed())

    def _next_transfer(self, peer: int) -> Tensor:
        """The bytes of ``peer``'s next send to this rank, in the order it sent them."""
        return self._next(self._mesh.transfers[(peer, self.rank)], peer, "no transfer")

    def _next(self, source: queue.SimpleQueue[Item | _Closed], peer: int, what: str) -> Item:
        """The next item ``peer`` put in ``source``, waiting at most the timeout.

        Raises:
            TransportError: ``peer`` (or this rank) closed, or sent ``what`` in time.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                item = source.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                self._check_open(peer)  # closed meanwhile, here or there
                if time.monotonic() >= deadline:
                    with self._mesh.lock:  # as gloo gives a pair up: later items would
                        self._mesh.broken.add(frozenset((peer, self.rank)))  # be misread
                        self._mesh.timed_out.add((peer, self.rank))
                    raise TransportError(
                        f"rank {peer} sent {what} to rank {self.rank} in {self.timeout} s", peer
                    ) from None
                continue
            if isinstance(item, _Closed):
                raise TransportError(f"rank {peer} closed its transport", peer)
            # What came on the direction that timed out is not read (it came late); on
            # the other, only what was queued before the break is, as gloo delivers it
            # to a receive posted then (sends are refused after, under the lock).
            if (peer, self.rank) in self._mesh.timed_out:
                self._check_pair(peer)
            return item

    def _check_open(self, peer: int | None) -> None:
        if self.rank in self._mesh.closed:
            raise TransportError(f"rank {self.rank} closed its transport", self.rank)
        if peer is not None and peer in self._mesh.closed:
            raise TransportError(f"rank {peer} closed its transport", peer)
        if peer is not None:
            self._check_pair(peer)

    def _check_pair(self, peer: int) -> None:
        if frozenset((peer, self.rank)) in self._mesh.broken:
            raise TransportError(
                f"ranks {self.rank} and {peer} gave their connection up after a timeout", peer
            )


class _Waited:
    """Refuses a second wait, which a gloo transfer would not survive (it hangs)."""

    _waited = False

    def _once(self) -> None:
        if self._waited:
            raise RuntimeError(
                "a transfer was waited for twice; gloo would hang there (a bug in the "
                "caller: wait for each transfer once)"
            )
        self._waited = True


class _Done(_Waited):
    """A local send: its bytes were copied when it was issued."""

    def wait(self) -> None:
        """Nothing to wait for, once."""
        self._once()


class _LocalReceive(_Waited):
    """A receive of a LocalTransport, filled in the order receives from its peer were issued."""

    def __init__(self, transport: LocalTransport, peer: int, buffer: Tensor) -> None:
        self._transport = transport
        self._peer = peer
        self._buffer = buffer
        self._done = False

    def wait(self) -> None:
        """Fill the receives from the peer issued before this one, then this one."""
        self._once()
        waiting = self._transport._receiving[self._peer]
        while not self._done:
            waiting[0]._fill()
            waiting.pop(0)

    def _fill(self) -> None:
        got = self._transport._next_transfer(self._peer)
        if got.numel() != self._buffer.numel():
            raise RuntimeError(
                f"rank {self._transport.rank} received {got.numel()} bytes from rank "
                f"{self._peer} into a buffer of {self._buffer.numel()}: the ranks' "
                f"transfers do not match (a bug in the order of their plans)"
            )
        self._buffer.copy_(got)
        self._done = True
