"""The exchange: one process's mailbox for a step, whose messages may cross processes.

The actions of a step put and take messages by key (``("F", s, i)``: the input of
stage ``s`` for micro-batch ``i``). A key whose stage runs here stays in the local
mailbox; any other goes to the rank that runs it, in two parts:

- its **metadata** at once (unless known from the last step: ``transfers.py``; a value
  laid out otherwise then goes whole), on the side channel, a listener thread per peer
  receiving it: a frame with the key and the tensors' shapes and dtypes, which any
  process can read, and the value's structure and non-tensor leaves pickled apart (a
  value a process cannot unpickle fails the action that takes it, not the transfers);
- its **tensors**, as one flat buffer, in the round of the step's plan (``plan.py``)
  where the action that made it sent it: before its next action, the rank's own thread
  issues every round due by then, each as one group of sends and receives, each receive
  sized by the metadata that came ahead, or known from the last step on an input laid
  out alike (``transfers.py``). So the pipeline's process group sees transfers from
  one thread per process, in the same order on both ranks of a pair.

::

    rank 0 (thread of its actions)            rank 1
    0F0: put (F,1,0) ─ metadata ─ side ──────▶ listener: metadata of (F,1,0)
    before 0F1: round 1 [send (F,1,0)] ═══════ before 1F0: round 1 [recv (F,1,0)]
    ...                                        1F0: take (F,1,0) ◀═ the receive's buffer
    end(status) ───────────── side ──────────▶ listener(0) stops      (and the other way)

A step ends with every rank sending ``end`` to every other on the side channel, with
its status (failed or stopped, where and why, what it lost track of). It also says
that no more metadata follows: a rank that stopped half-way then still issues the rest
of its rounds, with the transfers whose metadata went out (its sends) or came in (its
receives) and no others (every planned one, when frames were known), so both ranks of
every pair issue the same operations, and the process group is left clean for the next
step. A failing rank sends ``end`` at once, which stops the takes waiting on the
others; they send theirs in turn. So a failure anywhere makes every rank fail, naming
the rank, the stage and the action where it started. A dead rank is seen by the
transport (``TransportError``) and reported alike, as the rank the most others lost for
a cause (of those lost alike, the first this rank lost). A failed send to the dead
rank does not stop the sends to the others (``flush``, for :data:`LOST_GRACE` seconds
more at most): gloo never delivers a send left unwaited, and the live ranks would miss
each other's ends.

Once a rank is known gone (this rank's transport failed to reach it, or an end says
another's did), a wait on the others lasts :data:`LOST_GRACE` seconds at most (a death
was seen to leave a live process mute). Peers still silent then are given up, their
listeners left in a receive that would take a later call's message: the transport
refuses every later call. A cause that comes after (a listener's news: the peer built a
stage, or sent what cannot be read) replaces its being given up or unreachable.

An exchange serves one call of every process (a step, ``collect.py``), tagged by its
first key's first element; a wait on a peer in another call ends at once, and each
``end`` names its sender's call: a process in another call fails the others, named.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from torchgpipe.distributed.channel import BUILD_FIRST, GREETING, Transport, TransportError
from torchgpipe.distributed.errors import RemoteError, first_failure
from torchgpipe.distributed.plan import Message, RankPlan
from torchgpipe.distributed.transfers import Transfers, layout_change
from torchgpipe.distributed.wire import FAILED, MOVED, filled, pack, shell, unpack
from torchgpipe.mailbox import Mailbox, Stopped
from torchgpipe.worker import WorkerPool

__all__ = ["LOST_GRACE", "RemoteError"]

Key = tuple[Any, ...]

LOST_GRACE = 10.0  # seconds a wait on a peer lasts once a rank is gone (see above)


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

    told: dict[int, str] | None = None  # self.lost as this rank's end said it (finish)

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
        self.gone = False  # a rank is known gone: waits on the others are bounded
        self.abandoned: set[int] = set()  # peers whose listeners were left waiting
        self.given_up: set[int] = set()  # peers lost for that alone (_give_up)
        self._unreached: set[int] = set()  # peers lost for the transport's failure alone
        self._listening = {p: threading.Event() for p in self.peers}  # set under _arrived
        # Guards what came ahead (metadata, whole values), the silent peers; wakes wait_for().
        self._arrived = threading.Condition()
        self._metadata: dict[Key, Any] = {}
        self._moved: dict[Key, tuple[Any, list[Tensor]]] = {}  # values sent whole
        self._silent: set[int] = set()
        self.signature = b""  # a digest of the layout of the step's input (known frames)
        self.moved = 0  # the values this rank sent whole, not laid out as expected
        # This process's call (its maker sets it): the tag its keys begin with, its name.
        self.tag, self.call = "start", "schedule.step()"
        self._opened: dict[int, str] = {}  # each peer's tag, by its first value (_arrived)
        self.transfers = Transfers(
            transport,
            metadata=self._peek_metadata,
            arrived=lambda message: message.key in self._metadata,
            consume=self._consume_metadata,
            lose=lambda error: self.lose(error.peer, _unreachable(error), gone=True),
            lost=lambda peer: peer in self.lost,
        )
        for k, peer in enumerate(self.peers):
            pool.submit(k, self._listener(peer), partial(self._listener_failed, peer))

    # Messages

    def follow(
        self, plan: RankPlan, frames: dict[Key, Any] | None = None, *, strict: bool = True
    ) -> None:
        """Transfer the step's tensors by ``plan``; :meth:`begin` before each action.

        ``frames``: the metadata of every message, as in the last step on an input
        laid out as this one: none goes on the side channel; ``strict``: a value laid
        out otherwise fails its action, else it moves there (``transfers.py``).
        """
        self.transfers.follow(plan, frames, strict=strict)

    def begin(self, position: int) -> None:
        """Issue the transfers due before this rank's action ``position`` (``plan.py``)."""
        self.transfers.issue_before(position)

    def put(self, key: Key, value: Any) -> None:
        owner = self._owner(key)
        if owner == self.rank:
            super().put(key, value)
        elif self.transfers.plan is None:
            self.send(owner, key, value)
        else:
            self._post(owner, key, value)

    def take(self, key: Key) -> Any:
        wire_key = self._wire(key) if key[0] in _PLANNED else key
        if self.halted and self.transfers.expects(wire_key):
            raise Stopped  # its transfer, if issued, is the drain's to wait for
        got = self.transfers.receive(wire_key)
        if got is None:
            if self.transfers.expects(wire_key):
                raise RuntimeError(
                    f"torchgpipe: rank {self.rank} takes {key} before the round that "
                    f"receives it was issued (a bug in the step's plan)"
                )
            return super().take(key)
        frame, buffer, sender = got
        # With known frames, a failed sender's drain sends zeros in place of data.
        mark = self.transfers.mark(buffer)
        if self.halted or mark == FAILED:
            raise Stopped
        if mark == MOVED:  # laid out otherwise than last time: the side channel has it
            frame, tensors = self._moved_value(wire_key, sender)
            self.transfers.seen[wire_key] = frame  # as the sender noted it
        else:
            tensors = unpack(buffer, frame[2], self.transport.device)
        try:
            return filled(frame[3], tensors)
        except Exception as error:
            raise RuntimeError(
                f"rank {self.rank} could not read the value that came under {key}: "
                f"{error!r}; every process must be able to unpickle what passes between "
                f"stages (import the classes of its non-tensor values)"
            ) from error

    def wait_for(self, key: Key, peer: int) -> Any:
        """The side-channel value under ``key`` from ``peer``, even after a halt.

        None once ``peer`` ended (or was lost) without sending it, or opened another call
        (its first value's key began with another tag than ``key``).
        """
        with self._arrived:
            deadline = None
            while True:
                with self._lock:
                    if key in self._box:
                        return self._box.pop(key)
                if peer in self._silent or self._opened.get(peer, key[0]) != key[0]:
                    return None
                deadline = self._wait(deadline)

    def send(self, peer: int, key: Key, value: Any) -> None:
        """Send ``value`` under ``key`` to rank ``peer``'s mailbox, all on the side channel.

        For what is not a step's activation or gradient: the start of a step, traces.

        Raises:
            Stopped: ``peer`` cannot be reached; the step halts.
        """
        tensors, body = shell(value)
        self._side(peer, ("value", self._wire(key), body), tensors)

    def _post(self, peer: int, key: Key, value: Any) -> None:
        """Send the metadata of ``value`` now; keep its bytes for the plan's round.

        The frame holds the key and the tensors' layout, which every process can read;
        the rest (structure, non-tensor values) is pickled apart, so that a value this
        process cannot unpickle fails its action without breaking the transfers.
        """
        tensors, body = shell(value)
        wire_key = self._wire(key)
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        frame = ("metadata", wire_key, layout, body)
        static = self.transfers.static
        if static is not None:
            expected = static[wire_key]
            if frame == expected:  # the common case: one comparison per message
                self.transfers.hold(wire_key, frame, pack(tensors, self.transport.wire, mark=True))
                return
            if not self.transfers.strict:  # whole on the side channel; marked zeros point there
                self._side(peer, ("moved", *frame[1:]), tensors)
                self.moved += 1
                self.transfers.hold(wire_key, frame, self.transfers.zeros(wire_key, MOVED))
                return
            self.transfers.hold(wire_key, expected, self.transfers.zeros(wire_key))
            raise ValueError(
                f"static_shapes=True, but the value under {key} is not laid out as in "
                f"the last step with this input ({layout_change(expected, frame)}). If "
                f"its shapes vary at a given input shape, build the PipelineStage with "
                f"static_shapes=False; if a stage's parameters were frozen or unfrozen "
                f"since (requires_grad_), or the ranks are not all in the same "
                f"train()/eval() mode, the next step learns the new layouts"
            )
        buffer = pack(tensors, self.transport.wire)
        self._side(peer, frame, [])
        self.transfers.hold(wire_key, frame, buffer)  # only once its metadata went out

    def _side(self, peer: int, header: Any, tensors: list[Tensor]) -> None:
        try:
            self.transport.send(peer, header, tensors)
        except TransportError as error:
            self.lose(peer, _unreachable(error), gone=True)
            raise Stopped from error

    def _peek_metadata(self, message: Message, draining: bool) -> Any:
        """The metadata frame of ``message``, left in place; None if it will not come.

        Raises:
            Stopped: not draining, and the step halted or the sender went silent first.
        """
        with self._arrived:
            deadline = None
            while True:
                frame = self._metadata.get(message.key)
                if frame is not None:
                    return frame
                if message.src in self._silent:
                    if draining:
                        return None
                    raise Stopped
                if self.halted and not draining:
                    raise Stopped
                deadline = self._wait(deadline)

    def _moved_value(self, key: Key, peer: int) -> tuple[Any, list[Tensor]]:
        """The frame and tensors of a value ``peer`` sent whole; Stopped if it was lost."""
        with self._arrived:
            deadline = None
            while key not in self._moved:
                if peer in self._silent:
                    raise Stopped
                deadline = self._wait(deadline)
            frame, tensors = self._moved.pop(key)
        return frame, [t.to(self.transport.device) for t in tensors]

    def _consume_metadata(self, key: Key) -> None:
        with self._arrived:
            del self._metadata[key]

    def _listener(self, peer: int) -> Callable[[], None]:
        def listen() -> None:
            try:
                while self._receive(peer):
                    pass
            except TransportError as error:
                self.lose(peer, _unreachable(error), gone=True)
            except BaseException as error:  # the transport could not decode a message
                self.lose(peer, f"sent a message that could not be read: {error!r}")
            finally:
                self._heard_all(peer)

        return listen

    def _receive(self, peer: int) -> bool:
        """Receive one side-channel message from ``peer``; False once it was the last."""
        header, tensors = self.transport.recv(peer)
        if header == GREETING:  # the first message of a transport: a stage built anew
            self.transport.abandon(f"rank {peer} built a PipelineStage in a call; {BUILD_FIRST}")
            self.lose(peer, f"built a PipelineStage during this call; {BUILD_FIRST}")
            return False
        if header[0] == "end":
            status = header[1]
            with self._arrived:
                if peer in self.abandoned:  # too late: the step is over without it
                    return False
                self.ends[peer] = (status, tensors)
                self.gone = self.gone or bool(status.get("gone"))
            if status.get("abandoned"):  # the group's channels are out of step there
                self.transport.abandon(f"rank {peer} said: {status['abandoned']}")
            self._go_silent(peer)
            if status["failed"]:
                self.halt()
            return False
        if header[0] in ("metadata", "moved"):
            with self._arrived:
                if header[0] == "metadata":
                    self._metadata[header[1]] = header
                else:
                    self._moved[header[1]] = (("metadata", *header[1:]), tensors)
                self._arrived.notify_all()
            return True
        try:
            _, wire_key, body = header
            value = filled(body, tensors)
            super().put(self._unwire(wire_key), value)
        except BaseException as error:  # keep listening: the peer goes on sending
            self.lose(peer, f"sent a message that could not be read: {error!r}")
        with self._arrived:
            self._opened.setdefault(peer, header[1][0])  # its call's tag: its first key's
            self._arrived.notify_all()  # for wait_for()
        return True

    def _go_silent(self, peer: int) -> None:
        with self._arrived:
            self._silent.add(peer)
            self._arrived.notify_all()

    def halt(self) -> None:
        super().halt()
        with self._arrived:
            self._arrived.notify_all()

    def _listener_failed(self, peer: int, error: BaseException) -> None:
        self.lost.setdefault(peer, f"could not be listened to: {error!r}")
        self._go_silent(peer)
        self._heard_all(peer)
        self.halt()

    def _heard_all(self, peer: int) -> None:  # peer's listener is over: ended, or lost
        with self._arrived:
            self._listening[peer].set()
            self._arrived.notify_all()

    def lose(self, peer: int, reason: str, *, gone: bool = False) -> None:
        """Stop the step on a lost ``peer``; ``gone``: the transport could not reach it."""
        with self._arrived:
            if peer in self.given_up:
                self.given_up.discard(peer)
                del self.lost[peer]
            elif not gone and peer in self._unreached:  # in place: the order names the first
                self._unreached.discard(peer)
                self.lost[peer] = reason
            if gone and peer not in self.lost:
                self._unreached.add(peer)
            self.lost.setdefault(peer, reason)
            self.gone = self.gone or gone
        self._go_silent(peer)
        self.halt()

    def _wait(self, deadline: float | None) -> float | None:
        """Wait on ``_arrived`` (held) once; pass what it returns to the next call.

        Once a rank is gone, a wait lasts :data:`LOST_GRACE` seconds at most: then the
        peers whose listeners are still waiting are given up (:meth:`_give_up`).
        """
        if not self.gone:
            self._arrived.wait()
            return None
        deadline = time.monotonic() + LOST_GRACE if deadline is None else deadline
        left = deadline - time.monotonic()
        if left > 0:
            self._arrived.wait(left)
            return deadline
        self._give_up()
        return None

    def _give_up(self) -> None:
        """Give up the peers that sent no end yet; the transport refuses later calls."""
        silent = [p for p in self.peers if not self._listening[p].is_set() and p not in self.ends]
        for peer in silent:
            self.abandoned.add(peer)
            if peer not in self.lost:  # not lost for a cause: only given up
                self.given_up.add(peer)
                self.lost[peer] = (
                    f"sent no end of the step within {LOST_GRACE:g} s after a rank was lost "
                    f"(it may be alive, and mute: its connections stalled)"
                )
            self._silent.add(peer)
        self._arrived.notify_all()
        if silent:
            self.halt()
            self.transport.abandon(
                f"rank {self.rank} gave up waiting on rank(s) {silent} after a rank was "
                f"lost (a process of the pipeline died or stopped answering); its side "
                f"channel to them is out of order"
            )

    # The end of the step

    def finish(self, status: dict[str, Any], tensors: list[Tensor]) -> None:
        """Send this rank's ``end`` to every peer, finish the transfers, wait for theirs.

        ``status`` says whether this rank ``failed`` (it raised, or stopped because
        another did) and ``error``: the description of its own failure, if it raised.
        Call it on the thread of this rank's actions: it issues the plan's last rounds.
        """
        self.told = dict(self.lost)  # the losses the others read in this rank's end
        status = {**status, "lost": self.told, "tag": self.tag, "call": self.call}
        status.update(moved=self.moved, gone=self.gone, given_up=sorted(self.given_up))
        for peer in self.peers:
            if peer in self.lost and peer not in self.given_up:  # given up: maybe alive
                continue
            try:
                self.transport.send(peer, ("end", status), tensors)
            except TransportError as error:
                self.lose(peer, _unreachable(error), gone=True)
        try:
            self.transfers.drain()
        finally:
            try:
                self.transport.flush(LOST_GRACE)
            except TransportError as error:
                self.lose(error.peer, _unreachable(error), gone=True)
            with self._arrived:  # every listener over, or given up (_give_up)
                deadline = None
                while not all(
                    self._listening[p].is_set() or p in self.abandoned for p in self.peers
                ):
                    deadline = self._wait(deadline)

    def close(self) -> None:
        """End an exchange that ran no step (the start-up check, a trace's gathering).

        Raises:
            RemoteError: another process failed, or was lost.
        """
        self.finish({"failed": self.halted, "error": None}, [])
        if (remote := self.remote_failure()) is not None:
            raise remote

    def remote_failure(self) -> RemoteError | None:
        """The failure of another rank that stopped this step, or None if none did."""
        failure = first_failure(
            self.rank,
            self.stages,
            self.ends,
            self.lost,
            self.given_up,
            told=self.told,
            global_ranks=self.transport.global_ranks,
        )
        if failure is None and self.halted and not self.other_calls():  # pragma: no cover
            return RemoteError("the step stopped on another rank", rank=-1, stages=())
        return failure

    def other_calls(self) -> dict[int, str]:
        """The peers whose ends name another call than this process's: their calls."""
        ends = sorted(self.ends.items())
        return {p: s["call"] for p, (s, _) in ends if s.get("tag", self.tag) != self.tag}


_PLANNED = frozenset({"F", "G", "S", "SG"})  # the kinds of key a step's plan transfers


def _unreachable(error: TransportError) -> str:
    return (
        f"died or cannot be reached (or waits in a call of another kind, a collective of its "
        f"own, say: do the ranks run as many steps?); see its own output for the cause. "
        f"The transport said: {error}"
    )
