"""A step's transfers on the pipeline's process group, issued round by round.

:class:`Transfers` follows this rank's :class:`~torchgpipe.distributed.plan.RankPlan`
on the thread that runs the rank's actions (the only thread that issues on the group):
before an action that starts at time ``τ`` on paper it issues every round up to ``τ``, each
as one group of the round's sends (the bytes the rank's actions left with :meth:`hold`)
and receives (sized by the metadata that came ahead on the side channel); and, ahead,
the next action's rounds that only receive, once their sizes are known. A round is
built whole before it is issued, and only then taken off the books: a failure while
building it (a peer that goes silent, memory) leaves it as it was, for the drain. A
drain that fails so (memory still short, though a failed step's cells are let go
first) gives the transport up (``Transport.abandon``): its peers' pairs no longer match.

After the step's end (``exchange.py``), :meth:`drain` issues the remaining rounds with
the transfers whose metadata went out (sends) or came in (receives) and no others (with
known frames: every planned one, zeros for a value never made): both ranks of a pair
then issue the same operations, so the group is left clean for the next step.
Transfers with a peer that was lost are left out: on NCCL they would never finish
(after losing a process, rebuild the process group).

When a step's input is laid out as that of a step that ended well, the frames come
from that step (``follow(plan, frames)``): no metadata crosses, a receive is issued
without waiting for anything, and every planned transfer takes place, each buffer
ending with a mark (``wire.py``): a message that its action never made goes as zeros
of its size, so that the two sides still match. A value laid out otherwise than its
frame fails its action with static shapes (``PipelineStage(static_shapes=True)``, a
promise); by default (``strict=False``) it goes whole on the side channel, and zeros
marked ``MOVED`` take its place in the transfer: the receiver reads the mark and
takes the value from the side channel, and both note its new frame (``seen``; the
schedule forgets a step that moved a value: the next one sends metadata). The mark
is read on the CPU only: on a GPU the default step sends metadata (reading a mark
there would wait for the transfer), and static shapes rely on the step's halt alone.
"""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torchgpipe.distributed.channel import (
    Pending,
    Transfer,
    Transport,
    TransportError,
    wait_apart,
)
from torchgpipe.distributed.plan import Key, Message, RankPlan
from torchgpipe.distributed.wire import DATA, FAILED, MARK, packed_size
from torchgpipe.mailbox import Stopped

__all__ = ["Transfers", "layout_change"]


class Transfers:
    """This rank's transfers of one step; see the module's documentation.

    Args:
        transport: issues the groups.
        metadata: ``metadata(message, draining)``: the metadata frame of an incoming
            message, waiting for it (without taking it); None if its sender went
            silent without it (raises :class:`Stopped` then, unless draining).
        arrived: whether the metadata of an incoming message is there already.
        consume: takes a frame that a round used off the side channel's books.
        lose: reports a peer that cannot be reached (the step halts).
        lost: whether a peer was lost.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        metadata: Callable[[Message, bool], Any],
        arrived: Callable[[Message], bool],
        consume: Callable[[Key], None],
        lose: Callable[[TransportError], None],
        lost: Callable[[int], bool],
    ) -> None:
        self.transport = transport
        self.rank = transport.rank
        self._metadata = metadata
        self._arrived = arrived
        self._consume = consume
        self._lose = lose
        self._lost = lost
        self.plan: RankPlan | None = None
        self.static: dict[Key, Any] | None = None  # the frames of every message, if known
        self.strict = True  # whether a value laid out otherwise than its frame fails
        self._marked = False  # whether received buffers' marks are read (see mark)
        self._cpu_wire = True  # where they can be (the transport's wire, at follow)
        self.seen: dict[Key, Any] = {}  # the frames of this step's messages, both ways
        self._round = 0  # the plan's next round to issue
        self._outbox: dict[Key, Tensor | None] = {}  # the bytes of a sent message
        # A message received: its frame, its bytes, their transfer, the sender.
        self._incoming: dict[Key, tuple[Any, Tensor | None, Pending | None, int]] = {}
        self._sending: list[tuple[int, Pending]] = []  # sends issued, with their peer

    def follow(
        self, plan: RankPlan, frames: dict[Key, Any] | None = None, *, strict: bool = True
    ) -> None:
        """Issue this step's transfers by ``plan``; with ``frames``, sizes are known.

        ``strict``: a value laid out otherwise than its frame fails its action (static
        shapes); else it moves to the side channel.
        """
        self.plan = plan
        self.static = frames
        self.strict = strict
        self._marked = frames is not None and self.transport.reads_marks
        self._cpu_wire = self.transport.wire.type == "cpu"
        if frames is not None:
            self.seen = dict(frames)  # with the new frames of values that moved

    def expects(self, key: Key) -> bool:
        """Whether the plan receives the message ``key`` (in its wire form)."""
        return self.plan is not None and key in self.plan.receives

    def hold(self, key: Key, frame: Any, buffer: Tensor | None) -> None:
        """Keep the bytes of message ``key``, whose metadata went out, for its round."""
        self._outbox[key] = buffer
        self.seen[key] = frame

    def zeros(self, key: Key, mark: int = FAILED) -> Tensor:
        """Zeros of the size of message ``key``'s known frame, ending with ``mark``."""
        assert self.static is not None
        size = self._size(self.static[key])
        buffer = torch.zeros(size, dtype=torch.uint8, device=self.transport.wire)
        if mark != FAILED:
            buffer[size - MARK] = mark
        return buffer

    def _size(self, frame: Any) -> int:
        """The bytes of a message: its tensors', and a mark when its frame was known."""
        return packed_size(frame[2]) + (MARK if self.static is not None else 0)

    def mark(self, buffer: Tensor | None) -> int:
        """What a received buffer holds, by its mark (``wire.py``); DATA if unmarked.

        On a GPU, reading the mark would wait for the transfer: there it is not read,
        and the step's halt, which a failed sender's end brings, is the only guard
        (a value never moves there: see the module's documentation).
        """
        if not self._marked or buffer is None:
            return DATA
        if not self._cpu_wire:  # the digest's condition too: they must agree
            # Raised here, not at follow: every rank follows the plan by now, so the
            # step fails on all of them as after any failed action.
            raise RuntimeError(
                f"torchgpipe: the transport says it reads marks, but its wire is "
                f"{self.transport.wire}; Transport.reads_marks must be True on a CPU wire only"
            )
        # The mark's first byte, read in place (the buffers this class allocates are
        # uint8, on the wire): indexing the tensor costs ~40 us a message.
        mark = buffer.data_ptr() + buffer.numel() - MARK
        return int(ctypes.c_uint8.from_address(mark).value)

    def issue_before(self, position: int) -> None:
        """Issue the rounds up to the time this rank's action ``position`` starts.

        Raises:
            Stopped: the step halted, or a peer cannot be reached.
        """
        plan = self.plan
        if plan is None:
            return
        start = plan.starts[position]
        rounds = plan.rounds
        while self._round < len(rounds) and rounds[self._round][0] <= start:
            self._issue(rounds[self._round][1], draining=False)
        # Receives for the next action whose sizes are known go out now: their bytes
        # then flow as soon as their senders send, not when this rank comes to need them
        # (no further: each holds a buffer).
        ahead = plan.starts[position + 1] if position + 1 < len(plan.starts) else start
        while (
            self._round < len(rounds)
            and rounds[self._round][0] <= ahead
            and self._ready(rounds[self._round][1])
        ):
            self._issue(rounds[self._round][1], draining=False)

    def receive(self, key: Key) -> tuple[Any, Tensor | None, int] | None:
        """The metadata frame, the bytes and the sender of ``key``; None if not planned.

        Raises:
            Stopped: its sender cannot be reached.
        """
        entry = self._incoming.pop(key, None)
        if entry is None:
            return None
        frame, buffer, pending, sender = entry
        if pending is not None:
            try:
                pending.wait()
            except TransportError as error:
                self._lose(error)
                raise Stopped from error
        return frame, buffer, sender

    def drain(self) -> None:
        """Issue the remaining rounds; wait for every transfer; forget the step."""
        plan = self.plan
        if plan is not None:
            while self._round < len(plan.rounds):
                try:
                    self._issue(plan.rounds[self._round][1], draining=True)
                except Stopped:  # a peer was lost as it issued: its round is spent
                    continue
                except Exception as error:  # out of memory for a buffer, say
                    # The round and those after it go unissued while the peers issue
                    # theirs: the pairs no longer match, and no later call may run.
                    self.transport.abandon(
                        f"rank {self.rank} could not issue its share of a step's transfers "
                        f"after the step failed ({type(error).__name__}: {error})"
                    )
                    break
        works, self._sending = self._sending, []
        # Receives never taken (the step stopped): a work is waited for only once.
        works += [(peer, work) for _, _, work, peer in self._incoming.values() if work]
        self._incoming.clear()
        self._outbox.clear()
        self.plan, self._round = None, 0
        for peer, work in works:
            if self._lost(peer):
                continue
            try:
                work.wait()
            except TransportError as error:
                self._lose(error)
        if self.transport.wire.type == "cuda":
            # The buffers go back to the allocator: the sends must have read them.
            torch.cuda.current_stream(self.transport.wire).synchronize()

    def _ready(self, messages: tuple[Message, ...]) -> bool:
        """Whether a round only receives, and its sizes are known (issued without waiting)."""
        if any(m.src == self.rank for m in messages):
            return False
        return self.static is not None or all(self._arrived(m) for m in messages)

    def _issue(self, messages: tuple[Message, ...], *, draining: bool) -> None:
        """Build one round's group, issue it, then take it off the books.

        Draining, a message whose metadata never went out or came in is left out on
        both sides of its pair, and so is one with a lost peer.
        """
        me = self.rank
        static = self.static
        frames = {
            m.key: static[m.key] if static is not None else self._metadata(m, draining)
            for m in messages
            if m.dst == me
        }
        transfers: list[Transfer] = []
        sent: list[Key] = []
        received: list[tuple[Message, Any, Tensor | None, int | None]] = []
        for message in messages:
            peer = message.dst if message.src == me else message.src
            if draining and self._lost(peer):
                continue
            if message.src == me:
                if message.key not in self._outbox and draining:
                    if static is None:  # the action never ran, or its metadata never went out
                        continue
                    self._outbox[message.key] = self.zeros(message.key)
                if message.key not in self._outbox:
                    raise RuntimeError(
                        f"torchgpipe: rank {me} has nothing to send for {message.key} "
                        f"(a bug in the step's plan)"
                    )
                buffer = self._outbox[message.key]
                sent.append(message.key)
                if buffer is not None:
                    transfers.append(Transfer("send", peer, buffer))
                continue
            frame = frames[message.key]
            if frame is None:  # draining: it never came
                continue
            size = self._size(frame)
            slot = None
            buffer = None
            if size:
                buffer = torch.empty(size, dtype=torch.uint8, device=self.transport.wire)
                slot = len(transfers)
                transfers.append(Transfer("recv", peer, buffer))
            received.append((message, frame, buffer, slot))
        pending: list[Pending] = []
        failure: TransportError | None = None
        if transfers:
            try:
                pending = self.transport.issue(transfers)
            except TransportError as error:  # some may have started: the round is spent
                failure = error
                # Waited for on a thread of their own, as long as they take, not by this
                # one: a peer's round may have failed before their match, and gloo
                # delivers no send left unwaited.
                started = error.started
                wait_apart([w for _, w in started], 0.0, keep=[t.buffer for t, _ in started])
        self._round += 1
        for key in sent:
            del self._outbox[key]
        for message, frame, buffer, slot in received:
            if static is None:
                self._consume(message.key)
                self.seen[message.key] = frame
            work: Pending | None = None
            if failure is not None:
                work = _Failed(failure)
            elif slot is not None:
                work = pending[slot]
            self._incoming[message.key] = (frame, buffer, work, message.src)
        if failure is not None:
            self._lose(failure)
            raise Stopped from failure
        self._sending += [
            (t.peer, work) for t, work in zip(transfers, pending, strict=True) if t.kind == "send"
        ]


def layout_change(before: Any, now: Any) -> str:
    """What differs between two frames of one message, in words."""
    if before[2] != now[2]:
        return f"tensors {_shapes(before[2])} then, {_shapes(now[2])} now"
    (spec, leaves, _, wants, which), (new_spec, new_leaves, _, new_wants, new_which) = (
        pickle.loads(before[3]),
        pickle.loads(now[3]),
    )
    if wants != new_wants:
        return f"which tensors want a gradient: {wants} then, {new_wants} now"
    if spec != new_spec:
        return "its structure changed"
    if which != new_which:
        return "which of its tensors are one and the same tensor changed"
    return f"its non-tensor values changed: {leaves} then, {new_leaves} now"


def _shapes(layout: list[tuple[tuple[int, ...], Any]]) -> str:
    return ", ".join(
        f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in layout
    )


class _Failed:
    """A receive of a round whose issue failed: waiting for it raises that failure."""

    def __init__(self, error: TransportError) -> None:
        self._error = error

    def wait(self) -> None:
        """Raise the failure."""
        raise self._error
