"""Transports: how the processes of one pipeline hand each other messages.

A message is a header (any picklable value) and a list of tensors. Between two ranks,
messages arrive in the order they were sent; a receiver learns the shapes and dtypes
from the header, so nothing about them is fixed in advance. Every failure to reach a
peer (it died, it closed, it timed out) raises :class:`TransportError`.

:class:`ProcessGroupTransport` uses ``torch.distributed``'s point-to-point ``send`` and
``recv`` on a process group (gloo on CPU, NCCL on GPU): one fixed-size message carries
the pickled header (a second follows if it does not fit), and one more carries all the
tensors' bytes in a single buffer, so a message costs two transfers however many
tensors it holds. :class:`LocalTransport` passes messages between threads of one
process, for tests of the protocol above it without processes.
"""

from __future__ import annotations

import ctypes
import pickle
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LocalTransport", "ProcessGroupTransport", "Transport", "TransportError"]

Message = tuple[Any, list[Tensor]]


class TransportError(ConnectionError):
    """A peer cannot be reached: it died, closed its transport, or did not answer in time.

    Attributes:
        peer: the rank that cannot be reached.
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.peer))


class Transport(ABC):
    """Ordered messages between the ranks of one pipeline.

    Attributes:
        rank: this process's rank among the pipeline's ``world_size`` processes.
        world_size: how many processes the pipeline has.
        device: where received tensors are put.
    """

    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Send ``header`` and ``tensors`` to rank ``peer``.

        May block until ``peer`` receives it. The tensors may be changed once this
        returns.

        Raises:
            TransportError: ``peer`` cannot be reached.
        """

    @abstractmethod
    def recv(self, peer: int) -> Message:
        """The next message from rank ``peer``: its header and its tensors.

        Raises:
            TransportError: ``peer`` cannot be reached, or sent nothing in time.
        """

    def flush(self) -> None:  # noqa: B027  # a no-op for transports whose send waits
        """Wait until every message sent so far has left.

        Raises:
            TransportError: a message could not be delivered.
        """


# LocalTransport


class _Closed:
    """Left in a queue by a closing rank, so that a receiver waiting on it wakes up."""


class _Mesh:
    def __init__(self, world_size: int) -> None:
        self.queues = {
            (src, dst): queue.SimpleQueue[Message | _Closed]()
            for src in range(world_size)
            for dst in range(world_size)
            if src != dst
        }
        self.closed: set[int] = set()
        self.lock = threading.Lock()


class LocalTransport(Transport):
    """Messages between threads of one process; for tests.

    Each thread plays one rank with its own transport from :meth:`mesh`. Tensors are
    copied on the way, as between processes. :meth:`close` plays a rank that dies: its
    peers' ``recv`` and ``send`` raise :class:`TransportError`.
    """

    def __init__(self, mesh: _Mesh, rank: int, world_size: int, *, timeout: float) -> None:
        self._mesh = mesh
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.timeout = timeout

    @classmethod
    def mesh(cls, world_size: int, *, timeout: float = 60.0) -> list[LocalTransport]:
        """One transport per rank, ``world_size`` of them, connected to each other.

        ``timeout`` bounds the seconds a ``recv`` waits for a message.

        Raises:
            ValueError: ``world_size`` is not positive or ``timeout`` not positive.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not timeout > 0 or timeout == float("inf"):
            raise ValueError(
                f"timeout must be a finite positive number of seconds, got {timeout!r}"
            )
        shared = _Mesh(world_size)
        return [cls(shared, r, world_size, timeout=timeout) for r in range(world_size)]

    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Queue a copy of the message for ``peer``; see :meth:`Transport.send`."""
        self._check_open(peer)
        pickle.dumps(header)  # what could not cross a process boundary fails here too
        copies = [t.detach().clone() for t in tensors]
        self._mesh.queues[(self.rank, peer)].put((header, copies))

    def recv(self, peer: int) -> Message:
        """Wait for ``peer``'s next message; see :meth:`Transport.recv`."""
        self._check_open(None)
        deadline = time.monotonic() + self.timeout
        source = self._mesh.queues[(peer, self.rank)]
        while True:
            try:
                item = source.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                self._check_open(peer)  # closed meanwhile, here or there
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"rank {peer} sent nothing to rank {self.rank} in {self.timeout} s", peer
                    ) from None
                continue
            if isinstance(item, _Closed):
                raise TransportError(f"rank {peer} closed its transport", peer)
            return item

    def close(self) -> None:
        """Leave the mesh, as a process that dies would: peers fail to reach this rank."""
        with self._mesh.lock:
            self._mesh.closed.add(self.rank)
        for peer in range(self.world_size):
            if peer != self.rank:
                self._mesh.queues[(self.rank, peer)].put(_Closed())

    def _check_open(self, peer: int | None) -> None:
        if self.rank in self._mesh.closed:
            raise TransportError(f"rank {self.rank} closed its transport", self.rank)
        if peer is not None and peer in self._mesh.closed:
            raise TransportError(f"rank {peer} closed its transport", peer)


# ProcessGroupTransport

_HEAD = 512  # bytes of the first transfer of a message: the header's length, then it
_LENGTH = 8
_ALIGN = 16  # each tensor's bytes start at a multiple of this in the data buffer
_TAG = 0x7467  # apart from the tags of the user's own point-to-point messages


class ProcessGroupTransport(Transport):
    """Messages over ``torch.distributed`` point-to-point operations on a process group.

    Args:
        group: the pipeline's processes; ``None``: every process (the default group).
            Call ``torch.distributed.init_process_group`` first (``torchrun`` sets its
            environment).
        device: where received tensors go. Default: CPU with gloo, the current CUDA
            device with NCCL (which moves CUDA tensors only). With gloo and a CUDA
            device, messages cross in CPU memory (gloo's point-to-point operations
            read and write host memory only) and are copied onto the device on arrival.

    Raises:
        RuntimeError: ``torch.distributed`` is not available or not initialized.
        ValueError: NCCL with a device that is not a CUDA device.
    """

    def __init__(self, group: Any = None, *, device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo') (or 'nccl') in every process "
                "first, for example under torchrun"
            )
        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        assert self.group is not None  # initialized above
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        if device is None:
            nccl = self.backend == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"the NCCL backend moves CUDA tensors only, but device is {self.device}; "
                f"pass device=torch.device('cuda', local_rank), or use gloo for CPU stages"
            )
        # Where the transfers' buffers live: NCCL moves device memory, gloo host memory.
        self._wire = self.device if self.backend == "nccl" else torch.device("cpu")
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        # Sends in flight, with their buffers: a send does not wait for the receiver,
        # whose listener may be slow to take the GIL from a thread that computes.
        self._pending: list[tuple[Any, Tensor, int]] = []

    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Send the message; blocks until ``peer`` receives it. See :meth:`Transport.send`."""
        metas = []
        offset = 0
        for t in tensors:
            metas.append((tuple(t.shape), t.dtype, offset))
            offset += _aligned(t.numel() * t.element_size())
        payload = pickle.dumps((header, metas), protocol=pickle.HIGHEST_PROTOCOL)
        length = len(payload).to_bytes(_LENGTH, "little")
        first = bytearray(_HEAD)
        fits = payload[: _HEAD - _LENGTH]
        first[: _LENGTH + len(fits)] = length + fits
        transfers = [torch.frombuffer(first, dtype=torch.uint8)]
        if len(payload) > len(fits):
            rest = bytearray(payload[len(fits) :])
            transfers.append(torch.frombuffer(rest, dtype=torch.uint8))
        if tensors:
            data = torch.empty(offset, dtype=torch.uint8, device=self._wire)
            for t, (_, _, start) in zip(tensors, metas, strict=True):
                size = t.numel() * t.element_size()
                if size:
                    data[start : start + size].copy_(_bytes(t))
            transfers.append(data)
        self._pending = [item for item in self._pending if not item[0].is_completed()]
        for buffer in transfers:
            buffer = buffer.to(self._wire)
            work = self._transfer("send", buffer, peer)
            self._pending.append((work, buffer, peer))

    def flush(self) -> None:
        """Wait for the sends in flight; see :meth:`Transport.flush`."""
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            try:
                work.wait()
            except RuntimeError as error:
                raise TransportError(
                    f"rank {self.rank} could not send to rank {peer}: {error}", peer
                ) from error

    def recv(self, peer: int) -> Message:
        """Receive ``peer``'s next message onto this device; see :meth:`Transport.recv`."""
        first = torch.empty(_HEAD, dtype=torch.uint8, device=self._wire)
        self._transfer("recv", first, peer)
        raw = _to_bytes(first)
        length = int.from_bytes(raw[:_LENGTH], "little")
        payload = raw[_LENGTH : _LENGTH + length]
        if length > len(payload):
            rest = torch.empty(length - len(payload), dtype=torch.uint8, device=self._wire)
            self._transfer("recv", rest, peer)
            payload += _to_bytes(rest)
        header, metas = pickle.loads(payload)
        if not metas:
            return header, []
        total = max(
            start + _aligned(_numel(shape) * _itemsize(dtype)) for shape, dtype, start in metas
        )
        data = torch.empty(total, dtype=torch.uint8, device=self._wire)
        self._transfer("recv", data, peer)
        if data.device != self.device:
            data = data.to(self.device)
            if data.is_cuda:  # ready before another thread's stream reads it
                torch.cuda.current_stream(data.device).synchronize()
        tensors = []
        for shape, dtype, start in metas:
            size = _numel(shape) * _itemsize(dtype)
            if size == 0:
                tensors.append(torch.empty(shape, dtype=dtype, device=self.device))
            else:
                tensors.append(data[start : start + size].view(dtype).view(shape))
        return header, tensors

    def _transfer(self, op: str, buffer: Tensor, peer: int) -> Any:
        dist = self._dist
        try:
            if op == "send":
                return dist.isend(buffer, self._global[peer], group=self.group, tag=_TAG)
            dist.recv(buffer, self._global[peer], group=self.group, tag=_TAG)
            if buffer.is_cuda:  # ready before another thread's stream reads it
                torch.cuda.current_stream(buffer.device).synchronize()
            return None
        except RuntimeError as error:  # gloo and NCCL report a lost peer this way
            direction = "to" if op == "send" else "from"
            raise TransportError(
                f"rank {self.rank} could not {op} {direction} rank {peer}: {error}", peer
            ) from error


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def _bytes(t: Tensor) -> Tensor:
    """The bytes of ``t``, as a flat uint8 tensor."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _to_bytes(t: Tensor) -> bytes:
    """The bytes of a uint8 tensor; ``bytes(storage)`` would read them one at a time."""
    t = t.cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
