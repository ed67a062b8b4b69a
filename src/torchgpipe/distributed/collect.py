"""Values brought together from every process outside a step: traces, norm parts.

The stage's exchange carries them on the side channel, as it carries a step's start:
each rank sends its value to the ranks that want it, and those take one from every
peer. Closing the exchange tells every rank whether another failed or was lost, so a
rank that fails to take part fails every other rank too, naming it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from torchgpipe.mailbox import Stopped

if TYPE_CHECKING:
    from torchgpipe.distributed.stage import PipelineStage

__all__ = ["collect"]


def collect(stage: PipelineStage, name: str, value: Any, to: Collection[int]) -> dict[int, Any]:
    """Send ``value`` to the ranks ``to``; there, every rank's value by rank; else ``{}``.

    Call it in every process at once, with the same ``name`` and ``to``.

    Raises:
        RemoteError: another process failed or was lost.
    """
    got: dict[int, Any] = {}
    exchange = stage.exchange()
    try:
        for peer in to:
            if peer != stage.rank:
                exchange.send(peer, (name, stage.rank), value)
        if stage.rank in to:
            # Not take(): a peer that ends without sending (it failed, or called another
            # method at this time) must not leave this one waiting.
            got = {peer: exchange.wait_for((name, peer), peer) for peer in exchange.peers}
    except Stopped:  # a peer is lost; close() names it
        pass
    finally:  # whatever happened: the next step needs the listeners
        exchange.close()
    if stage.rank not in to:
        return {}
    silent = sorted(peer for peer, part in got.items() if part is None)
    if silent:
        raise RuntimeError(
            f"rank {stage.rank} expected the {name} of ranks {silent}, which ended without "
            f"sending it: every process must make the same call at once (a process that "
            f"calls another method of its stage meanwhile does not take part)"
        )
    got[stage.rank] = value
    return got
