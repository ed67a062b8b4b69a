"""What the schedules of one process and of several share: the loss, its weights, the table."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from torchgpipe.mailbox import add_note
from torchgpipe.microbatch import Batched, flatten, scatter
from torchgpipe.schedules import Action, Schedule

__all__ = [
    "LossFn",
    "Reduction",
    "StepResult",
    "TableFor",
    "TableSteps",
    "batch_size",
    "loss_weights",
    "micro_batches",
    "one_number",
    "refuse_cached_parametrizations",
    "untrained",
    "weighted",
]


Reduction: TypeAlias = Literal["mean", "sum"]
"""How the micro-batches' losses make the batch's: weighted by size, or summed."""

LossFn: TypeAlias = Callable[[Any, Any], Tensor]
TableFor: TypeAlias = Callable[[int], Schedule]


@dataclass(frozen=True)
class StepResult:
    """What one training step gives back.

    ``loss`` is the batch's loss as ``loss_fn(model(input), target)`` would give it
    (under the step's reduction), ``losses`` each micro-batch's ``loss_fn`` value,
    ``output`` the model's output gathered from the micro-batches (a 0-dim tensor in
    it as one value per micro-batch, stacked), all detached.
    ``peak_held[s]`` is the most micro-batches whose activations (or, when
    checkpointed, inputs) stage ``s`` held at once during the step.
    """

    loss: Tensor
    losses: list[Tensor]
    output: Any
    peak_held: tuple[int, ...]


class TableSteps:
    """What the schedules of one process and of several share: the loss, the table."""

    loss_fn: LossFn
    reduction: Reduction
    _table: Schedule | TableFor

    def _adopt(self, loss_fn: LossFn, table: Schedule | TableFor, reduction: Reduction) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        said = getattr(loss_fn, "reduction", None)  # as torch.nn's losses say how they reduce
        if said in ("mean", "sum") and said != reduction:
            raise ValueError(
                f"loss_fn reduces by {said!r} (its reduction) but the schedule by "
                f"{reduction!r}, which would weigh the micro-batches' losses wrongly; pass "
                f"reduction={said!r} to the schedule"
            )
        self.loss_fn = loss_fn
        self.reduction = reduction
        self._table = table
        self._checked: dict[int, Schedule] = {}  # per m: the table, once checked
        self._forward: dict[int, Schedule] = {}  # per m: a forward-only step's own table
        if isinstance(table, Schedule):
            self._check_table(table, table.micro_batches)
            self._checked[table.micro_batches] = table

    def table(self, m: int, chunks: int | None = None) -> Schedule:
        """The schedule of a step with ``m`` micro-batches, checked against the stages.

        A table is checked (a dry run: ``Schedule.validate``) the first time a step has
        ``m`` micro-batches, and kept for the next steps of ``m``. ``chunks``: the
        pipeline's, to say whether a short batch made ``m`` where the table refuses it.

        Raises:
            ValueError: the table does not fit the stages or ``m``.
            ScheduleError: the table is not valid.
        """
        table = self._checked.get(m)
        if table is None:
            try:
                table = self._table if isinstance(self._table, Schedule) else self._table(m)
            except ValueError as error:
                if chunks is not None and m >= chunks:
                    raise  # not a short batch: the error says what does not fit
                add_note(
                    error,
                    f"torchgpipe: this step's batch made m = {m} micro-batches (a batch of "
                    f"fewer samples than chunks makes one per sample); give every step at "
                    f"least chunks samples, e.g. DataLoader(..., drop_last=True) with a "
                    f"batch size of chunks or more",
                )
                raise
            self._check_table(table, m)
            self._checked[m] = table
        return table

    def forward_table(self, m: int, stages: int, ranks: int) -> Schedule:
        """The table of a forward-only step of ``m`` micro-batches on ``ranks`` ranks.

        :meth:`table`'s, or where the schedule makes none for ``m`` (interleaving takes
        micro-batches in groups of the ranks: the short last batch of a validation set),
        each rank's forwards one stage after the other, stage ``s`` on rank ``s % ranks``
        as in every schedule across processes (and the backwards, which it skips).

        Raises:
            ValueError: the table does not fit the stages or ``m``.
        """
        try:
            return self.table(m)
        except ValueError:
            table = self._forward.get(m)
            if table is None:
                mine = [range(r, stages, ranks) for r in range(ranks)]
                table = Schedule(stages, m, tuple(
                    tuple(Action(s, "F", i) for s in own for i in range(m))
                    + tuple(Action(s, "B", i) for s in reversed(own) for i in reversed(range(m)))
                    for own in mine
                ))  # fmt: skip
                self._check_table(table, m)  # which refuses what the stages refuse
                self._forward[m] = table
            return table

    def _check_table(self, table: Schedule, m: int) -> None:
        raise NotImplementedError


def weighted(weights: Sequence[float], losses: Sequence[Tensor]) -> Tensor:
    """The batch's loss: each micro-batch's weighed by its share (or summed)."""
    return torch.stack([w * x for w, x in zip(weights, losses, strict=True)]).sum()


def loss_weights(sizes: Sequence[int], reduction: Reduction) -> list[float]:
    """Each micro-batch's weight in the batch's loss: its share of samples, or 1."""
    total = sum(sizes)
    return [b / total if reduction == "mean" else 1.0 for b in sizes]


def batch_size(value: Any) -> int:
    """The number of samples of a micro-batch: its first tensor's first dimension."""
    for leaf in flatten(value)[0]:
        if isinstance(leaf, Tensor):
            return int(leaf.shape[0])
    raise TypeError("a micro-batch without tensors")  # scatter() rejects such batches


def one_number(loss: Any, targets: Sequence[Any] = ()) -> Tensor:
    """The value of ``loss_fn``, refused unless it is one number; as a 0-dim tensor.

    ``targets`` are the step's micro-batches' targets: where there are several and each
    holds one sample, a loss with a dimension is refused as one loss per sample.

    Raises:
        TypeError: ``loss`` is not a tensor of one element, is complex, or is a loss
            per sample.
    """
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        advice = (  # a dict or tuple of loss terms, or a loss per sample
            "return their sum (auxiliary losses added in) as one tensor"
            if isinstance(loss, (dict, tuple, list))
            else "use a reduction of 'mean' or 'sum' in the loss"
        )
        raise TypeError(
            f"loss_fn must return a tensor with one element, got "
            f"{type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)}"
            f"; {advice}"
        )
    if loss.is_complex():  # the plain model's loss.backward() refuses it too
        raise TypeError(
            f"loss_fn returned a {loss.dtype} loss, but a backward starts from a real "
            f"one; return a real number (loss.abs(), loss.real)"
        )
    # A loss per sample (reduction='none') has one element for a micro-batch of one
    # sample, and would pass for the micro-batch's loss: the step would weigh and add
    # them up, where the plain model's loss.backward() refuses the batch's elements
    # (torch makes the gradient of one element only). A micro-batch of more samples
    # shows it (more elements, refused above), so only where every micro-batch has one
    # sample is a loss of shape (1,) in doubt: refused then, as the plain model refuses
    # a batch of more than one. Elsewhere shape (1,) is a reduced loss and passes.
    if loss.dim() > 0 and len(targets) > 1 and all(batch_size(t) == 1 for t in targets):
        raise TypeError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)} for micro-batches of "
            f"1 sample each: a loss per sample (reduction='none'), which the plain model's "
            f"loss.backward() refuses for a batch of more than one sample (it needs one "
            f"element); use a reduction of 'mean' or 'sum' in the loss, or return a loss "
            f"that is reduced already as a 0-dim tensor (loss.reshape(()))"
        )
    return loss.reshape(())


def untrained(count: int, m: int, *, wanted: bool) -> None:
    """Refuse a step whose ``m`` losses all came out not requiring grad (``count``).

    The step would train nothing, where the plain model's ``loss.backward()`` raises.
    ``wanted``: some came from outputs that require grad (``loss_fn`` cut them off).
    One micro-batch's loss alone may be a constant (a masked loss with nothing left).

    Raises:
        RuntimeError: ``count == m``.
    """
    if count == m and wanted:
        raise RuntimeError(
            "loss_fn returned a loss that does not require grad for every micro-batch, "
            "from outputs that do: the step would train nothing. Compute the loss from "
            "the output itself (no .detach(), .item() or torch.no_grad() in loss_fn)"
        )
    if count == m:
        raise RuntimeError(
            "nothing in the step wants a gradient (every parameter frozen, and an input "
            "that wants none): the step would train nothing, where the plain model's "
            "loss.backward() raises. Unfreeze a parameter, or call "
            "schedule.forward_only(input) for the output alone"
        )


def refuse_inference_mode(call: str) -> None:
    """Refuse a step under ``torch.inference_mode()``, which no gradient escapes.

    A step records gradients even under ``torch.no_grad()``; inference mode forbids
    it, and across processes a stage would send tensors that want no gradient and
    train nothing before it, silently.

    Raises:
        RuntimeError: inference mode is on.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{call} runs under torch.inference_mode(), where no gradient can be "
            f"recorded, but a step trains; leave inference mode for it, or call "
            f"schedule.forward_only(input) for a forward without gradients"
        )


def refuse_cached_parametrizations(partitions: Iterable[nn.Module], graphs: bool) -> None:
    """Refuse a run that records graphs (``graphs``) under ``parametrize.cached()``.

    Its cache is one for every thread and every micro-batch: a checkpointed cell's
    forward, which records no graph, would leave each parametrized weight there without
    one, for the later cells and recomputations to read (their gradients missing those
    weights, silently); and a weight cached with its graph would be one graph that every
    micro-batch's backward walks, which the first frees.

    Raises:
        RuntimeError: the cache is on, graphs are recorded, and a layer is parametrized.
    """
    cached = bool(getattr(parametrize, "_cache_enabled", 0)) and graphs
    if cached and any(parametrize.is_parametrized(m) for p in partitions for m in p.modules()):
        raise RuntimeError(
            "torch.nn.utils.parametrize.cached() is on while the pipeline records "
            "gradients: its one cached weight would serve every micro-batch, without a "
            "graph where a cell is checkpointed (gradients lost). Leave cached() for the "
            "pipeline's training calls and steps (inference under no_grad may keep it)"
        )


def micro_batches(value: Any, chunks: int, name: Batched = "input") -> list[Any]:
    """A step's input or target split into micro-batches, in grad mode.

    A step records gradients even under ``torch.no_grad()``: the micro-batches of an
    input or a target that wants a gradient (an adversarial input, a teacher's output)
    stay in the caller's graph, which the step's backward reaches.
    """
    with torch.enable_grad():
        return scatter(value, chunks, name=name)
