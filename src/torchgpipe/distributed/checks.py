"""What the processes of a pipeline compare at start, and the checks of their calls.

Every process builds the same ``nn.Sequential`` and ``PipelineStage``; at construction
each sends the others a fingerprint of what it was given (:func:`fingerprint`), and all
refuse to start, with the same message (:func:`differences`), when one differs. A
difference that slipped through would surface later as transfers that do not match,
or as a hang until the process group's timeout. The fingerprint holds the options,
each layer's type and tensor shapes, and the model's ties: which names hold one tensor
(``model[2].weight = model[0].weight``), since ties decide which transfers a step makes.

The same exchange carries a failure of a rank's own start (:func:`start_together`): a
``rank=`` or a balance that only it was given and cannot take (:func:`check_placement`),
a state dict without a key of its layers, a layer that cannot be moved to its device.
Such a failure may happen on one rank alone, after the others have built their
transports and wait for its fingerprint; it goes to them in its ``end`` in place of the
fingerprint, so they raise a :class:`~torchgpipe.distributed.RemoteError` that names it
at once, rather than when the failing process exits or the process group times out::

    rank 0                       rank 1 (its state dict lacks 2.weight)
    build its stage: fine        build its stage: ValueError
    hello(fingerprint) ────────▶ (left in its mailbox)
    take hello of 1 ◀─────────── end(failed: ValueError ...)
       Stopped                   wait for the others' ends
    end(failed) ───────────────▶ raise ValueError (its own)
    raise RemoteError("rank 1 (stages [1]) raised ValueError: ...")

The calls made later, each in every process at once (a step, ``clip_grad_norm_``), are
checked by their exchange's ends: each names its rank's call, and a rank that sees
another call than its own raises :func:`mismatch`, as every other rank does. A step's
start tells the others how rank 0 runs it, which each compares with its own
(:func:`agree_with_start`): a forward only or a step, the table, the reduction of the
loss. Not the layers' ``train()``/``eval()`` modes: a stage may hold layers in either
on purpose (a frozen backbone's batch norm), and only each process sees its own.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from torchgpipe.balance.blockpartition import whole_number
from torchgpipe.distributed.channel import Transport
from torchgpipe.distributed.errors import RemoteError, describe
from torchgpipe.distributed.exchange import Exchange
from torchgpipe.distributed.transport import ProcessGroupTransport, TransportError
from torchgpipe.mailbox import Stopped

__all__ = [
    "check_placement",
    "check_rank",
    "connect",
    "differences",
    "fingerprint",
    "mismatch",
    "other_calls",
    "start_together",
]


def connect(group: Any, device: torch.device | None, partitions: int) -> ProcessGroupTransport:
    """This process's transport on ``group`` (``None``: every process).

    Raises:
        RemoteError: another rank cannot be reached: it failed before building its
            stage (a bad argument), or died. Named with its stages where the transport
            knows which it is (``ProcessGroupTransport`` greets every rank first).
    """
    try:
        return ProcessGroupTransport(group, device=device)
    except TransportError as error:
        peer = error.peer
        world = torch.distributed.get_world_size(group)
        stages = tuple(range(peer, partitions, world)) if peer >= 0 else ()
        raise RemoteError(str(error), rank=peer, stages=stages) from error


def fingerprint(module: nn.Sequential, options: Mapping[str, Any]) -> dict[str, Any]:
    """What a process was given: ``options``, each layer's tensors, and the ties.

    A layer reads as its class, the classes of the modules inside it (a ``Tanh`` in
    one process where another has a ``ReLU`` holds no tensor that would differ), and
    its tensors' shapes and dtypes.
    """
    layers = []
    for name, layer in module.named_children():
        params = ", ".join(
            f"{key} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for key, t in [*layer.named_parameters(), *layer.named_buffers()]
        )
        inside = ", ".join(f"{n}: {type(m).__qualname__}" for n, m in layer.named_modules() if n)
        kinds = f" [{inside}]" if inside else ""
        layers.append(f"{name}: {type(layer).__qualname__}{kinds}({params})")
    return {**options, "layers": layers, "ties": _ties(module)}


_WORD = "word"  # a rank's random word in its fingerprint: the pipeline's name


# This process's stages by the name of their pipeline and their rank (start_together;
# the rank too: the ranks of a test double are threads of one process).
PIPELINES: weakref.WeakValueDictionary[tuple[str, int], Any] = weakref.WeakValueDictionary()


class CrossedPipelines(ValueError):
    """Rank 0 started a call of another pipeline's stages than those this rank called."""


def start_together(
    exchange: Exchange, outcome: dict[str, Any] | Exception, stage: nn.Module
) -> str:
    """Tell every other rank how this rank's start went, and learn how theirs went.

    Every rank calls it once, on a fresh ``exchange``, with the ``outcome`` of its own
    start: its fingerprint, or the exception that stopped it. The exchange is ended in
    either case, so each rank learns of a failure anywhere as soon as it happened.
    Returns the pipeline's name, the same on its ranks and no other pipeline's: made of
    a random word from each rank, so that two pipelines of one model on one group (a
    teacher and a student) are told apart at each step's start (:func:`crossed`);
    ``stage`` is kept under it in :data:`PIPELINES` (this process's, weakly).

    Raises:
        Exception: ``outcome``, this rank's own failure, once every other rank was told.
        RemoteError: another rank failed to start, or was lost.
        ValueError: the ranks were given different models or arguments; every rank
            raises it with the same message.
    """
    rank = exchange.rank
    exchange.tag, exchange.call = "hello", "PipelineStage()"
    if isinstance(outcome, Exception):
        status = describe(outcome, None, rank, exchange.stages[rank], None)
        status["where"] = " while building its PipelineStage"
        exchange.finish({"failed": True, "error": status}, [])  # waits for their ends
        raise outcome
    outcome = {**outcome, _WORD: secrets.token_hex(8)}  # not torch's generators: no draw
    prints = {rank: outcome}
    try:
        for peer in exchange.peers:
            exchange.send(peer, ("hello", rank), outcome)
        for peer in exchange.peers:
            prints[peer] = exchange.take(("hello", peer))
    except Stopped:  # a peer failed or is lost; close() names it
        pass
    exchange.close()
    problems = differences(prints)
    if problems:
        raise ValueError(
            f"the {len(exchange.peers) + 1} processes of the pipeline were not given the "
            f"same model and arguments: {'; '.join(problems)}; build the same "
            f"nn.Sequential and PipelineStage in every process"
        )
    name = "".join(prints[r][_WORD] for r in sorted(prints))
    PIPELINES[name, rank] = stage
    return name


def _ties(module: nn.Sequential) -> list[str]:
    """Each name that holds a tensor an earlier name holds: ``'2.weight is 0.weight'``."""
    first: dict[int, str] = {}
    ties = []
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        earlier = first.setdefault(id(tensor), name)
        if earlier != name:
            ties.append(f"{name} is {earlier}")
    return ties


def differences(prints: dict[int, dict[str, Any]]) -> list[str]:
    """Every way in which a rank's fingerprint differs from rank 0's, in one list."""
    base = prints[0]
    problems = []
    for rank in sorted(prints):
        if rank == 0:
            continue
        for field, value in prints[rank].items():
            if value == base.get(field) or field == _WORD:
                continue
            if field == "layers":
                problems.append(_layer_difference(base[field], value, rank))
            elif field == "ties":
                problems.append(_tie_difference(base[field], value, rank))
            else:
                problems.append(
                    f"{field} is {base.get(field)!r} on rank 0 but {value!r} on rank {rank}"
                )
    return problems


def _layer_difference(base: list[str], other: list[str], rank: int) -> str:
    if len(base) != len(other):
        return f"the model has {len(base)} layers on rank 0 but {len(other)} on rank {rank}"
    k = next(k for k, (a, b) in enumerate(zip(base, other, strict=True)) if a != b)
    return f"layer {k} is {base[k]} on rank 0 but {other[k]} on rank {rank}"


def _tie_difference(base: list[str], other: list[str], rank: int) -> str:
    parts = []
    only_base = [tie for tie in base if tie not in other]
    only_other = [tie for tie in other if tie not in base]
    if only_base:
        parts.append(f"on rank 0 but not on rank {rank}: {', '.join(only_base)}")
    if only_other:
        parts.append(f"on rank {rank} but not on rank 0: {', '.join(only_other)}")
    return f"the model's tied tensors differ, {'; '.join(parts)}"


def check_placement(given: int | None, rank: int, world_size: int, partitions: int) -> None:
    """Refuse a ``rank=`` other than this process's, or partitions the ranks cannot share.

    A process may be given these alone, so ``PipelineStage`` checks them as part of its
    own start, whose failure every other process hears of (:func:`start_together`).

    Raises:
        ValueError: ``given`` is neither None nor ``rank``; or ``partitions`` is not a
            multiple of ``world_size``.
    """
    if given is not None and given != rank:
        raise ValueError(
            f"rank={given} was given, but this process is rank {rank} of the "
            f"pipeline's {world_size}; pass rank=None, or the group's rank"
        )
    if partitions % world_size:
        raise ValueError(
            f"the balance has {partitions} partitions for {world_size} processes; give "
            f"every process the same number of stages: {world_size} partitions, "
            f"or a multiple of it for interleaving"
        )


def check_rank(dst: object, world_size: int, what: str) -> int:
    """``dst``, a rank of the pipeline's ``world_size`` processes, or a clear error.

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is out of range.
    """
    try:  # a NumPy integer too
        dst = whole_number(dst, what)
    except TypeError:
        raise TypeError(f"{what} must be a rank (an int), got {dst!r}") from None
    if not 0 <= dst < world_size:
        raise ValueError(
            f"{what}={dst} is not a rank of the pipeline's {world_size} processes; pass "
            f"a rank from 0 to {world_size - 1}"
        )
    return dst


def other_calls(exchange: Exchange) -> str:
    """Which other calls the peers made, as their ends said; '' if none did.

    ``'rank 1 called stage.clip_grad_norm_() while this process called schedule.step()'``
    """
    others = exchange.other_calls()
    if not others:
        return ""
    said = ", ".join(f"rank {peer} called {call}" for peer, call in others.items())
    return f"{said} while this process called {exchange.call}"


def mismatch(exchange: Exchange) -> RuntimeError | None:
    """The error of a call that other processes did not make at the same time; or None.

    Each rank raises it, naming the others' calls. Every rank took part in the transfers
    it owed before the exchange ended: the next call made in every process runs as usual.
    """
    said = other_calls(exchange)
    if not said:
        return None
    return RuntimeError(
        f"{said}: every process must make the same call at once (the next call that "
        f"every process makes runs as usual)"
    )


def crossed(rank: int, transport: Transport, *, followed: bool) -> NoReturn:
    """Refuse a start of rank 0's that names another pipeline than this rank's stage.

    Two pipelines built on one process group (a teacher's and a student's stages),
    called crosswise. Where this process holds a stage of the pipeline rank 0 started
    (``followed``), it took part in the step's transfers with that stage (each rank of
    a failed step forgets its remembered layouts there, not in the stage called here).
    Otherwise rank 0 issued transfers that this rank cannot know the sizes of, so the
    group's channels are out of step: the transport refuses every later call
    (:meth:`Transport.abandon`), and the other ranks', told at the step's end, too.

    Raises:
        CrossedPipelines: always, saying so.
    """
    why = (
        f"rank 0 started a call of another pipeline's stages than the ones rank {rank} "
        f"called (two pipelines on one process group, called crosswise)"
    )
    if followed:
        raise CrossedPipelines(
            f"{why}; call the stages of one pipeline together, in the same order in every process"
        )
    transport.abandon(why)
    raise CrossedPipelines(
        f"{why}, which this process does not hold; the group's channels are out of step "
        f"now: start every process anew"
    )


def agree_with_start(
    rank: int,
    m: int,
    first: tuple[bool, str, str],
    mine: tuple[bool, str, str],
) -> None:
    """Refuse a step of ``m`` micro-batches that rank 0 started otherwise than this rank.

    ``first`` and ``mine``: rank 0's and this rank's (forward only, the table's text,
    the loss's reduction).

    Raises:
        ValueError: naming what differs and how to make it agree.
    """
    (forward_only, text, reduction) = first
    if forward_only != mine[0]:
        calls = ("forward_only", "step")
        said, called = calls if forward_only else calls[::-1]
        raise ValueError(
            f"rank 0 runs schedule.{said}() but rank {rank} runs schedule.{called}(); "
            f"call the same one in every process"
        )
    if text != mine[1]:
        raise ValueError(
            f"rank {rank} follows a different schedule from rank 0 (for {m} micro-batches); "
            f"build the same schedule in every process"
        )
    if not forward_only and reduction != mine[2]:
        raise ValueError(
            f"rank 0's schedule was built with reduction={reduction!r} but rank {rank}'s "
            f"with reduction={mine[2]!r}, and the ranks would report different losses; "
            f"build every process's schedule with the same reduction"
        )
