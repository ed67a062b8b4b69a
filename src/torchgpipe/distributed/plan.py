"""The order of a step's transfers between processes, derived from its table alone.

NCCL runs the point-to-point operations of a process on one stream per communicator,
in the order the process issued them, and an operation does not finish before the peer
has reached its match (the k-th send from rank a to rank b matches the k-th receive at
b from a). Two ranks whose next operations do not match each other wait forever; two
threads issuing on one communicator leave the order to chance. So each process issues
its transfers from one thread (the one that runs its actions), in an order that both
ranks of every pair compute from the same data, the table:

1. A dry run of the table (:meth:`Schedule.dry_run`) gives each action a step: every
   rank runs its next action at the first step where all it needs ran at earlier ones.
2. The messages that the actions of step ``t`` send to other processes make round
   ``t``. A rank's part of a round is one group (``batch_isend_irecv``): the sends of
   its own action of step ``t`` and the receives of what the others sent at step ``t``.
3. A rank issues its rounds in order, and all those of steps before ``t`` before it
   runs its action of step ``t``::

       step        0         1             2
       rank 0     0F0       0F1           0B0
       rank 1      .        1F0           1B0
       round 0: rank 0 -> rank 1 (F, 1, 0)
       round 1: rank 0 -> rank 1 (F, 1, 1)
       round 2: rank 1 -> rank 0 (G, 0, 0)

Why it cannot hang: take the first round ``t`` not finished. Its actions (step ``t``)
needed only messages of earlier rounds, which finished, so every rank of the round
reaches it, and the round is every one of its ranks' next group: NCCL runs it.

The metadata of a message (its key, the structure of the value, shapes and dtypes) goes
ahead on the CPU side channel as soon as the action produces it (``exchange.py``); the
receiver needs it to size its buffers before it issues the round.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torchgpipe.schedules import Action, Schedule

__all__ = ["Message", "RankPlan", "plan"]

Key = tuple[Any, ...]


@dataclass(frozen=True)
class Message:
    """One message of a step from rank ``src`` to rank ``dst``.

    ``key`` is the message's key as it crosses processes: ``("F", s, i)`` the input of
    stage ``s``, ``("G", s, i)`` the gradient of its output, ``("S", k, i)`` and
    ``("SG", k, i)`` the skip of route ``k`` and its gradient.
    """

    key: Key
    src: int
    dst: int


@dataclass(frozen=True)
class RankPlan:
    """What one rank issues in a step, and when.

    Attributes:
        steps: the dry run's step of each of the rank's actions that the step runs.
        rounds: ``(step, messages)`` for each round the rank takes part in, in order;
            the messages it sends and receives in it, in the order both ranks issue them.
        receives: the keys of every message the rank receives in the step.
    """

    steps: tuple[int, ...]
    rounds: tuple[tuple[int, tuple[Message, ...]], ...]
    receives: frozenset[Key]


@lru_cache(maxsize=256)
def plan(
    table: Schedule, routes: tuple[tuple[int, int], ...], rank: int, kinds: str = "FBW"
) -> RankPlan:
    """Rank ``rank``'s transfers in a step of ``table``, running the actions of ``kinds``.

    ``routes[k]`` is ``(stash stage, pop stage)`` of skip route ``k`` (the routes that
    cross stages); ``kinds="F"`` for a forward-only step.

    Raises:
        ScheduleError: the table's dry run stalls.
    """
    placement = table.placement
    steps: list[int] = []
    rounds: list[tuple[int, tuple[Message, ...]]] = []
    receives: set[Key] = set()
    for t, row in enumerate(table.dry_run(kinds)):
        mine: list[Message] = []
        for action in row:  # rank order: the same on every rank
            if action is None:
                continue
            if placement[action.stage] == rank:
                steps.append(t)
            for message in _sent_by(action, table.stages, routes, placement):
                if rank in (message.src, message.dst):
                    mine.append(message)
                if message.dst == rank:
                    receives.add(message.key)
        if mine:
            rounds.append((t, tuple(mine)))
    return RankPlan(tuple(steps), tuple(rounds), frozenset(receives))


def _sent_by(
    action: Action, n: int, routes: tuple[tuple[int, int], ...], placement: tuple[int, ...]
) -> list[Message]:
    """The messages ``action`` sends to another process, in the order it puts them."""
    s, i = action.stage, action.i
    out: list[tuple[Key, int]] = []
    if action.kind == "F":
        if s + 1 < n:
            out.append((("F", s + 1, i), s + 1))
        out += [(("S", k, i), pop) for k, (stash, pop) in enumerate(routes) if stash == s]
    elif action.kind == "B":
        if s > 0:
            out.append((("G", s - 1, i), s - 1))
        out += [(("SG", k, i), stash) for k, (stash, pop) in enumerate(routes) if pop == s]
    src = placement[s]
    return [Message(key, src, placement[to]) for key, to in out if placement[to] != src]
