"""A test double for NCCL's point-to-point rules, checked on CPU (issue 13, part 2).

NCCL runs the point-to-point operations of one communicator on one stream per process,
in the order that process issued them, and an operation does not finish until the peer
has reached its match: the k-th send from rank a to rank b matches the k-th receive at
b from a, and both must move the same bytes. So two ranks that each issue a send to the
other before their receive wait on each other forever, unless the four operations are
issued as one group (``batch_isend_irecv``), which NCCL runs together. Operations issued
from several threads of one process come in an order left to chance.

The model: each process runs its groups (a lone operation is a group of one) one after
another; an operation finishes once the peer has reached the group that holds its
match (that group started, or already finished); a group finishes when all its
operations have, and only then does the process start its next one.

:class:`NCCLRules` records what each process issues (``issue``, or ``group`` for a
``batch_isend_irecv``) and says what NCCL would do with it:

- ``issue`` refuses at once an operation from a second thread of a process;
- ``check`` plays the operations out as NCCL would and raises :class:`WouldHang` at the
  first point where none can proceed, naming each stuck rank's head operation and what
  its peer has at its head, or :class:`Mismatch` for a pair whose matched operations
  move different byte counts or that has a send with no receive.

``LocalTransport.mesh(world, observe=rules.group)`` reports every group of transfers to
it as a rank issues it (``tests/test_nccl_transport.py``), and ``tests/test_distributed.py``
replays what gloo processes issued into it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

Kind = Literal["send", "recv"]


@dataclass(frozen=True)
class Op:
    """One point-to-point operation as a process issued it."""

    rank: int
    peer: int
    kind: Kind
    nbytes: int
    index: int  # its position among the rank's operations, in issue order

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        size = f"{self.nbytes} B, #{self.index}"
        return f"rank {self.rank} {self.kind} {arrow} rank {self.peer} ({size})"


class Violation(AssertionError):
    """An operation that NCCL would not run as the code means it to."""


class WouldHang(Violation):
    """No process can go on: each waits for a peer that waits for something else."""


class Mismatch(Violation):
    """Matched operations disagree (byte counts), or one has no match at all."""


class NCCLRules:
    """The point-to-point operations of ``world`` processes on one communicator."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._units: list[list[list[Op]]] = [[] for _ in range(world)]  # per rank, in order
        self._count = [0] * world
        self._thread: dict[int, object] = {}
        self._lock = threading.Lock()

    def issue(
        self, rank: int, peer: int, kind: Kind, nbytes: int, *, thread: object = None
    ) -> None:
        """Record one operation, issued alone (``isend``, ``irecv``, ``send``, ``recv``).

        ``thread`` names the issuing thread when the operations are replayed from a
        record (another process's); by default, the calling thread.

        Raises:
            Violation: a second thread of ``rank`` issues operations.
        """
        self.group(rank, [(peer, kind, nbytes)], thread=thread)

    def group(self, rank: int, ops: list[tuple[int, Kind, int]], *, thread: object = None) -> None:
        """Record operations issued together (``batch_isend_irecv``), run as one.

        Raises:
            Violation: a second thread of ``rank`` issues operations.
        """
        me = threading.get_ident() if thread is None else thread
        with self._lock:
            first = self._thread.setdefault(rank, me)
            if first != me:
                raise Violation(
                    f"rank {rank} issues point-to-point operations from two threads "
                    f"({first} and {me}); NCCL would run them in an order left to chance"
                )
            unit = []
            for peer, kind, nbytes in ops:
                unit.append(Op(rank, peer, kind, nbytes, self._count[rank]))
                self._count[rank] += 1
            self._units[rank].append(unit)

    def check(self) -> None:
        """Play the recorded operations out as NCCL would.

        Raises:
            Mismatch: matched operations move different byte counts, or an operation
                has no match.
            WouldHang: at the first point where no process can go on.
        """
        partner = self._pair()
        heads = [0] * self.world  # per rank: its unit now running
        done = 0
        total = sum(len(units) for units in self._units)
        unit_of = {
            op: (r, k)
            for r in range(self.world)
            for k, unit in enumerate(self._units[r])
            for op in unit
        }
        while done < total:
            ready = [
                r
                for r in range(self.world)
                if heads[r] < len(self._units[r])
                and all(
                    heads[unit_of[partner[op]][0]] >= unit_of[partner[op]][1]
                    for op in self._units[r][heads[r]]
                )
            ]
            if not ready:
                raise WouldHang(self._stuck(heads, partner))
            for r in ready:
                heads[r] += 1
                done += 1

    def _pair(self) -> dict[Op, Op]:
        """Each operation's match: the k-th send a -> b with the k-th receive at b from a."""
        sends: dict[tuple[int, int], list[Op]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[Op]] = defaultdict(list)
        for units in self._units:
            for unit in units:
                for op in unit:
                    if op.kind == "send":
                        sends[(op.rank, op.peer)].append(op)
                    else:
                        recvs[(op.peer, op.rank)].append(op)
        partner: dict[Op, Op] = {}
        for pair in sorted(set(sends) | set(recvs)):
            out, into = sends[pair], recvs[pair]
            if len(out) != len(into):
                a, b = pair
                raise Mismatch(
                    f"rank {a} sends {len(out)} times to rank {b}, which receives "
                    f"{len(into)} times from it: an operation has no match"
                )
            for send, recv in zip(out, into, strict=True):
                if send.nbytes != recv.nbytes:
                    raise Mismatch(f"{send} matches {recv}: different byte counts")
                partner[send], partner[recv] = recv, send
        return partner

    def _stuck(self, heads: list[int], partner: dict[Op, Op]) -> str:
        lines = ["no process can go on; NCCL would hang here:"]
        for r in range(self.world):
            if heads[r] >= len(self._units[r]):
                continue
            for op in self._units[r][heads[r]]:
                match = partner[op]
                lines.append(f"  {op} waits for {match}")
        return "\n".join(lines)
