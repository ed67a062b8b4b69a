"""Values brought together from every process outside a step: traces, norm parts.

The stage's exchange carries them on the side channel, as it carries a step's start:
each rank sends its value to the ranks that want it (and None to the others: every
peer hears of the call), and those take one from every peer. Closing the exchange tells
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

from torchgpipe.distributed.checks import mismatch, other_calls
from torchgpipe.mailbox import Stopped

if TYPE_CHECKING:
    from torchgpipe.distributed.stage import PipelineStage

__all__ = ["collect"]

CALLS = {"norm": "stage.clip_grad_norm_()", "trace": "stage.gather_trace()"}
"""The call that collects under each name, for errors."""


def collect(stage: PipelineStage, name: str, value: Any, to: Collection[int]) -> dict[int, Any]:
    """Send ``value`` to the ranks ``to``; there, every rank's value by rank; else ``{}``.

    Call it in every process at once, with the same ``name`` and ``to``.

    Raises:
        RemoteError: another process failed or was lost.
        RuntimeError: rank 0 started a step meanwhile (on every rank), or a rank of
            ``to`` did not get the part of a peer that made another call.
    """
    from torchgpipe.distributed.schedule import join_step  # it builds on the stage

    got: dict[int, Any] = {}
    exchange = stage.exchange()
    exchange.tag, exchange.call = name, CALLS.get(name, name)
    try:
        for peer in exchange.peers:
            exchange.send(peer, (name, stage.rank), value if peer in to else None)
        if not join_step(stage, exchange) and stage.rank in to:
            # Not take(): a peer that ends without sending (it failed, or called another
            # method at this time) must not leave this one waiting.
            got = {peer: exchange.wait_for((name, peer), peer) for peer in exchange.peers}
    except Stopped:  # a peer is lost; close() names it
        pass
    finally:  # whatever happened: the next step needs the listeners
        exchange.close()
    failure = mismatch(exchange)
    if exchange.halted and failure is not None:  # a step met this call: every rank fails
        raise failure
    if stage.rank not in to:
        return {}
    silent = sorted(peer for peer, part in got.items() if part is None)
    if silent:
        why = other_calls(exchange) or (
            "a process that calls another method of its stage meanwhile does not take part"
        )
        raise RuntimeError(
            f"rank {stage.rank} expected the {name} of ranks {silent}, which ended without "
            f"sending it ({why}): every process must make the same call at once"
        )
    got[stage.rank] = value
    return got
