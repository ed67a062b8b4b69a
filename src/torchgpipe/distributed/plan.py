"""The order of a step's transfers between processes, derived from its table alone.

NCCL runs the point-to-point operations of a process on one stream per communicator,
in the order the process issued them, and an operation does not finish before the peer
has reached its match (the k-th send from rank a to rank b matches the k-th receive at
b from a). Two ranks whose next operations do not match each other wait forever; two
threads issuing on one communicator leave the order to chance. So each process issues
its transfers from one thread (the one that runs its actions), in an order that both
ranks of every pair compute from the same data, the table:

1. The table is played on paper (:func:`~torchgpipe.schedules.timeline`) with a
   forward costing 1, a backward 2 (1 each for the ``B`` and ``W`` of a split one):
   each action gets a start and an end time.
2. A message is sent at the end of the action that makes it; the messages sent at
   time ``τ`` make round ``τ`` (two rounds when forwards and backwards end together:
   the forwards' first, since a forward is the shorter and ends first in a real run).
   A rank's part of a round is one group (``batch_isend_irecv``): its sends at ``τ``
   and its receives of what others sent at ``τ``, exchanged together.
3. A rank issues its rounds in order of time, and all those up to ``τ`` before it runs
   an action that starts at ``τ``::

       time        0    1    2    3    4    5
       rank 0     0F0  0F1   .    .   0B0  0B0
       rank 1      .   1F0  1B0  1B0  1F1 ...
       round 1: rank 0 -> rank 1 (F, 1, 0)     round 2: rank 0 -> rank 1 (F, 1, 1)
       round 4: rank 1 -> rank 0 (G, 0, 0)

Why it cannot hang: take the first round ``τ`` not finished. The actions that ended at
``τ`` started before it and needed only messages of earlier rounds, which finished; so
did every action that starts before ``τ`` on the round's ranks. So each of them
reaches the round, which is its next group: NCCL runs it. The costs only decide how
close the order comes to the one the run takes: a backward that ends after a forward
that started with it sends later, and a rank does not wait for its gradient to send
the activation it made first (as a round per step of the table's dry run would).

The metadata of a message (its key, the structure of the value, shapes and dtypes) goes
ahead on the CPU side channel as soon as the action produces it (``exchange.py``); the
receiver needs it to size its buffers before it issues the round, unless the frames are
known from a step on an input laid out alike (``transfers.py``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torch import Tensor

from torchgpipe.microbatch import flatten
from torchgpipe.schedules import Action, Schedule, timeline

__all__ = ["Message", "RankPlan", "layout_signature", "parsed_table", "plan"]

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
        starts: the time on paper at which each of the rank's actions (of those the step
            runs) starts.
        rounds: ``(time, messages)`` for each round the rank takes part in, in order of
            time; the messages it sends and receives in it, in the order both ranks
            issue them.
        receives: the keys of every message the rank receives in the step.
    """

    starts: tuple[float, ...]
    rounds: tuple[tuple[float, tuple[Message, ...]], ...]
    receives: frozenset[Key]


@lru_cache(maxsize=256)
def plan(
    table: Schedule, routes: tuple[tuple[int, int], ...], rank: int, kinds: str = "FBW"
) -> RankPlan:
    """Rank ``rank``'s transfers in a step of ``table``, running the actions of ``kinds``.

    ``routes[k]`` is ``(stash stage, pop stage)`` of skip route ``k`` (the routes that
    cross stages); ``kinds="F"`` for a forward-only step.

    Raises:
        ScheduleError: the table cannot finish.
    """
    placement = table.placement
    start, end = timeline(table, _cost(table.splits_backward), kinds)
    mine = [a for a in table.ranks[rank] if a.kind in kinds]
    # Every action, by the time it sends, then by rank and place in its rank's order.
    order = {a: (r, k) for r, actions in enumerate(table.ranks) for k, a in enumerate(actions)}
    # A round per time and direction: at a tie, what forwards go before gradients.
    rounds: dict[tuple[float, int], list[Message]] = {}
    receives: set[Key] = set()
    for action in sorted(end, key=lambda a: (end[a], a.kind != "F", order[a])):
        for message in _sent_by(action, table.stages, routes, placement):
            if rank in (message.src, message.dst):
                rounds.setdefault((end[action], action.kind != "F"), []).append(message)
            if message.dst == rank:
                receives.add(message.key)
    return RankPlan(
        starts=tuple(start[a] for a in mine),
        rounds=tuple((time, tuple(messages)) for (time, _), messages in sorted(rounds.items())),
        receives=frozenset(receives),
    )


def _cost(split: bool) -> Callable[[Action], float]:
    """The paper costs: a forward 1, a backward 2, or 1 each for a split one's B and W."""
    costs = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    return lambda action: costs[action.kind]


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


def layout_signature(
    table: Schedule, forward_only: bool, training: bool, batches: list[Any]
) -> bytes:
    """What decides the layout of every message, if any does: the step's input.

    And the mode of the stages: in training mode a checkpointed cell marks every floating
    output as wanting a gradient, in eval mode only those that do (the layouts of one
    input differ). Empty (never the same as another) when the input holds what cannot
    be pickled.
    """

    def kind(x: Any) -> Any:
        return (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, Tensor) else x

    layout = [(spec, [kind(x) for x in leaves]) for leaves, spec in map(flatten, batches)]
    try:
        return pickle.dumps((table.text(), forward_only, training, layout))
    except Exception:  # a lambda, a lock: no static step for this input
        return b""


@lru_cache(maxsize=64)
def parsed_table(text: str, stages: int) -> Schedule:
    """Rank 0's table, from the text it sent (kept: steps repeat it)."""
    return Schedule.parse(text, stages=stages)
