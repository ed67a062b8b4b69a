"""Transports: how the processes of one pipeline hand each other messages and tensors.

A transport has two channels:

- **The side channel** (:meth:`Transport.send`, :meth:`Transport.recv`): messages of a
  header (any picklable value) and a few CPU tensors, in the order sent between two
  ranks, from any thread. It carries what a step's transfers need to be sized (keys,
  structure, shapes, dtypes, non-tensor values) and the step's start and end.
- **Transfers** (:meth:`Transport.issue`): the activations and gradients themselves,
  flat byte buffers on the pipeline's process group, issued as groups of sends and
  receives (``batch_isend_irecv``) by one thread per process, in an order both ranks
  of a pair derive from the schedule (``plan.py``): NCCL's rules.

Every failure to reach a peer (dead, closed, timed out) raises :class:`TransportError`.

:class:`ProcessGroupTransport` runs the transfers on the pipeline's process group (gloo
on CPU, NCCL on GPU), the side channel on a gloo group (the pipeline's own if gloo,
under another tag); on gloo, without groups of operations, one by one. ``wire.py``
makes the buffers; ``local.py``'s :class:`LocalTransport` connects threads of one process.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from torchgpipe.distributed.channel import (
    BUILD_FIRST,
    GREETING,
    Message,
    Pending,
    Transfer,
    Transport,
    TransportError,
    wait_apart,
)
from torchgpipe.distributed.groups import backends_of, check_member
from torchgpipe.distributed.wire import as_bytes, pack, packed_size, unpack
from torchgpipe.stream import use_device

__all__ = ["Pending", "ProcessGroupTransport", "Transfer", "Transport", "TransportError"]

# ProcessGroupTransport

_HEAD = 512  # bytes of the first transfer of a message: the header's length, then it
_LENGTH = 8
_TAG = 0x7467  # the side channel's, apart from the user's own point-to-point messages
_DATA_TAG = 0x7468  # the transfers' (gloo matches by tag; NCCL ignores tags)
_GREETING_GRACE = 10.0  # seconds the word waits for busy peers to take it (``_greet``)


def _frames(header: Any, tensors: Sequence[Tensor]) -> list[Tensor]:
    """A side-channel message's transfers: its head, the rest of its header, its tensors.

    The head is ``_HEAD`` bytes: the length of the pickled header, then as much of it
    as fits.
    """
    layout = [(tuple(t.shape), t.dtype) for t in tensors]
    payload = pickle.dumps((header, layout), protocol=pickle.HIGHEST_PROTOCOL)
    length = len(payload).to_bytes(_LENGTH, "little")
    first = bytearray(_HEAD)
    fits = payload[: _HEAD - _LENGTH]
    first[: _LENGTH + len(fits)] = length + fits
    transfers = [torch.frombuffer(first, dtype=torch.uint8)]
    if len(payload) > len(fits):
        rest = bytearray(payload[len(fits) :])
        transfers.append(torch.frombuffer(rest, dtype=torch.uint8))
    data = pack(tensors, torch.device("cpu"))
    if data is not None:
        transfers.append(data)
    return transfers


class ProcessGroupTransport(Transport):
    """Transfers on a ``torch.distributed`` process group; the side channel on gloo.

    Args:
        group: the pipeline's processes; ``None``: every process (the default group).
            Call ``torch.distributed.init_process_group`` first (``torchrun`` sets its
            environment). Every process of the group builds its transport at once.
        device: where received tensors go. Default: CPU with gloo, the current CUDA
            device with NCCL (which moves CUDA tensors only). With gloo and a CUDA
            device, transfers cross in CPU memory (gloo's point-to-point operations
            read and write host memory only) and are copied onto the device on arrival.
        side_group: a gloo group of the same processes for the side channel. Default:
            ``group`` itself when it is gloo (under another tag), else a new gloo group
            of its processes (``new_group(..., use_local_synchronization=True)``, which
            only they call).

    The side channel sends one fixed-size buffer with the pickled header (a second
    follows if it does not fit), and one more with the bytes of all its tensors.

    Raises:
        RuntimeError: ``torch.distributed`` is not available or not initialized.
        ValueError: this process is not in ``group`` (or ``side_group``); NCCL with a
            device that is not a CUDA device; a side group that is not a gloo group of
            exactly the pipeline's processes, in their order.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device: torch.device | str | None = None,
        side_group: Any = None,
    ) -> None:
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
        check_member(self.group, "group")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        backends = backends_of(self.group)
        if device is None:
            nccl = backends.get("cuda") == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        # Where the transfers' buffers live: NCCL moves device memory, others host memory.
        nccl = self.device.type == "cuda" and backends.get("cuda") == "nccl"
        self.wire = self.device if nccl else torch.device("cpu")
        if self.wire.type not in backends:
            moved = ", ".join(f"{kind} tensors by {name}" for kind, name in backends.items())
            raise ValueError(
                f"the process group moves {moved} only, and stages on {self.device} need "
                f"CPU tensors moved; pass device=torch.device('cuda', local_rank) with "
                f"NCCL, or use a group with gloo (for CPU tensors) for these stages"
            )
        self.backend = backends[self.wire.type]  # the one that moves the transfers
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self.global_ranks = None if self._global == [*range(self.world_size)] else (*self._global,)
        self.side_group = self._side_group(side_group)
        # Side-channel sends in flight, with their buffers: a send does not wait for the
        # receiver, whose listener may be slow to take the GIL from a thread that computes.
        self._pending: list[tuple[Any, Tensor, int]] = []
        self._greet()
        # NCCL sets up a communicator at its first operation, which must then be a
        # collective of every rank of the group, not a batch of point-to-point ones.
        try:
            with use_device(self.wire):  # NCCL works on the current device (set_device)
                dist.all_reduce(torch.zeros(1, device=self.wire), group=self.group)
        except RuntimeError as error:  # gloo reports a peer gone this way
            raise TransportError(
                f"rank {self.rank} could not reach the other processes of the pipeline "
                f"while setting up: one of them failed before building its stage (see "
                f"its own output for why) or died. The process group said: {error}",
                -1,
            ) from error

    def _greet(self) -> None:
        """Exchange a word with every other rank on the side channel, before anything else.

        A rank that failed before building its stage (a bad argument), or died, closed
        its connections: the ranks that cannot hear from it name it, where a collective
        would only say that some process is gone. Every peer is tried, whatever the
        others do. A rank that comes late may find several gone (those that failed
        here first left): it names them all, and no one rank.

        The word is a message as any other (a first transfer of ``_HEAD`` bytes): a peer
        already in a call of a stage built before (uneven loops) reads it as a message,
        and this rank reads that peer's; both refuse it, where gloo, handed transfers of
        two sizes under one tag, would end the process.

        Raises:
            TransportError: a rank cannot be reached, naming it (``peer`` -1 if several).
            RuntimeError: a rank sent a message of a call instead (naming it).
        """
        (word,) = _frames(GREETING, [])
        lost: dict[int, TransportError] = {}
        sent, peers = [], [p for p in range(self.world_size) if p != self.rank]
        for peer in peers:  # sends first: a send does not wait for its receive
            try:
                sent.append((peer, self._side("send", word, peer)))
            except TransportError as error:
                lost.setdefault(peer, error)
        busy = []
        for peer in peers:
            try:
                if self.recv(peer)[0] != GREETING:
                    busy.append(peer)
            except TransportError as error:
                lost.setdefault(peer, error)
        if busy:
            # Those peers learn why from the word, which must leave before this process
            # may end, as it may once this has raised.
            wait_apart([work for _, work in sent], _GREETING_GRACE, keep=word)
            raise RuntimeError(
                f"rank {self.rank} builds its PipelineStage while rank(s) {busy} of the "
                f"pipeline make a call (a step) of a stage built before; {BUILD_FIRST}. "
                f"The group's channels are out of step now: start every process anew"
            )
        for peer, work in sent:
            try:
                work.wait()
            except RuntimeError as error:
                lost.setdefault(peer, TransportError(str(error), peer))
        if len(lost) == 1:
            [(peer, cause)] = lost.items()
            raise TransportError(
                f"rank {self.rank} could not reach rank {peer} while setting up: it "
                f"failed before building its stage (see its own output for why) or died. "
                f"The process group said: {cause}",
                peer,
            ) from cause
        if lost:
            raise TransportError(
                f"rank {self.rank} could not reach ranks {sorted(lost)} while setting up: "
                f"one failed before building its stage (see their own output for why) or "
                f"died, and others may have left since, after failing on it",
                -1,
            ) from next(iter(lost.values()))

    def _side_group(self, given: Any) -> Any:
        dist = self._dist
        if given is None:
            if self.backend == "gloo":
                return self.group
            return dist.new_group(self._global, backend="gloo", use_local_synchronization=True)
        check_member(given, "side_group")
        backend = backends_of(given).get("cpu", str(dist.get_backend(given)))
        size = dist.get_world_size(given)
        members = [dist.get_global_rank(given, r) for r in range(size)]
        if backend != "gloo" or members != self._global:
            raise ValueError(
                f"side_group must be a gloo group of the pipeline's processes (global ranks "
                f"{self._global}), got a {backend} group of global ranks {members}; leave "
                f"it out to let the transport make one"
            )
        return given

    def send(self, peer: int, header: Any, tensors: Sequence[Tensor]) -> None:
        """Send on the side channel; returns before ``peer`` receives it.

        See :meth:`Transport.send`.
        """
        transfers = _frames(header, tensors)
        self._pending = [item for item in self._pending if not item[0].is_completed()]
        for buffer in transfers:
            work = self._side("send", buffer, peer)
            self._pending.append((work, buffer, peer))

    def check_open(self) -> None:
        """Refuse a call once the process groups were destroyed; see :meth:`Transport.check_open`.

        The transport holds its groups, whose connections then stay up: a step would run
        on a group that ``torch.distributed`` no longer knows of.
        """
        super().check_open()
        dist = self._dist
        for group in {id(self.group): self.group, id(self.side_group): self.side_group}.values():
            try:
                known = dist.is_initialized() and dist.get_rank(group) >= 0
            except (ValueError, RuntimeError):  # "the group is not registered"
                known = False
            if not known:
                raise RuntimeError(
                    f"rank {self.rank}: the pipeline's process group was destroyed "
                    f"(torch.distributed.destroy_process_group()); build the process group "
                    f"and the PipelineStage anew to run more steps, in every process"
                )

    def flush(self, grace: float | None = None) -> None:
        """Wait for the side-channel sends in flight; see :meth:`Transport.flush`."""
        # Each one, even after one failed (``wait_apart``: the live peers' ends would go
        # with a dead one's); a send before it, to a live peer posting no receive, still
        # holds this rank until the group's timeout, as a stalled peer does.
        pending, self._pending = self._pending, []
        for k, (work, _, peer) in enumerate(pending):
            try:
                work.wait()
            except RuntimeError as error:
                rest = pending[k + 1 :]
                wait_apart([w for w, _, _ in rest], grace, keep=[b for _, b, _ in rest])
                raise TransportError(
                    f"rank {self.rank} could not send to rank {peer}: {error}", peer
                ) from error

    def recv(self, peer: int) -> Message:
        """Receive ``peer``'s next side-channel message; see :meth:`Transport.recv`."""
        first = torch.empty(_HEAD, dtype=torch.uint8)
        self._side("recv", first, peer)
        raw = as_bytes(first)
        length = int.from_bytes(raw[:_LENGTH], "little")
        payload = raw[_LENGTH : _LENGTH + length]
        if length > len(payload):
            rest = torch.empty(length - len(payload), dtype=torch.uint8)
            self._side("recv", rest, peer)
            payload += as_bytes(rest)
        header, layout = pickle.loads(payload)
        size = packed_size(layout)
        data = None
        if size:
            data = torch.empty(size, dtype=torch.uint8)
            self._side("recv", data, peer)
        return header, unpack(data, layout, torch.device("cpu"))

    def issue(self, transfers: Sequence[Transfer]) -> list[Pending]:
        """Start ``transfers`` as one ``batch_isend_irecv`` (on gloo, one by one).

        See :meth:`Transport.issue`.
        """
        if self.backend == "gloo":
            return self._issue_gloo(transfers)
        dist = self._dist
        ops = [
            dist.P2POp(
                dist.isend if t.kind == "send" else dist.irecv,
                t.buffer,
                self._global[t.peer],
                group=self.group,
                tag=_DATA_TAG,
            )
            for t in transfers
        ]
        try:
            with use_device(self.wire):  # the caller may not have called set_device
                works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # gloo and NCCL report a lost peer this way
            peers = sorted({t.peer for t in transfers})
            raise TransportError(
                f"rank {self.rank} could not start transfers with ranks {peers}: {error}",
                peers[0],
            ) from error
        if len(works) != len(transfers):  # NCCL coalesces a batch into one work
            works = works[:1] * len(transfers)
        return [_Work(work, t, self.rank) for work, t in zip(works, transfers, strict=True)]

    def _issue_gloo(self, transfers: Sequence[Transfer]) -> list[Pending]:
        """Issue ``transfers`` straight on a gloo group, one after another.

        What ``batch_isend_irecv`` does with a backend that has no groups of operations,
        without ``torch.distributed``'s checks of each one, which cost more than a small
        transfer itself, several times per cell.
        """
        started: list[tuple[Transfer, Pending]] = []
        for t in transfers:
            try:
                work = self._gloo(self.group, t.kind, t.buffer, t.peer, _DATA_TAG)
            except TransportError as error:
                error.started = started  # to live peers, say: to be waited for
                raise
            started.append((t, _Work(work, t, self.rank)))
        return [pending for _, pending in started]

    def _side(self, op: Literal["send", "recv"], buffer: Tensor, peer: int) -> Any:
        """A side-channel send (its work), or a receive, waited for (None)."""
        work = self._gloo(self.side_group, op, buffer, peer, _TAG)
        if op == "send":
            return work
        try:
            work.wait()
        except RuntimeError as error:  # gloo reports a lost peer this way
            raise TransportError(
                f"rank {self.rank} could not recv from rank {peer}: {error}", peer
            ) from error
        return None

    def _gloo(
        self, group: Any, op: Literal["send", "recv"], buffer: Tensor, peer: int, tag: int
    ) -> Any:
        """Start ``op`` on a gloo ``group`` (a ProcessGroup; ranks are its own); its work."""
        try:
            return (group.send if op == "send" else group.recv)([buffer], peer, tag)
        except RuntimeError as error:  # gloo reports a lost peer this way
            direction = "to" if op == "send" else "from"
            raise TransportError(
                f"rank {self.rank} could not {op} {direction} rank {peer}: {error}", peer
            ) from error


class _Work:
    """A transfer of a ProcessGroupTransport in flight."""

    def __init__(self, work: Any, transfer: Transfer, rank: int) -> None:
        self._work = work
        self._transfer = transfer
        self._rank = rank

    def wait(self) -> None:
        """Wait for it (NCCL: the current stream waits); a lost peer raises."""
        try:
            self._work.wait()
        except RuntimeError as error:
            kind, peer = self._transfer.kind, self._transfer.peer
            direction = "to" if kind == "send" else "from"
            raise TransportError(
                f"rank {self._rank} could not {kind} {direction} rank {peer}: {error}", peer
            ) from error
