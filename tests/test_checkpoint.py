import copy
import gc
import itertools
import weakref

import pytest
import torch
from helpers import Recorder, indexed_input
from torch import Tensor, nn

from torchgpipe import GPipe, is_checkpointing, is_recomputing


class Flags(nn.Module):
    """Records (is_checkpointing, is_recomputing) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x * 2


def test_flags_are_false_outside_a_pipeline() -> None:
    assert not is_checkpointing()
    assert not is_recomputing()


@pytest.mark.parametrize(
    ("checkpoint", "checkpointed"), [("always", 4), ("except_last", 3), ("never", 0)]
)
def test_checkpoint_modes_checkpoint_and_recompute_the_right_micro_batches(
    checkpoint: str, checkpointed: int
) -> None:
    flags = Flags()
    model = GPipe(nn.Sequential(nn.Linear(2, 2), flags), [1, 1], chunks=4, checkpoint=checkpoint)
    model(torch.randn(4, 2)).sum().backward()
    assert flags.seen.count((True, False)) == checkpointed  # checkpointed forward
    assert flags.seen.count((False, True)) == checkpointed  # recomputation
    assert flags.seen.count((False, False)) == 4 - checkpointed  # plain forward
    assert not is_recomputing()


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_nothing_is_checkpointed_in_eval_or_without_grad(mode: str) -> None:
    flags = Flags()
    model = GPipe(nn.Sequential(nn.Linear(2, 2), flags), [1, 1], chunks=4, checkpoint="always")
    if mode == "eval":
        model.eval()
        model(torch.randn(4, 2))
    else:
        with torch.no_grad():
            model(torch.randn(4, 2))
    assert flags.seen == [(False, False)] * 4


class Square(nn.Module):
    """x * x saves x: the intermediate is alive exactly while a graph holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        hidden = x + 1
        if not is_recomputing():
            self.refs.append(weakref.ref(hidden))
        return hidden * hidden


@pytest.mark.parametrize(("checkpoint", "alive"), [("always", 0), ("except_last", 1), ("never", 4)])
def test_intermediate_activations_are_freed_by_checkpointing(checkpoint: str, alive: int) -> None:
    square = Square()
    model = GPipe(
        nn.Sequential(nn.Linear(4, 4), square, nn.Linear(4, 1)),
        [1, 1, 1],
        chunks=4,
        checkpoint=checkpoint,
    )
    out = model(torch.randn(4, 4))
    gc.collect()
    assert sum(ref() is not None for ref in square.refs) == alive
    out.sum().backward()
    gc.collect()
    assert all(ref() is None for ref in square.refs)


class _LogBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor, log: list[tuple[str, int]], tag: int) -> Tensor:
        ctx.log, ctx.tag, ctx.i = log, tag, int(x[0, 0])  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append((f"backward-{ctx.tag}", ctx.i))  # type: ignore[attr-defined]
        return grad, None, None


class LogBackward(nn.Module):
    def __init__(self, tag: int, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.tag, self.log = tag, log
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        if is_recomputing():
            self.log.append((f"recompute-{self.tag}", int(x[0, 0])))
        return _LogBackward.apply(x, self.log, self.tag) * self.scale


@pytest.mark.parametrize("n", [1, 2, 3])
def test_backward_runs_micro_batches_in_reverse_recomputing_cell_by_cell(n: int) -> None:
    log: list[tuple[str, int]] = []
    model = GPipe(
        nn.Sequential(*[LogBackward(j, log) for j in range(n)]),
        [1] * n,
        chunks=5,
        checkpoint="always",
    )
    x = indexed_input(5).requires_grad_()
    model(x).sum().backward()
    for j in range(n):
        events = [(kind, i) for kind, i in log if kind.endswith(f"-{j}")]
        expected = []
        for i in reversed(range(5)):
            expected += [(f"recompute-{j}", i), (f"backward-{j}", i)]
        assert events == expected


def test_recorder_sees_recomputation_after_forward() -> None:
    log: list[tuple[int, str, int, int]] = []
    layer = Recorder(0, log, itertools.count())
    model = GPipe(nn.Sequential(layer, nn.Linear(3, 1)), [1, 1], chunks=2, checkpoint="always")
    model(indexed_input(2).requires_grad_()).sum().backward()
    kinds = [kind for _, kind, _, _ in log]
    assert kinds[:4] == ["forward-start", "forward-end"] * 2
    assert kinds[4:] == ["recompute-start", "recompute-end"] * 2


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("indexed", [False, True])
def test_recomputation_draws_the_same_dropout_mask(n: int, checkpoint: str, indexed: bool) -> None:
    # With x = 1, the output of dropout reveals the forward's mask and the gradient of
    # x the recomputation's: they must be the same, though every partition draws random
    # numbers concurrently from the same (CPU) generator. 'cpu:0' and 'cpu:1' differ to
    # == but are the same generator.
    layers = [nn.Dropout(0.5) for _ in range(n)]
    devices = [f"cpu:{j}" if indexed else "cpu" for j in range(n)]
    model = GPipe(nn.Sequential(*layers), [1] * n, devices=devices, chunks=8, checkpoint=checkpoint)
    for _ in range(5):
        x = torch.ones(16, 256, requires_grad=True)
        out = model(x)
        out.sum().backward()
        assert x.grad is not None
        mask = out.detach() != 0
        expected = mask.double() * 2**n
        assert torch.equal(x.grad.double() * mask, expected)  # same mask in backward
        assert torch.equal(x.grad != 0, mask)


def test_random_numbers_are_reproducible_across_runs() -> None:
    def run() -> Tensor:
        torch.manual_seed(7)
        model = GPipe(nn.Sequential(*[nn.Dropout(0.5) for _ in range(3)]), [1, 1, 1], chunks=4)
        return model(torch.ones(8, 64, requires_grad=True))

    assert torch.equal(run(), run())


def test_checkpointing_advances_the_global_generator() -> None:
    model = GPipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], chunks=2)
    x = torch.ones(4, 64, requires_grad=True)
    assert not torch.equal(model(x), model(x))  # each step draws new masks


class _Mode(nn.Module):
    """Records the training flag each call of its forward saw."""

    def __init__(self, seen: list[bool]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(self.training)
        return x


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_eval_between_the_forward_and_its_backward_recomputes_in_training_mode(
    checkpoint: str, backward_by: str
) -> None:
    # Regression: a model switched to eval() between the forward and the backward (a
    # validation pass in between) recomputed its checkpointed cells in eval mode: batch
    # norm normalized by its running statistics and Dropout dropped nothing, so the
    # gradients were not the plain model's (which backward through the training graph).
    x = torch.randn(8, 4, dtype=torch.float64)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), _Mode([]), nn.Dropout(0.5), nn.Linear(4, 4)]
    plain = nn.Sequential(*layers).double()
    model = GPipe(copy.deepcopy(plain), [3, 2], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    seen = model[2].seen
    torch.manual_seed(1)
    out = model(x)
    never = GPipe(copy.deepcopy(plain), [3, 2], chunks=2, checkpoint="never")
    torch.manual_seed(1)
    expected = never(x)
    model.eval()
    never.eval()
    seen.clear()
    out.square().sum().backward()
    expected.square().sum().backward()
    assert seen  # recomputed, in training mode
    assert all(seen)
    assert not model.training
    assert all(not m.training for m in model.modules())  # eval() again afterwards
    for ours, theirs in zip(model.parameters(), never.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


class _WiderWhenRecomputed(nn.Module):
    """Returns one more column when recomputed: computes otherwise than its forward."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x[:, : 2 if is_recomputing() else 1]


class _Joins(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] + pair[1].sum(1, keepdim=True)


def test_a_recomputation_that_makes_other_shapes_is_named_as_such(backward_by: str) -> None:
    # torch's own check of the gradients' shapes failed on itself ("Boolean value of
    # Tensor with more than one value is ambiguous") or named sizes of nothing known.
    layers = nn.Sequential(nn.Linear(4, 4), _WiderWhenRecomputed(), _Joins(), nn.Linear(4, 4))
    model = GPipe(layers, [2, 2], chunks=2, checkpoint="always")
    out = model(torch.randn(4, 4))
    shapes = r"made outputs of shapes \[\(2, 4\), \(2, 2\)\].*\[\(2, 4\), \(2, 1\)\]"
    with pytest.raises(RuntimeError, match=shapes):
        out.sum().backward()


class _Reverse(nn.Module):
    """Gradient reversal (domain-adversarial training): a tensor hook in the forward."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.guarded = guarded

    def forward(self, x: Tensor) -> Tensor:
        y = x * 1.0
        if not self.guarded or y.requires_grad:
            y.register_hook(lambda g: -g)
        return y


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_tensor_hook_in_a_forward_works_where_a_graph_is_recorded(
    checkpoint: str, backward_by: str
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), _Reverse(guarded=True), nn.Linear(8, 3))
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_tensor_hook_in_a_checkpointed_forward_says_why_it_fails() -> None:
    # The plain model takes it; a checkpointed forward runs without a graph, where torch
    # refuses it, and said only that.
    model = GPipe(nn.Sequential(nn.Linear(4, 8), _Reverse(guarded=False)), [1, 1], chunks=2)
    with pytest.raises(RuntimeError, match="doesn't require gradient") as failed:
        model(torch.randn(6, 4))
    assert any("do it only where the tensor requires grad" in n for n in failed.value.__notes__)


class _OwnBackward(nn.Module):
    """A layer whose own backward fails, as it would in the plain model."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.enable_grad():
            torch.autograd.grad(torch.ones(2).sum(), [x])
        return x


def test_a_layers_own_failure_to_backward_gets_no_note_on_checkpointing() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4), _OwnBackward()), [1, 1], chunks=2)
    with pytest.raises(RuntimeError, match="does not require grad") as failed:
        model(torch.randn(6, 4))
    assert not any("this cell is checkpointed" in n for n in failed.value.__notes__)
