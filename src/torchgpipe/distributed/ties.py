"""Weights tied across processes: which ranks hold each, and their sums over the wire.

A parameter that layers of two stages use (a language model's token embedding and its
output head) lives in each process that runs one of those stages. Every process sees
the whole model, so each works out the same groups (:func:`tied_ranks`): the ranks
holding a tied parameter, in the order the model first uses it there, the first its
owner: the rank of its first holder, which is the one a meta model must fill
(``materialize.py``; the later holders take its values). Inside a process the partitions
share copies as ``GPipe``'s do (``torchgpipe/tied.py``); between processes,
:class:`AcrossRanks` moves them:

- at the start, the owner's values go to the other holders (a model filled on each
  rank by its modules' own ``reset_parameters`` starts with different values);
- after each step, each holder sends the owner what its backward added to the weight;
  the owner adds it all to its gradient and sends the sum back. Every tensor this
  needs is made before the step's end (``Ties.prepare``): a process short of memory
  fails the step on every rank, rather than leave its peers' transfers unmatched.

The transfers are the transport's own (``Transport.issue``), on the pipeline's group,
from the thread that runs the step, group by group in the order :func:`tied_ranks`
gives them, which walks the whole model and so is the same on every rank: every pair
of ranks issues them in matching order, as NCCL requires (``tests/nccl_rules.py``
checks it). Only the ranks of a group take part in its transfers. A tied weight frozen
(``requires_grad`` off) in every process that holds it moves nothing: each rank's end of
the step names the groups it froze (:func:`frozen_everywhere`), and every holder sees
every end before the sums. Where the holders disagree, the transfers go as for any
weight, a frozen copy's part zeros, and a frozen copy takes no gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torchgpipe.distributed import exchange
from torchgpipe.distributed.channel import Transfer, Transport, TransportError, wait_apart
from torchgpipe.distributed.wire import tensor_bytes
from torchgpipe.tied import Ties

__all__ = ["AcrossRanks", "frozen_everywhere", "tied_ranks", "unlike_dtypes"]


def tied_ranks(
    partitions: Sequence[Sequence[nn.Module]], placement: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    """For each parameter used by stages on two ranks or more: ``id`` to those ranks.

    The ranks in the order of their stages' first use of it (an interleaved schedule can
    put a later stage on a lower rank), so the first is its first holder's, its owner.
    ``partitions`` holds every stage's layers (of the whole model, as every process has
    it), ``placement`` each stage's rank.
    """
    ranks: dict[int, list[int]] = {}
    for layers, rank in zip(partitions, placement, strict=True):
        for layer in layers:
            for parameter in layer.parameters():
                held = ranks.setdefault(id(parameter), [])
                if rank not in held:
                    held.append(rank)
    return {key: tuple(held) for key, held in ranks.items() if len(held) > 1}


def frozen_everywhere(
    sums: Sequence[Any], ranks: Sequence[tuple[int, ...] | None], rank: int, ends: Mapping[int, Any]
) -> set[int]:
    """The groups of ``sums`` (``Ties.prepare``'s) that every process holding them froze.

    ``ranks``: each group's holders (``Ties.ranks``); ``ends``: each peer's end of the
    step, (status, tensors), whose status names the groups that peer froze (``frozen``).
    """
    said = {peer: set(status.get("frozen", ())) for peer, (status, _) in ends.items()}
    return {
        s.group
        for s in sums
        if s.frozen is not None
        and all(s.frozen in said.get(peer, ()) for peer in ranks[s.group] or () if peer != rank)
    }


def unlike_dtypes(sums: Sequence[Any], rank: int, ends: Mapping[int, Any]) -> None:
    """Refuse the sums when a tied weight's copies have other dtypes on other ranks.

    Its gradients travel as bytes: a copy converted on one rank alone (``stage.half()``
    here, ``.bfloat16()`` there) would read another's bytes as its own dtype, or, of
    another size, end a process in gloo. Each end of the step names the dtype of each
    weight its rank holds with others (``tie_dtypes``); every rank reads every end, so
    every rank refuses alike, before any transfer, holder of that weight or not.

    Raises:
        TypeError: the copies of a tied weight differ in dtype between ranks.
    """
    said: dict[str, dict[int, Any]] = {}
    for s in sums:
        if s.held is not None:
            said.setdefault(s.held[0], {})[rank] = s.held[1]
    for peer, (status, _) in ends.items():
        for name, dtype in status.get("tie_dtypes", {}).items():
            said.setdefault(name, {})[peer] = dtype
    for name, by_rank in said.items():
        if len(set(by_rank.values())) > 1:
            each = ", ".join(f"rank {r}: {d}" for r, d in sorted(by_rank.items()))
            raise TypeError(
                f"torchgpipe: the copies of the tied weight {name} have other dtypes on "
                f"the ranks that hold it ({each}); convert the stages alike in every "
                f"process (stage.half() in each), and load a checkpoint to make them one"
            )


class AcrossRanks:
    """The transfers that keep the tied parameters of a process equal to the others'."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def align(self, ties: Ties) -> None:
        """Give every holder the owner's values of each group held by several processes."""
        with torch.no_grad():
            for group, ranks in zip(ties.groups, ties.ranks, strict=True):
                if ranks is not None:
                    group[0].copy_(self._from_owner(ranks, group[0]))
        ties.align()  # and from this process's owner to its own copies

    def __call__(self, ranks: tuple[int, ...], grad: Tensor, mine: Tensor) -> Callable[[], Tensor]:
        """The sum of the owner's ``grad`` and every other holder's ``mine`` (``tied.Across``).

        Every buffer is made here; the call returned does the transfers and writes only
        into them (and into ``grad``, on the owner): nothing there can run short of memory.
        """
        owner, me = ranks[0], self.transport.rank
        landing = None if grad.device == self.transport.wire else torch.empty_like(grad)
        if me != owner:
            wire, buffer = self._wire(mine), self._buffer(grad)

            def holder() -> Tensor:
                self._wait([Transfer("send", owner, wire)])
                self._wait([Transfer("recv", owner, buffer)])
                return self._tensor(buffer, grad, landing)

            return holder
        buffers = [self._buffer(grad) for _ in ranks[1:]]
        inline = landing is None and grad.is_contiguous()  # its bytes a view of it
        wire_at = self.transport.wire
        # Contiguous: the bytes sent are its own, not a copy made here (of nothing yet).
        staged = grad if inline else torch.empty(grad.shape, dtype=grad.dtype, device=wire_at)
        back = tensor_bytes(staged)

        def owner_sum() -> Tensor:
            self._wait(
                [Transfer("recv", peer, b) for peer, b in zip(ranks[1:], buffers, strict=True)]
            )
            for buffer in buffers:
                grad.add_(self._tensor(buffer, grad, landing))
            if not inline:
                staged.copy_(grad)
            self._wait([Transfer("send", peer, back) for peer in ranks[1:]])
            return grad

        return owner_sum

    def _from_owner(self, ranks: tuple[int, ...], value: Tensor) -> Tensor:
        """The owner's ``value``, in every process of ``ranks``."""
        owner, me = ranks[0], self.transport.rank
        if me == owner:
            wire = self._wire(value)
            self._wait([Transfer("send", peer, wire) for peer in ranks[1:]])
            return value
        buffer = self._buffer(value)
        self._wait([Transfer("recv", owner, buffer)])
        return self._tensor(buffer, value)

    def _wait(self, transfers: list[Transfer]) -> None:
        """Issue ``transfers``, wait for each; after a failure, the rest a while more.

        A dead holder fails its own transfer alone: the others still go to the live
        holders (:func:`~torchgpipe.distributed.channel.wait_apart`), which would
        otherwise wait on this rank until the group's timeout, then name it, not the dead.

        Raises:
            TransportError: a transfer's peer cannot be reached.
        """
        buffers = [t.buffer for t in transfers]
        try:
            pending = self.transport.issue(transfers)
        except TransportError as error:
            wait_apart([work for _, work in error.started], exchange.LOST_GRACE, keep=buffers)
            raise
        for k, work in enumerate(pending):
            try:
                work.wait()
            except TransportError:
                wait_apart(pending[k + 1 :], exchange.LOST_GRACE, keep=buffers)
                raise

    def _wire(self, value: Tensor) -> Tensor:
        """``value``'s bytes, flat, on the wire."""
        return tensor_bytes(value.detach().to(self.transport.wire))

    def _buffer(self, like: Tensor) -> Tensor:
        nbytes = like.numel() * like.element_size()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.transport.wire)

    @staticmethod
    def _tensor(buffer: Tensor, like: Tensor, landing: Tensor | None = None) -> Tensor:
        """The bytes of ``buffer`` as a tensor shaped as ``like``, on its device.

        Copied into ``landing`` where one is given (``buffer`` is on another device).
        """
        value = buffer.view(like.dtype).reshape(like.shape)
        return value.to(like.device) if landing is None else landing.copy_(value)
