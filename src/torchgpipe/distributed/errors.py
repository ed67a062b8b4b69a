"""What a rank tells the others of a failure, and what they raise: :class:`RemoteError`."""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any

from torchgpipe.mailbox import KIND_NAMES
from torchgpipe.schedules import Action

__all__ = ["RemoteError", "describe", "first_failure", "rank_name"]


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
    kind = KIND_NAMES[action.kind] if action is not None else ""
    where = "" if action is None else f" in {action} ({kind} of micro-batch {action.i} of {m})"
    return {
        "rank": rank,
        "stages": stages,
        "action": None if action is None else str(action),
        "text": f"{type(error).__name__}: {_said(error)}",
        "where": where,
        "traceback": "".join(traceback.format_exception(error)),
    }


def rank_name(rank: int, global_ranks: Sequence[int] | None = None) -> str:
    """``rank`` as messages name it: with its global rank where the group is not all."""
    if global_ranks is None or global_ranks[rank] == rank:
        return f"rank {rank}"
    return f"rank {rank} (global rank {global_ranks[rank]})"


def _said(error: BaseException) -> str:
    """What ``error`` says; a description must not fail where the exception's does."""
    try:
        return str(error)
    except Exception as failure:  # a user's __str__ with a bug: the step must still end
        return f"<its str() raised {type(failure).__name__}>"


def first_failure(
    rank: int,
    stages: list[tuple[int, ...]],
    ends: dict[int, tuple[dict[str, Any], Any]],
    lost: dict[int, str],
    given_up: set[int],
    *,
    told: dict[int, str] | None = None,
    global_ranks: Sequence[int] | None = None,
) -> RemoteError | None:
    """What rank ``rank`` raises for a step that failed elsewhere, from the ends it got.

    The lowest rank that raised; else the peer the most ranks lost for a cause (not only
    given up as silent, ``given_up`` here and in each end), the likely dead one; of
    those lost alike, the first over the orders of losses that every rank read: each
    end's, this rank's as its own end told it (``told``; ``lost`` where none was sent).
    Ranks are named with their ``global_ranks`` too, if given (:func:`rank_name`).
    """
    mine = dict(lost) if told is None else told  # this rank's losses, as the others read
    errors = [s["error"] for s, _ in ends.values() if s.get("error") is not None]
    if errors:
        first = min(errors, key=lambda e: e["rank"])
        more = len(errors) - 1
        also = f" (and {more} other rank{'s' * (more > 1)} failed too)" if more else ""
        who = rank_name(first["rank"], global_ranks)
        return RemoteError(
            f"{who} (stages {list(first['stages'])}) raised "
            f"{first['text']}{first['where']}{also}\n\n"
            f"Traceback on {who}:\n{first['traceback']}",
            rank=first["rank"],
            stages=tuple(first["stages"]),
            action=first["action"],
            remote_traceback=first["traceback"],
        )
    seen, caused = Counter(list(lost)), Counter(p for p in lost if p not in given_up)
    strong = {p: r for p, r in lost.items() if p not in given_up}  # lost for a cause
    weak = {p: r for p, r in lost.items() if p in given_up}
    for status, _ in ends.values():
        theirs = set(status.get("given_up", ()))
        for key, reason in status["lost"].items():
            peer = int(key)
            seen[peer] += 1
            caused[peer] += peer not in theirs
            (weak if peer in theirs else strong).setdefault(peer, reason)
    lost = {**weak, **strong}  # a cause's reason over having given up
    lost.pop(rank, None)  # a peer lost after its end came: the cause if none else
    if lost := {p: r for p, r in lost.items() if p not in ends} or lost:
        # Most lost it: dead. On a tie, the one lost first, over every rank's order of
        # losses (the same sum on every rank that got the same ends): a peer whose
        # process ended after the failure (its own end sent) is lost later.
        orders = [list(mine), *([int(p) for p in s["lost"]] for s, _ in ends.values())]
        when = {p: sum(o.index(p) if p in o else len(o) for o in orders) for p in lost}
        peer = min(lost, key=lambda p: (-caused[p], -seen[p], when[p], p))
        return RemoteError(
            f"{rank_name(peer, global_ranks)} (stages {list(stages[peer])}) {lost[peer]}",
            rank=peer,
            stages=stages[peer],
        )
    return None
