"""Training steps that follow a schedule: the same gradients as the plain model."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
import pytest
import torch
from helpers import BackwardFails, Count, Counted, PopAdd, ScaleInPlace, StashLinear
from test_transparency import (
    MODELS,
    ClosedOver,
    _assert_same_grads,
    _buffered_net,
    _replay_masks,
    closed_over_net,
    duplicated_net,
)
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.gpipe import Checkpoint
from torchgpipe.schedules import Schedule, ScheduleError, one_f_one_b, simulate
from torchgpipe.training import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)

Factory = Callable[..., PipelineSchedule]

SCHEDULES: dict[str, Factory] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zero-bubble": ScheduleZeroBubble,
    "interleaved": partial(ScheduleInterleaved1F1B, virtual_stages=2),
}
# Balances with an even number of partitions, so interleaving (v = 2) applies to all.
CASES = [
    ("mlp", [1, 4]),
    ("mlp", [1, 1, 2, 1]),
    ("convnet", [3, 5]),
    ("convnet", [2, 2, 2, 2]),
    ("tuple", [2, 3]),
    ("tuple", [1, 1, 1, 2]),
]


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


# Interleaving (v = 2) sends micro-batches in groups of the ranks (half the partitions).
MATRIX = [
    (schedule, name, balance, chunks)
    for schedule in SCHEDULES
    for name, balance in CASES
    for chunks in (1, 2, 4)
    if schedule != "interleaved" or chunks % (len(balance) // 2) == 0
]


@pytest.mark.parametrize(("schedule", "name", "balance", "chunks"), MATRIX)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_step_leaves_the_gradients_of_the_plain_model(
    schedule: str, name: str, balance: list[int], chunks: int, checkpoint: Checkpoint
) -> None:
    build, make_input, _ = MODELS[name]
    plain = build().double()
    model = GPipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=checkpoint)
    x = make_input(8).double()
    target = torch.randn_like(plain(x))

    x1 = x.clone().requires_grad_()
    result = SCHEDULES[schedule](model, _mse).step(x1, target)

    _replay_masks(model, plain)
    x2 = x.clone().requires_grad_()
    expected = plain(x2)
    loss = _mse(expected, target)
    loss.backward()

    torch.testing.assert_close(result.output, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.loss, loss.detach(), rtol=1e-10, atol=1e-12)
    assert len(result.losses) == min(chunks, 8)
    _assert_same_grads(model, plain, exact=False)
    assert x1.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_tensor_a_layer_closes_over_gets_its_gradient_in_a_step(
    checkpoint: Checkpoint, schedule: str, last: bool
) -> None:
    # Where no input or parameter of a checkpointed cell wants a gradient, in the first
    # stage, or in the last (which computes the loss, in its recomputation otherwise).
    scale = torch.tensor([1.5, -2.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)

    def build() -> nn.Sequential:
        return (
            nn.Sequential(nn.Tanh(), nn.Tanh(), ClosedOver(scale))
            if last
            else closed_over_net(scale)
        )

    model = GPipe(build(), [2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    target = torch.randn(6, 4 if last else 3, dtype=torch.float64)
    result = SCHEDULES[schedule](model, _mse).step(x, target)
    got, scale.grad = scale.grad, None
    plain = build()
    loss = _mse(plain(x), target)
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach())
    assert got is not None
    torch.testing.assert_close(got, scale.grad)
    if not last:
        _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_sum_reduction_and_uneven_micro_batches(schedule: str) -> None:
    plain = MODELS["mlp"][0]().double()
    model = GPipe(copy.deepcopy(plain), [2, 3], chunks=2)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, target, reduction="sum")

    step = SCHEDULES[schedule](model, loss_fn, reduction="sum").step(x, y)
    loss = loss_fn(plain(x), y)
    loss.backward()
    assert [int(t.numel()) for t in step.losses] == [1, 1]
    torch.testing.assert_close(step.loss, loss.detach())
    _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("made", ["input", "target"])
def test_layers_that_make_the_input_or_the_target_get_their_gradients(
    schedule: str, checkpoint: Checkpoint, made: str
) -> None:
    # A layer outside the pipeline makes the input (an embedding) or the target (a
    # teacher): the micro-batches are pieces of its output, and its graph is walked once,
    # for all of them, as the plain model's backward walks it.
    torch.manual_seed(0)
    outside = nn.Linear(6, 6 if made == "input" else 3).double()
    plain = MODELS["mlp"][0]().double()
    model = GPipe(copy.deepcopy(plain), [1, 1, 2, 1], chunks=4, checkpoint=checkpoint)
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    theirs = copy.deepcopy(outside)

    run = SCHEDULES[schedule](model, _mse)
    if made == "input":
        result = run.step(outside(x), target)
        loss = _mse(plain(theirs(x)), target)
    else:
        result = run.step(x, outside(x))
        loss = _mse(plain(x), theirs(x))
    loss.backward()

    torch.testing.assert_close(result.loss, loss.detach())
    _assert_same_grads(model, plain, exact=False)
    for mine, expected in zip(outside.parameters(), theirs.parameters(), strict=True):
        assert mine.grad is not None
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_the_step_output_is_detached(checkpoint: Checkpoint) -> None:
    model = GPipe(MODELS["mlp"][0](), [2, 3], chunks=2, checkpoint=checkpoint)
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    result = ScheduleGPipe(model, nn.functional.cross_entropy).step(x, y)
    assert not result.output.requires_grad
    assert result.output.grad_fn is None
    result.output.softmax(1).numpy()  # what a metric does


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_optimizer_steps_give_the_same_weights(schedule: str) -> None:
    plain = MODELS["convnet"][0]().double()
    model = GPipe(copy.deepcopy(plain), [2, 2, 2, 2], chunks=4)
    runner = SCHEDULES[schedule](model, nn.functional.cross_entropy)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    opt_model = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
        y = torch.randint(0, 5, (8,))
        opt_model.zero_grad()
        runner.step(x, y)
        opt_model.step()
        opt_plain.zero_grad()
        _replay_masks(model, plain)
        nn.functional.cross_entropy(plain(x), y).backward()
        opt_plain.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_skips_between_stages(schedule: str, checkpoint: Checkpoint) -> None:
    layers = [StashLinear(), nn.Linear(4, 4), nn.Tanh(), PopAdd()]
    plain = nn.Sequential(*copy.deepcopy(layers)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=2, checkpoint=checkpoint)
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    SCHEDULES[schedule](model, _mse).step(x, target)
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)


def test_deferred_batch_norm_updates_as_the_gpipe_path_does() -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4), nn.BatchNorm1d(4)
        ).double()

    stepped = GPipe(build(), [2, 3], chunks=3, deferred_batch_norm=True)
    forwarded = GPipe(build(), [2, 3], chunks=3, deferred_batch_norm=True)
    runner = Schedule1F1B(stepped, _mse)
    for _ in range(2):
        x, target = torch.randn(9, 3, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
        runner.step(x, target)
        _mse(forwarded(x), target).backward()
    for a, b in zip(stepped.modules(), forwarded.modules(), strict=True):
        if isinstance(a, DeferredBatchNorm):
            assert isinstance(b, DeferredBatchNorm)
            torch.testing.assert_close(a.running_mean, b.running_mean)
            torch.testing.assert_close(a.running_var, b.running_var)
            assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 2
    _assert_same_grads(stepped, forwarded, exact=False)


def test_the_weight_gradient_does_not_run_the_input_gradient_again() -> None:
    # In the middle stage Counted sits on the way to the stage's input, between two
    # linear layers: B must run it, and W, which only goes to weights, must not.
    plain = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), Counted(), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)
    ).double()
    model = GPipe(copy.deepcopy(plain), [1, 4, 1], chunks=3, checkpoint="never")
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    Count.calls = 0
    ScheduleZeroBubble(model, _mse).step(x, target)
    assert Count.calls == 3  # once per micro-batch
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)


class _SharedScale(nn.Module):
    """Two branches side by side use one weight's exp: W walks that node from each."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.randn(2, dtype=torch.float64))

    def forward(self, h: Tensor) -> Tensor:
        scale = self.log_scale.exp()
        return h[:, :2] * scale + h[:, 2:] * scale


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_w_walks_a_node_two_weight_branches_share(checkpoint: Checkpoint) -> None:
    # Each W call freed the graph it walked: the second found exp's saved result gone.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), _SharedScale(), nn.Linear(2, 2)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1, 1], chunks=2, checkpoint=checkpoint)
    x, target = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ScheduleZeroBubble(model, _mse).step(x, target)
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("wants", ["input", "target"])
def test_a_step_under_no_grad_reaches_an_input_or_target_that_wants_a_gradient(
    schedule: str, wants: str
) -> None:
    # The micro-batches were cut under no_grad: views wanting a gradient with no graph,
    # so the backward into the caller's graph failed after the stages had run.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    before = nn.Linear(4, 4 if wants == "input" else 2).double()
    raw, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)

    def data() -> tuple[Tensor, Tensor]:  # the graph before anew: a backward frees it
        return (before(raw), y) if wants == "input" else (raw, before(raw))

    x, target = data()
    with torch.no_grad():
        SCHEDULES[schedule](model, _mse).step(x, target)
    grads = [p.grad for p in before.parameters()]
    before.zero_grad(set_to_none=True)
    x, target = data()
    _mse(plain(x), target).backward()
    for got, expected in zip(grads, before.parameters(), strict=True):
        assert got is not None
        torch.testing.assert_close(got, expected.grad)
    _assert_same_grads(model, plain, exact=False)


class _PythonLinear(torch.autograd.Function):
    """A linear map written in Python: one call gives both gradients, and frees its context."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.kept = (x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        _PythonLinear.calls += 1
        x, weight = ctx.kept
        del ctx.kept  # a second call would find nothing
        return grad @ weight, grad.t() @ x


class _PythonLinearLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64) / 2)

    def forward(self, x: Tensor) -> Tensor:
        return _PythonLinear.apply(x, self.weight)  # type: ignore[no-any-return]


class _ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("layer", [_PythonLinearLayer, _ReentrantCheckpoint])
def test_a_stage_whose_backward_cannot_be_split_runs_it_whole_in_b(layer: type[nn.Module]) -> None:
    # W resumed from the Python node and ran its backward again (which here fails, as it
    # frees its context); torch's reentrant checkpoint refused B's backward(inputs=...).
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), layer(), nn.Linear(4, 4), layer()).double()
    model = GPipe(copy.deepcopy(plain), [2, 2], chunks=3, checkpoint="never")
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    _PythonLinear.calls = 0
    ScheduleZeroBubble(model, _mse).step(x, target)
    if layer is _PythonLinearLayer:
        assert _PythonLinear.calls == 2 * 3  # once per layer and micro-batch
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)


def test_each_stage_runs_its_backward_on_its_own_thread() -> None:
    seen: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}

    def watch(stage: int) -> nn.Module:
        # A hook on the output, not on a parameter: a parameter's hooks run once, after
        # the step (test_grad_hooks.py).
        def hook(_: nn.Module, __: Any, y: Tensor) -> None:
            if y.requires_grad:  # not in a checkpointed forward: in its recomputation
                y.register_hook(lambda _: seen[stage].add(threading.current_thread().name))

        layer = nn.Linear(4, 4)
        layer.register_forward_hook(hook)
        return layer

    model = GPipe(nn.Sequential(watch(0), watch(1), watch(2)), [1, 1, 1], chunks=2)
    Schedule1F1B(model, _mse).step(torch.randn(4, 4), torch.randn(4, 4))
    names = [seen[s] for s in range(3)]
    assert all(len(n) == 1 for n in names), names
    threads = [next(iter(n)) for n in names]
    # The caller's thread runs stage 0, a worker each of the others.
    assert threads == [
        threading.current_thread().name,
        "torchgpipe-worker-1",
        "torchgpipe-worker-2",
    ]


@pytest.mark.parametrize(
    ("runner", "table"),
    [
        (ScheduleGPipe, "gpipe"),
        (Schedule1F1B, "one_f_one_b"),
        (ScheduleZeroBubble, "zero_bubble_h1"),
    ],
)
def test_peak_activations_held_follow_the_table(runner: Factory, table: str) -> None:
    from torchgpipe import schedules

    model = GPipe(nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))), [1, 1, 1, 1], chunks=6)
    result = runner(model, _mse).step(torch.randn(6, 2), torch.randn(6, 2))
    expected = simulate(getattr(schedules, table)(4, 6), {"F": 1, "B": 1, "W": 1}).holding
    assert result.peak_held == expected
    if table == "one_f_one_b":
        assert result.peak_held == (4, 3, 2, 1)
    if table == "gpipe":
        assert result.peak_held == (6, 6, 6, 6)


def test_a_table_of_ones_own() -> None:
    plain = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    # Backwards in the opposite micro-batch order to 1F1B's.
    table = Schedule.parse("0F0 0F1 0B1 0B0\n1F0 1F1 1B1 1B0")
    x, target = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    PipelineSchedule(model, _mse, table).step(x, target)
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)


def test_trace_records_forward_backward_and_weight_spans() -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)
    with model.trace() as trace:
        ScheduleZeroBubble(model, _mse).step(torch.randn(4, 2), torch.randn(4, 2))
    kinds = {(e.j, e.i, e.kind) for e in trace.events}
    for j in range(2):
        for i in range(2):
            assert {(j, i, "forward"), (j, i, "backward"), (j, i, "weight")} <= kinds
            assert (j, i, "recompute") in kinds or i == 1  # except_last
    assert trace.summary().n == 2


# Failures and bad arguments.


class FailAt(nn.Module):
    def __init__(self, calls: int, error: BaseException) -> None:
        super().__init__()
        self.calls, self.error, self.seen = calls, error, 0

    def forward(self, x: Tensor) -> Tensor:
        self.seen += 1
        if self.seen == self.calls:
            raise self.error
        return x


class FailsBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return BackwardFails.apply(x)  # type: ignore[no-any-return,no-untyped-call]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_forward_failure_reaches_the_caller_and_the_next_step_works(schedule: str) -> None:
    failing = FailAt(2, KeyError("boom"))
    layers = [nn.Linear(2, 2), nn.Linear(2, 2), failing, nn.Linear(2, 2)]
    model = GPipe(nn.Sequential(*layers), [1, 1, 1, 1], chunks=4, checkpoint="never")
    runner = SCHEDULES[schedule](model, _mse)
    x, target = torch.randn(4, 2), torch.randn(4, 2)
    with pytest.raises(KeyError, match="boom") as info:
        runner.step(x, target)
    assert any("2F1" in note for note in getattr(info.value, "__notes__", []))
    model.zero_grad()
    runner.step(x, target)  # the next step works
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_backward_failure_reaches_the_caller(schedule: str) -> None:
    layers = [nn.Linear(2, 2), FailsBackward(), nn.Linear(2, 2), nn.Linear(2, 2)]
    model = GPipe(nn.Sequential(*layers), [1, 1, 1, 1], chunks=2)
    with pytest.raises(ArithmeticError, match="in backward") as info:
        SCHEDULES[schedule](model, _mse).step(torch.randn(4, 2), torch.randn(4, 2))
    assert any("1B" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_failing_loss_fn_is_named_even_when_computed_in_the_recomputation(
    checkpoint: Checkpoint,
) -> None:
    # A checkpointed last stage computes its loss in its recomputation: the note named
    # only the B action, as if the backward had failed.
    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        raise ValueError("a bad target")

    model = GPipe(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2, checkpoint=checkpoint
    )
    with pytest.raises(ValueError, match="a bad target") as info:
        SCHEDULES["1f1b"](model, loss_fn).step(torch.randn(4, 2), torch.randn(4, 2))
    notes = info.value.__notes__
    assert any(note.startswith("torchgpipe: raised in loss_fn") for note in notes), notes
    assert any("recomputation" in note for note in notes) == (checkpoint != "never"), notes


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)

    def per_sample(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target, reduction="none")

    with pytest.raises(TypeError, match=r"one element.*use a reduction"):
        Schedule1F1B(model, per_sample).step(torch.randn(4, 2), torch.randn(4, 2))

    def terms(output: Tensor, target: Tensor) -> dict[str, Tensor]:
        return {"mse": _mse(output, target), "aux": output.abs().mean()}

    with pytest.raises(TypeError, match=r"got dict; return their sum \(auxiliary"):
        Schedule1F1B(model, terms).step(torch.randn(4, 2), torch.randn(4, 2))


def test_a_complex_loss_is_refused_as_the_plain_model_refuses_it() -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2)
    x, y = torch.randn(4, 2), torch.randn(4, 2)

    def complex_loss(output: Tensor, target: Tensor) -> Tensor:
        return _mse(output, target) * (1 + 2j)

    with pytest.raises(RuntimeError, match="real scalar"):
        complex_loss(plain(x), y).backward()
    for schedule in SCHEDULES.values():  # it trained on the real part, silently
        with pytest.raises(TypeError, match="complex64 loss"):
            schedule(model, complex_loss).step(x, y)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_step_where_nothing_wants_a_gradient_is_refused(schedule: str) -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)).requires_grad_(False)
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _mse(plain(x), y).backward()
    with pytest.raises(RuntimeError, match="nothing in the step wants a gradient"):
        SCHEDULES[schedule](model, _mse).step(x, y)
    # An input that wants one is something to train (its gradient): the step runs.
    wanting = x.clone().requires_grad_()
    SCHEDULES[schedule](model, _mse).step(wanting, y)
    expected = x.clone().requires_grad_()
    _mse(plain(expected), y).backward()
    torch.testing.assert_close(wanting.grad, expected.grad)


@pytest.mark.parametrize("samples", [4, 5])
def test_a_loss_per_sample_is_refused_as_the_plain_model_refuses_it(samples: int) -> None:
    # The bug: with chunks = 4 and a batch of 4, a loss per sample has one element for
    # each micro-batch of one sample, which passed for its loss: the step averaged the
    # per-sample losses, where the plain model's loss.backward() refuses a batch of more
    # than one. (Batch 5: micro-batches of 2, 1, 1, 1, where the 2 elements tell.)
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=4)

    def per_sample(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target, reduction="none").mean(1)

    x, y = torch.randn(samples, 2), torch.randn(samples, 2)
    match = r"one element" if samples == 5 else r"shape \(1,\) for micro-batches of 1 sample"
    for schedule in SCHEDULES.values():
        with pytest.raises(TypeError, match=match):
            schedule(model, per_sample).step(x, y)
    if samples == 4:  # refused at each loss, before any backward
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_loss_of_one_element_that_is_not_per_sample_is_taken(checkpoint: str) -> None:
    # A 0-dim loss, whatever the micro-batches; a loss of shape (1,) where some
    # micro-batch has more than one sample (then it cannot be one loss per sample:
    # the last small micro-batch of a batch of 3 in 2 included), or where the whole
    # batch is one sample (which the plain model takes, whatever the loss's shape).
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def reduced(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target).reshape(1)

    for batch, loss_fn, chunks in [(8, _mse, 8), (8, reduced, 4), (3, reduced, 2), (1, reduced, 4)]:
        x, y = torch.randn(batch, 2), torch.randn(batch, 2)
        expected = copy.deepcopy(layers)
        nn.functional.mse_loss(expected(x), y).backward()
        model = GPipe(copy.deepcopy(layers), [1, 1], chunks=chunks, checkpoint=checkpoint)
        Schedule1F1B(model, loss_fn).step(x, y)
        for ours, theirs in zip(model.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad)
    x, y = torch.randn(8, 2), torch.randn(8, 2)
    one = GPipe(nn.Sequential(nn.Linear(2, 2)), [1], chunks=8, checkpoint=checkpoint)
    with pytest.raises(TypeError, match=r"as a 0-dim tensor \(loss.reshape\(\(\)\)\)"):
        Schedule1F1B(one, reduced).step(x, y)  # micro-batches of one sample: ambiguous


def test_a_table_with_a_rank_that_runs_no_stage_is_refused_and_the_gpipe_steps_on() -> None:
    # The bug: a third rank with nothing to do passed every check; the step failed with
    # an IndexError after handing jobs to the workers (the GPipe has two), and every
    # later step on the GPipe hung. Refused up front now, when the schedule is built
    # (a Schedule) or at the step (a table function), before any worker runs.
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), [2, 1], chunks=2)
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    idle = Schedule(2, 2, (*one_f_one_b(2, 2).ranks, ()))
    idle.validate()  # a valid table: the empty rank waits for nothing
    match = (
        r"the schedule has 3 ranks but places its 2 stages on only 2 of them \(placement "
        r"\(0, 1\)\): rank 2 runs no stage\. .* drop the ranks without actions"
    )
    with pytest.raises(ValueError, match=match):
        PipelineSchedule(model, _mse, idle)
    later = PipelineSchedule(model, _mse, lambda m: Schedule(2, m, (*one_f_one_b(2, m).ranks, ())))
    with pytest.raises(ValueError, match=match):
        later.step(x, y)
    both = Schedule.parse("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1").ranks[0]  # all on rank 0
    shut = Schedule(2, 2, (both, ()), (0, 0))
    shut.validate()
    with pytest.raises(ValueError, match=r"2 ranks .* on only 1 of them .* rank 1 runs no"):
        PipelineSchedule(model, _mse, shut)
    result: list[Any] = []  # the GPipe steps on: in a thread, so that a hang fails the test
    thread = threading.Thread(
        target=lambda: result.append(Schedule1F1B(model, _mse).step(x, y)), daemon=True
    )
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the step after the refused table hangs"
    assert len(result) == 1
    assert all(p.grad is not None for p in model.parameters())


def test_bad_arguments_are_refused_up_front() -> None:
    model = GPipe(nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))), [1, 1, 1, 1], chunks=4)
    with pytest.raises(TypeError, match="GPipe"):
        Schedule1F1B(nn.Sequential(nn.Linear(2, 2)), _mse)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        Schedule1F1B(model, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction"):
        Schedule1F1B(model, _mse, reduction="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisor of the 4 partitions"):
        ScheduleInterleaved1F1B(model, _mse, virtual_stages=3)
    odd = GPipe(nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))), [1, 1, 1, 1], chunks=3)
    with pytest.raises(ValueError, match="multiple of 2"):
        ScheduleInterleaved1F1B(odd, _mse, virtual_stages=2)
    with pytest.raises(ValueError, match="3 stages but the balance 4"):
        PipelineSchedule(model, _mse, Schedule.parse("0F0 0B0\n1F0 1B0\n2F0 2B0"))
    with pytest.raises(ScheduleError, match="deadlocks"):
        PipelineSchedule(model, _mse, Schedule.parse("0B0 0F0\n1F0 1B0\n2F0 2B0\n3F0 3B0"))
    with pytest.raises(ValueError, match="micro-batches of"):
        Schedule1F1B(model, _mse).step(torch.randn(8, 2), torch.randn(6, 2))
    table = PipelineSchedule(model, _mse, Schedule.parse("0F0 0B0\n1F0 1B0\n2F0 2B0\n3F0 3B0"))
    with pytest.raises(ValueError, match="for 1 micro-batches but the batch splits into 4"):
        table.step(torch.randn(8, 2), torch.randn(8, 2))
    # The advice fits the cause: chunks, or a batch too small for chunks.
    with pytest.raises(ValueError, match=r"splits into 4 \(chunks=4\).* use chunks=1$"):
        table.step(torch.randn(8, 2), torch.randn(8, 2))
    four = PipelineSchedule(model, _mse, one_f_one_b(4, 4))
    with pytest.raises(ValueError, match=r"use a batch of at least 4 samples$"):
        four.step(torch.randn(2, 2), torch.randn(2, 2))
    three = PipelineSchedule(model, _mse, one_f_one_b(4, 3))
    with pytest.raises(ValueError, match=r"use chunks=3 and a batch of at least 3 samples$"):
        three.step(torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"use chunks=3$"):
        three.step(torch.randn(5, 2), torch.randn(5, 2))
    six = PipelineSchedule(model, _mse, one_f_one_b(4, 6))
    with pytest.raises(ValueError, match=r"use chunks=6 and a batch of at least 6 samples$"):
        six.step(torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(TypeError, match=r"needs both in one process"):
        Schedule1F1B(model, _mse).step(torch.randn(8, 2))


def test_the_stages_of_a_rank_must_share_a_device() -> None:
    model = GPipe(
        nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))),
        [1, 1, 1, 1],
        devices=["cpu", "cpu", "cpu:0", "cpu:0"],
        chunks=2,
    )
    with pytest.raises(ValueError, match="rank 0 runs stages on devices"):
        ScheduleInterleaved1F1B(model, _mse, virtual_stages=2).step(
            torch.randn(4, 2), torch.randn(4, 2)
        )


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_cuda_stages_match_the_plain_model(schedule: str) -> None:
    # Activations and gradients cross devices (or streams of one device) on copy streams.
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", j % count) for j in range(4)]
    if schedule == "interleaved":  # rank r runs partitions r and r + 2: one device each
        devices = [devices[0], devices[1], devices[0], devices[1]]
    layers = [StashLinear(), nn.Linear(4, 4), nn.Tanh(), PopAdd()]
    plain = nn.Sequential(*copy.deepcopy(layers))
    model = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], devices=devices, chunks=4)
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    result = SCHEDULES[schedule](model, _mse).step(x.to(devices[0]), target.to(devices[-1]))
    expected = plain(x)
    loss = _mse(expected, target)
    loss.backward()
    torch.testing.assert_close(result.loss.cpu(), loss.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_tensor_handed_on_twice_stays_one_in_every_schedule(
    schedule: str, checkpoint: str
) -> None:
    plain = nn.Sequential(*duplicated_net(), nn.Tanh())
    model = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    target = torch.randn(4, 3, dtype=torch.float64)
    result = SCHEDULES[schedule](model, _mse).step(x, target)
    expected = _mse(plain(x), target)
    expected.backward()
    torch.testing.assert_close(result.loss, expected.detach(), rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


class _WithTable(nn.Module):
    """Hands on a buffer of its own beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x), self.table


class _UseTable(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        h, table = pair
        return h + table


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_buffer_handed_on_by_a_checkpointed_stage_stays_a_buffer(checkpoint: str) -> None:
    model = GPipe(nn.Sequential(_WithTable(), _UseTable()), [1, 1], chunks=2, checkpoint=checkpoint)
    x, target = torch.randn(4, 4), torch.randn(4, 4)
    Schedule1F1B(model, _mse).step(x, target)
    model(x).sum().backward()
    table = model.partitions[0][0].table
    assert not table.requires_grad
    assert table.grad is None


def test_a_loss_that_does_not_require_grad_is_refused() -> None:
    model = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), [1, 1], chunks=2)
    schedule = Schedule1F1B(model, lambda out, target: _mse(out.detach(), target))
    with pytest.raises(RuntimeError, match="loss_fn returned a loss that does not require grad"):
        schedule.step(torch.randn(4, 3), torch.randn(4, 3))

    # One micro-batch's loss alone may be a constant (a mask with nothing left).
    def masked(out: Tensor, target: Tensor) -> Tensor:
        mask = target[:, 0] > 0
        return _mse(out[mask], target[mask]) if mask.any() else torch.zeros(())

    target = torch.tensor([[-1.0] * 3, [-1.0] * 3, [1.0] * 3, [1.0] * 3])
    Schedule1F1B(model, masked).step(torch.randn(4, 3), target)
    assert all(p.grad is not None for p in model.parameters())
    # Nothing to train and nothing wanting a gradient: refused as the plain model's
    # loss.backward() refuses it (test_a_step_where_nothing_wants_a_gradient_is_refused).
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match="nothing in the step wants a gradient"):
        schedule.step(torch.randn(4, 3), torch.randn(4, 3))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_buffers_a_forward_changes_are_recomputed_from_where_it_started_in_every_schedule(
    schedule: str,
) -> None:
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    results = {}
    for mode in ("never", "always"):
        # Four partitions (interleaving's two ranks); the buffers in the first two.
        model = GPipe(_buffered_net(), [1, 1, 2, 1], chunks=2, checkpoint=mode)
        driver = SCHEDULES[schedule](model, _mse)
        for _ in range(2):
            result = driver.step(x, target)
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[mode] = (result.loss, model.state_dict(), grads)
    for ours, expected in zip(results["always"], results["never"], strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


def test_a_short_last_batch_under_interleaving_says_what_to_do() -> None:
    model = GPipe(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))), [1, 1, 1, 1], chunks=4)
    schedule = ScheduleInterleaved1F1B(model, _mse)
    with pytest.raises(ValueError, match="groups of n = 2; got m = 3") as info:
        schedule.step(torch.randn(3, 4), torch.randn(3, 4))
    assert any("drop_last=True" in note for note in info.value.__notes__)


def test_chunks_changed_under_interleaving_is_named_not_the_batch() -> None:
    # Regression: the note blamed a short batch where chunks had been changed since.
    model = GPipe(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))), [1, 1, 1, 1], chunks=4)
    schedule = ScheduleInterleaved1F1B(model, _mse)
    model.chunks = 3
    with pytest.raises(
        ValueError, match="but chunks is now 3; set chunks to a multiple of 2"
    ) as info:
        schedule.step(torch.randn(12, 4), torch.randn(12, 4))
    assert not getattr(info.value, "__notes__", [])


# A table that is not one is refused when the schedule is built, or when its function
# returns something else.


def _tiny_pipe(partitions: int) -> GPipe:
    layers = [nn.Linear(2, 2) for _ in range(partitions)]
    return GPipe(nn.Sequential(*layers), [1] * partitions, chunks=2)


def _squared_error(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (5, r"table must be a torchgpipe.schedules.Schedule .* got int 5"),
        (None, r"table must be a torchgpipe.schedules.Schedule .* got NoneType None"),
        ("0F0 0B0\n1F0 1B0", r"table is text .*; read it with .*Schedule.parse\(text\)"),
        (one_f_one_b, r"one argument, the number of micro-batches m, but one_f_one_b\(n"),
    ],
    ids=["int", "None", "text", "builder"],
)
def test_pipeline_schedule_refuses_a_table_that_is_not_one_when_built(
    table: Any, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        PipelineSchedule(_tiny_pipe(2), _squared_error, table)


def test_pipeline_schedule_refuses_a_table_function_that_returns_no_schedule() -> None:
    returns_text: Any = lambda m: "0F0"  # noqa: E731
    schedule = PipelineSchedule(_tiny_pipe(2), _squared_error, returns_text)
    with pytest.raises(TypeError, match=r"returned str '0F0' for m = 2 micro-batches, not a"):
        schedule.step(torch.randn(4, 2), torch.randn(4, 2))
    good = PipelineSchedule(_tiny_pipe(2), _squared_error, lambda m: one_f_one_b(2, m))
    assert len(good.step(torch.randn(4, 2), torch.randn(4, 2)).losses) == 2


def test_interleaved_schedule_says_its_default_virtual_stages_do_not_fit() -> None:
    with pytest.raises(
        ValueError,
        match=r"virtual_stages defaults to 2 partitions per rank, which does not divide the "
        r"3 partitions; pass virtual_stages= one of \[1, 3\]",
    ):
        ScheduleInterleaved1F1B(_tiny_pipe(3), _squared_error)
    two: Any = np.int64(2)
    assert (
        ScheduleInterleaved1F1B(_tiny_pipe(4), _squared_error, virtual_stages=two).virtual_stages
        == 2
    )


@pytest.mark.parametrize("schedule", [Schedule1F1B, ScheduleZeroBubble])
def test_a_stage_whose_input_comes_to_want_a_gradient_in_place_gets_its_gradients(
    schedule: Any,
) -> None:
    # The bug: the split backward took that input for one wanting a gradient and stopped
    # there, so the weight pass never reached w (ZB-H1: w.grad None).
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), ScaleInPlace(), nn.Linear(4, 4))
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint="never")
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    schedule(model, nn.functional.mse_loss).step(x, target)
    nn.functional.mse_loss(plain(x), target).backward()
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_a_step_under_inference_mode_is_refused_with_what_to_do() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2)
    schedule = ScheduleGPipe(model, nn.functional.mse_loss)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"forward_only\(input\)"):
        schedule.step(torch.randn(4, 4), torch.randn(4, 4))
    with torch.inference_mode():  # a forward without gradients is what inference mode is for
        assert schedule.forward_only(torch.randn(4, 4)).shape == (4, 4)


class _WithAuxiliaryLoss(nn.Module):
    """Logits and a 0-dim auxiliary loss (a mixture of experts' balancing loss, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.linear(x)
        return logits, logits.softmax(-1).mean(0).square().sum()


def test_a_step_whose_output_holds_a_0_dim_tensor_gives_one_per_micro_batch() -> None:
    # Gathered after the backward, the output was refused: the step raised with every
    # .grad already filled. The loss uses each micro-batch's own, as in the plain model.
    def loss_fn(output: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        logits, aux = output
        return nn.functional.cross_entropy(logits, target) + 0.01 * aux

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), _WithAuxiliaryLoss())
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    result = Schedule1F1B(model, loss_fn).step(x, y)
    logits, aux = result.output
    assert logits.shape == (8, 3)
    assert aux.shape == (2,)
    expected = [loss_fn(plain(half), t) for half, t in zip(x.chunk(2), y.chunk(2), strict=True)]
    torch.testing.assert_close(aux, torch.stack([plain(half)[1] for half in x.chunk(2)]))
    torch.testing.assert_close(result.loss, torch.stack(expected).mean())


class _Hooked(nn.Module):
    """A linear layer whose output's gradient a hook scales: on the tensor or its node."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.how = nn.Linear(4, 4), how
        self.retained: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)  # its node branches off towards the weights: W resumes there
        if h.requires_grad:  # in a recomputation, where a checkpointed cell has a graph
            if self.how == "tensor":
                h.register_hook(lambda g: -0.5 * g)
            elif self.how == "node":
                h.grad_fn.register_prehook(lambda gs: tuple(-0.5 * g for g in gs))  # type: ignore[union-attr]
            else:
                h.retain_grad()
                self.retained.append(h)
        return torch.tanh(h)


@pytest.mark.parametrize("how", ["tensor", "node", "retain_grad"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_zero_bubble_runs_a_hook_of_the_forward_once(how: str, checkpoint: Checkpoint) -> None:
    # Regression: W resumed from the hooked node, which ran the hook again: the weights
    # below it got the gradient scaled twice (a reversal undone), retain_grad twice the sum.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), _Hooked(how), nn.Linear(4, 2)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1, 1], chunks=2, checkpoint=checkpoint)
    x, target = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ScheduleZeroBubble(model, _mse).step(x, target)
    _mse(plain(x), target).backward()
    _assert_same_grads(model, plain, exact=False)
    if how == "retain_grad":  # a micro-batch's gradient each, in the plain model's share
        got = torch.cat([h.grad for h in model[1].retained if h.grad is not None])
        (want,) = (h.grad for h in plain[1].retained)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("loss", "schedule"), [("sum", "mean"), ("mean", "sum")])
def test_a_torch_loss_reducing_otherwise_than_the_schedule_is_refused(
    loss: Literal["mean", "sum"], schedule: Literal["mean", "sum"]
) -> None:
    # Regression: a summing loss under the default 'mean' gave other gradients silently
    # (reweighted, not only scaled, where the micro-batches' sizes differ).
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=4)
    with pytest.raises(ValueError, match=f"reduces by '{loss}' .* pass reduction='{loss}'"):
        Schedule1F1B(model, nn.MSELoss(reduction=loss), reduction=schedule)
    Schedule1F1B(model, nn.MSELoss(reduction=loss), reduction=loss).step(
        torch.randn(10, 4), torch.randn(10, 4)
    )
