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

from torchgpipe.clip import check_clip_arguments, clip_by, counted_once, norm_part
from torchgpipe.distributed.checks import mismatch
from torchgpipe.distributed.errors import describe
from torchgpipe.mailbox import Stopped, add_note

if TYPE_CHECKING:
    from torch import Tensor

    from torchgpipe.distributed.stage import PipelineStage
    from torchgpipe.tied import Ties

__all__ = ["clip_across", "collect", "fail", "refuse", "terms_of"]

CALLS = {"norm": "stage.clip_grad_norm_()", "trace": "stage.gather_trace()"}
"""The call that collects under each name, for errors."""


def collect(
    stage: PipelineStage,
    name: str,
    value: Any,
    to: Collection[int],
    terms: Any = (),
    *,
    failed: Exception | None = None,
) -> dict[int, Any]:
    """Send ``value`` to the ranks ``to``; there, every rank's value by rank; else ``{}``.

    Call it in every process at once, with the same ``name``, ``to`` and ``terms`` (the
    call's arguments that every process must agree on): every rank hears from every
    other, so each compares them, and all refuse a call made with different ones.
    ``failed``: this process's own failure, before it had a value (:func:`fail`): it
    sends none, and ends at once with that error, as it does where it fails to send.

    Raises:
        Exception: this process's own failure to send, once every other process was
            told (they raise ``RemoteError`` naming it, at once).
        RemoteError: another process failed or was lost.
        RuntimeError: another process made another call meanwhile (a step, on every
            rank), or this one with other ``to`` or ``terms``, or ended without its part.
    """
    from torchgpipe.distributed.schedule import join_step  # it builds on the stage

    got: dict[int, Any] = {}
    mine = (sorted(to), terms)
    exchange = stage.exchange()
    exchange.tag, exchange.call = name, CALLS.get(name, name)
    error = failed
    try:
        if error is None:
            for peer in exchange.peers:
                exchange.send(peer, (name, stage.rank), (mine, value if peer in to else None))
        # Not take(): a peer that ends without sending (it failed, or called another
        # method at this time) must not leave this one waiting.
        if not join_step(stage, exchange) and error is None:
            got = {peer: exchange.wait_for((name, peer), peer) for peer in exchange.peers}
    except Stopped:  # a peer is lost; close() names it
        pass
    except Exception as own:
        error = own
    finally:  # whatever happened: the next step needs the listeners
        if error is None:
            exchange.close()
        else:  # this process's end tells the others of its failure, which they raise
            status = describe(error, None, stage.rank, stage.stages, None)
            status["where"] = f" in {exchange.call}"
            exchange.finish({"failed": True, "error": status}, [])
    if error is not None:
        note = f"raised on rank {stage.rank} in {exchange.call}; the other ranks are told"
        add_note(error, f"torchgpipe: {note} (in that call, they raise RemoteError)")
        if error is not failed:
            raise error
        return {}
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


def fail(stage: PipelineStage, name: str, failed: Exception) -> None:
    """Take part in a collect that this process failed to compute its value for.

    The others raise ``RemoteError`` at once, naming this rank and ``failed`` (which
    gets a note that says so), instead of waiting for this process until the process
    group's timeout. The caller raises ``failed`` then.
    """
    collect(stage, name, None, [], failed=failed)


def clip_across(
    stage: PipelineStage,
    ties: Ties,
    max_norm: float,
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None = None,
) -> Tensor:
    """``stage.clip_grad_norm_``: one total norm over every process, each weight once.

    Arguments this process refuses are refused with every other process told (``refuse``),
    and so is a failure to compute this process's part of the norm (``fail``: a sparse
    gradient, say, whose norm torch cannot take): none waits, and none clips by a norm
    without this process's part. ``foreach`` changes nothing (``clip.clip_grad_norm``).
    """
    del foreach  # as torch's clip takes it: see clip.clip_grad_norm
    try:
        limit, order = check_clip_arguments(max_norm, norm_type)
    except (TypeError, ValueError) as refused:
        refuse(stage, "norm", refused)
        raise
    terms = terms_of(max_norm, norm_type, error_if_nonfinite)
    every = list(stage.parameters())
    try:
        counted = counted_once(every, ties.groups, ties.ranks, stage.rank)
        part = norm_part([p.grad for p in counted if p.grad is not None], order)
    except Exception as failed:
        fail(stage, "norm", failed)
        raise
    parts = collect(stage, "norm", part, range(stage.world_size), terms)
    return clip_by(
        [parts[r] for r in sorted(parts)],
        every,
        limit,
        order,
        error_if_nonfinite=error_if_nonfinite,
    )
