"""Values brought together from every process outside a step: traces, norm parts.

The stage's exchange carries them on the side channel, as it carries a step's start:
each rank sends its value to the ranks that want it (and None to the others), with
the call's arguments, and every rank takes one message from every peer: each hears of
the call, and of the arguments the others made it with. Closing the exchange tells
every rank whether another failed or was lost, so a rank that fails to take part fails
every other rank too, naming it.

A process that makes another call meanwhile is named too, promptly (``exchange.py``):
its value opens with another tag, so no rank waits for it. If it is a step, which
rank 0 started, the ranks here join it as ranks that failed at its start
(``schedule.join_step``), and every rank fails; another call of this module fails the
ranks that expected its part::

    rank 0: schedule.step()                   rank 1: stage.clip_grad_norm_()
    (its norm, left in the mailbox) ◀──────── (norm, 1)
    start ──────────────────────────────────▶ finds rank 0's start, not its norm:
    metadata of (F,1,0) ────────────────────▶   joins the step, halted
    halted ◀──────────────────────────────── end(failed, its call)
    end(its call); drain: send (F,1,0) ══════ drain: receive (F,1,0)
    RuntimeError: rank 1 called               RuntimeError: rank 0 called
      stage.clip_grad_norm_() while ...         schedule.step() while ...
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from torchgpipe.clip import check_clip_arguments, clip_grad_norm, counted_once
from torchgpipe.distributed.checks import mismatch
from torchgpipe.mailbox import Stopped, add_note

if TYPE_CHECKING:
    from torch import Tensor

    from torchgpipe.distributed.stage import PipelineStage
    from torchgpipe.tied import Ties

__all__ = ["clip_across", "collect", "refuse", "terms_of"]

CALLS = {"norm": "stage.clip_grad_norm_()", "trace": "stage.gather_trace()"}
"""The call that collects under each name, for errors."""


def collect(
    stage: PipelineStage, name: str, value: Any, to: Collection[int], terms: Any = ()
) -> dict[int, Any]:
    """Send ``value`` to the ranks ``to``; there, every rank's value by rank; else ``{}``.

    Call it in every process at once, with the same ``name``, ``to`` and ``terms`` (the
    call's arguments that every process must agree on): every rank hears from every
    other, so each compares them, and all refuse a call made with different ones.

    Raises:
        RemoteError: another process failed or was lost.
        RuntimeError: another process made another call meanwhile (a step, on every
            rank), or this one with other ``to`` or ``terms``, or ended without its part.
    """
    from torchgpipe.distributed.schedule import join_step  # it builds on the stage

    got: dict[int, Any] = {}
    mine = (sorted(to), terms)
    exchange = stage.exchange()
    exchange.tag, exchange.call = name, CALLS.get(name, name)
    try:
        for peer in exchange.peers:
            exchange.send(peer, (name, stage.rank), (mine, value if peer in to else None))
        if not join_step(stage, exchange):
            # Not take(): a peer that ends without sending (it failed, or called another
            # method at this time) must not leave this one waiting.
            got = {peer: exchange.wait_for((name, peer), peer) for peer in exchange.peers}
    except Stopped:  # a peer is lost; close() names it
        pass
    finally:  # whatever happened: the next step needs the listeners
        exchange.close()
    failure = mismatch(exchange)
    if failure is not None:  # every rank sees every end: all fail alike
        stage.shapes.clear()  # a step's ranks forgot their layouts too (schedule.py)
        raise failure
    silent = sorted(peer for peer, part in got.items() if part is None)
    if silent:
        raise RuntimeError(
            f"rank {stage.rank} expected the {name} of ranks {silent}, which ended without "
            f"sending it (a process that calls another method of its stage meanwhile does "
            f"not take part): every process must make the same call at once"
        )
    other = {peer: part[0] for peer, part in got.items() if part[0] != mine}
    if other:
        said = ", ".join(f"rank {peer} with {_terms(*t)}" for peer, t in sorted(other.items()))
        raise RuntimeError(
            f"{exchange.call} was called with other arguments on other processes: "
            f"{said}, rank {stage.rank} with {_terms(*mine)}; call it with the same "
            f"arguments in every process"
        )
    if stage.rank not in to:
        return {}
    result = {peer: part[1] for peer, part in got.items()}
    result[stage.rank] = value
    return result


def _terms(to: list[int], terms: Any) -> str:
    return f"{terms}, results to ranks {to}" if terms != () else f"results to ranks {to}"


def terms_of(*args: Any) -> tuple[Any, ...]:
    """A call's arguments as processes compare them.

    Numbers by value (``1`` is ``1.0``, a 0-dim tensor its number, ``"inf"`` is
    ``math.inf``), the rest as written.
    """
    terms: list[Any] = []
    for arg in args:
        if isinstance(arg, bool):
            terms.append(arg)
            continue
        try:
            terms.append(float(arg))
        except (TypeError, ValueError, RuntimeError):
            terms.append(repr(arg))
    return tuple(terms)


def refuse(stage: PipelineStage, name: str, refused: BaseException) -> None:
    """Take part in a collect that this process refused its arguments for.

    The others then fail at once, naming arguments other than theirs, instead of
    waiting for this process; ``refused`` gets a note of what they were told.
    """
    try:
        collect(stage, name, None, [], ("refused", f"{type(refused).__name__}: {refused}"))
    except RuntimeError as told:
        add_note(refused, f"torchgpipe: the other processes were told: {told}")


def clip_across(
    stage: PipelineStage, ties: Ties, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """``stage.clip_grad_norm_``: one total norm over every process, each weight once.

    Arguments this process refuses are refused with every other process told (``refuse``),
    so none waits, and none clips by a norm without this process's part.
    """
    try:
        check_clip_arguments(max_norm, norm_type)
    except (TypeError, ValueError) as refused:
        refuse(stage, "norm", refused)
        raise
    terms = terms_of(max_norm, norm_type, error_if_nonfinite)
    ranks = range(stage.world_size)

    def gather(part: Tensor) -> list[Tensor]:
        return [part for _, part in sorted(collect(stage, "norm", part, ranks, terms).items())]

    every = list(stage.parameters())
    counted = counted_once(every, ties.groups, ties.ranks, stage.rank)
    return clip_grad_norm(
        counted, every, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, gather=gather
    )
