"""Parameters' hooks run once per backward, with its whole gradient, in every schedule.

A hook that clips its gradient sees the batch's gradient, not a micro-batch's, and a
post-accumulate hook (an optimizer stepped in backward) runs once per step, as with
the plain model's ``loss.backward()``.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from distributed_helpers import run_threads
from helpers import BackwardFails, OnBackward
from nccl_rules import NCCLRules
from test_nccl_transport import SCHEDULES  # the schedule classes by name
from test_tied import _data, _language_model
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import (
    GPipe,
    Schedule1F1B,
    ScheduleGPipe,
)
from torchgpipe.distributed import PipelineStage, Transport
from torchgpipe.grad_hooks import hooks_once


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 3, generator=generator)


class _Counted:
    """Hooks on a model: one clipping its gradient, one after accumulation; their calls."""

    def __init__(self, model: nn.Module, clipped: str, accumulated: str) -> None:
        self.clip_calls: list[Tensor] = []
        self.post_calls: list[Tensor] = []
        parameters = dict(model.named_parameters())
        parameters[clipped].register_hook(self._clip)
        parameters[accumulated].register_post_accumulate_grad_hook(self._post)

    def _clip(self, grad: Tensor) -> Tensor:
        self.clip_calls.append(grad.clone())
        return grad.clamp(-0.01, 0.01)

    def _post(self, p: Tensor) -> None:
        assert p.grad is not None
        self.post_calls.append(p.grad.clone())


def _assert_grads(got: nn.Module, expected: nn.Module) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), expected.named_parameters(), strict=True):
        assert a.grad is not None, name
        assert b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_step_runs_each_hook_once_with_the_whole_gradient(schedule: str, checkpoint: str) -> None:
    x, y = _batch()
    plain = _model()
    plain_hooks = _Counted(plain, "2.weight", "0.weight")
    for _ in range(2):  # the second step accumulates onto the first's .grad
        F.mse_loss(plain(x), y).backward()

    pipe = GPipe(_model(), [2, 1, 1, 1], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    hooks = _Counted(pipe, "2.weight", "0.weight")
    driver = SCHEDULES[schedule](pipe, F.mse_loss)
    for _ in range(2):
        driver.step(x, y)

    assert len(hooks.clip_calls) == len(plain_hooks.clip_calls) == 2
    assert len(hooks.post_calls) == len(plain_hooks.post_calls) == 2
    for got, expected in zip(hooks.clip_calls, plain_hooks.clip_calls, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got, expected in zip(hooks.post_calls, plain_hooks.post_calls, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    _assert_grads(pipe, plain)


def test_a_step_that_never_reaches_a_parameter_calls_none_of_its_hooks() -> None:
    pipe = GPipe(_model(), [2, 3], chunks=2)
    hooks = _Counted(pipe, "0.weight", "0.weight")

    def cut(output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output.detach() * pipe[4].weight.sum(), target)

    Schedule1F1B(pipe, cut).step(*_batch())
    assert hooks.clip_calls == []
    assert hooks.post_calls == []
    assert pipe[0].weight.grad is None
    assert pipe[4].weight.grad is not None


def test_a_failed_step_leaves_every_grad_and_hook_as_it_was() -> None:
    pipe = GPipe(_model(), [2, 3], chunks=2)
    hooks = _Counted(pipe, "2.weight", "0.weight")
    x, y = _batch()
    ScheduleGPipe(pipe, F.mse_loss).step(x, y)
    before = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}

    def failing(output: Tensor, target: Tensor) -> Tensor:
        loss = F.mse_loss(output, target)
        if failing.calls == 1:  # type: ignore[attr-defined]
            raise RuntimeError("the loss of the second micro-batch fails")
        failing.calls += 1  # type: ignore[attr-defined]
        return loss

    failing.calls = 0  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="second micro-batch"):
        ScheduleGPipe(pipe, failing).step(x, y)
    assert len(hooks.clip_calls) == 1
    assert len(hooks.post_calls) == 1
    torch.testing.assert_close(pipe[2].weight.grad, before["2.weight"], rtol=0, atol=0)
    torch.testing.assert_close(pipe[0].weight.grad, before["0.weight"], rtol=0, atol=0)

    ScheduleGPipe(pipe, F.mse_loss).step(x, y)  # the hooks are back, and run once
    assert len(hooks.clip_calls) == 2
    assert len(hooks.post_calls) == 2


def test_hooks_once_keeps_the_order_of_hooks_and_the_ones_added_meanwhile() -> None:
    p = nn.Parameter(torch.ones(2))
    order: list[str] = []
    p.register_hook(lambda g: order.append("first"))
    p.register_hook(lambda g: order.append("second"))
    with hooks_once([p]):
        p.grad = torch.ones(2)
        p.register_hook(lambda g: order.append("third"))
    assert order == ["first", "second", "third"]
    torch.testing.assert_close(p.grad, torch.ones(2))
    order.clear()
    (p * 2).sum().backward()
    assert order == ["first", "second", "third"]


def test_a_tied_weights_hooks_see_the_sum_of_all_its_uses() -> None:
    ids, target = _data(3)
    plain = _language_model()
    seen: list[Tensor] = []
    plain[0].weight.register_hook(lambda g: seen.append(g.clone()))
    F.cross_entropy(plain(ids), target).backward()

    pipe = GPipe(copy.deepcopy(_language_model()), [2, 3], chunks=4)
    calls: dict[str, list[Tensor]] = {"0.weight": [], "4.weight": []}
    for name in calls:
        pipe.get_parameter(name).register_hook(lambda g, name=name: calls[name].append(g.clone()))
    Schedule1F1B(pipe, F.cross_entropy).step(ids, target)
    for name, got in calls.items():
        assert len(got) == 1, name
        torch.testing.assert_close(got[0], seen[0], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(pipe[0].weight.grad, pipe[4].weight.grad)


def test_a_hook_on_every_parameter_acts_once_on_a_tied_weight() -> None:
    def halve(grad: Tensor) -> Tensor:
        return grad * 0.5

    plain = _language_model()
    for p in plain.parameters():  # the tied weight once
        p.register_hook(halve)
    pipe = GPipe(copy.deepcopy(_language_model()), [2, 3], chunks=4)
    for p in pipe.parameters():  # each copy
        p.register_hook(halve)
    driver = Schedule1F1B(pipe, F.cross_entropy)
    for k in range(2):  # the second step accumulates onto the first
        ids, target = _data(10 + k)
        F.cross_entropy(plain(ids), target).backward()
        driver.step(ids, target)
    expected = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("hooked", ["0.weight", "4.weight"])
def test_a_hook_on_one_copy_of_a_tied_weight_is_refused_with_nothing_kept(hooked: str) -> None:
    pipe = GPipe(copy.deepcopy(_language_model()), [2, 3], chunks=4)
    pipe.get_parameter(hooked).register_hook(lambda grad: grad.clamp(-0.01, 0.01))
    with pytest.raises(RuntimeError, match="register the hook on every copy"):
        Schedule1F1B(pipe, F.cross_entropy).step(*_data(10))
    assert pipe[0].weight.grad is None
    assert pipe[4].weight.grad is None


@pytest.mark.parametrize(
    ("change", "what"),
    [(lambda g: g.double(), "dtype"), (lambda g: g.sum(0), "shape")],
)
def test_a_hook_that_changes_its_gradients_kind_is_refused(
    change: Callable[[Tensor], Tensor], what: str
) -> None:
    pipe = GPipe(_model(), [2, 3], chunks=2)
    pipe[2].weight.grad = torch.zeros_like(pipe[2].weight)
    pipe[2].weight.register_hook(change)
    with pytest.raises(RuntimeError, match=f"changed the {what} of its gradient"):
        ScheduleGPipe(pipe, F.mse_loss).step(*_batch())
    assert torch.equal(pipe[2].weight.grad, torch.zeros_like(pipe[2].weight))


def _clip_every_weight(model: nn.Module) -> list[list[Tensor]]:
    """A clipping hook on each weight; the gradients each is called with."""
    calls: list[list[Tensor]] = []
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            seen: list[Tensor] = []
            calls.append(seen)
            p.register_hook(lambda g, seen=seen: (seen.append(g), g.clamp(-0.01, 0.01))[1])
    return calls


@pytest.mark.parametrize(("world", "balance"), [(2, [2, 3]), (4, [1, 1, 1, 2])])
def test_processes_run_each_hook_once_under_nccl_rules(world: int, balance: list[int]) -> None:
    x, y = _batch()
    plain = _model()
    _clip_every_weight(plain)
    F.mse_loss(plain(x), y).backward()

    rules = NCCLRules(world)
    models = [_model() for _ in range(world)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        calls = _clip_every_weight(stage)
        Schedule1F1B(stage, F.mse_loss).step(x if stage.is_first else None, y)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        return grads, [len(seen) for seen in calls]

    out = run_threads(rank, world, timeout=60.0, observe=rules.group)
    grads = {name: g for got, _ in out for name, g in got.items()}
    assert sorted(grads) == sorted(name for name, _ in plain.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert [count for _, counts in out for count in counts] == [1, 1, 1]


def test_processes_run_a_tied_weights_hooks_once_on_its_whole_gradient() -> None:
    def clip(grad: Tensor) -> Tensor:
        return grad.clamp(-0.01, 0.01)

    plain = _language_model()
    plain[0].weight.register_hook(clip)
    models = [_language_model() for _ in range(2)]
    rules = NCCLRules(2)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=4)
        name = "0.weight" if stage.is_first else "4.weight"
        stage.get_parameter(name).register_hook(clip)  # alike on every holder
        driver = Schedule1F1B(stage, F.cross_entropy)
        for k in range(2):
            ids, target = _data(10 + k)
            driver.step(ids if stage.is_first else None, target if stage.is_last else None)
        return stage.get_parameter(name).grad

    for k in range(2):
        ids, target = _data(10 + k)
        F.cross_entropy(plain(ids), target).backward()
    for grad in run_threads(rank, 2, timeout=30.0, observe=rules.group):
        torch.testing.assert_close(grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_an_overflow_on_a_hooked_tied_weight_reaches_the_optimizer() -> None:
    # NaN and inf are no sign of a hook on some copies only: a GradScaler skips the step.
    pipe = GPipe(copy.deepcopy(_language_model()), [2, 3], chunks=4)
    for p in pipe.parameters():
        p.register_hook(lambda grad: None)  # observes only
    ids, target = _data(10)
    Schedule1F1B(pipe, lambda y, t: F.cross_entropy(y, t) * math.inf).step(ids, target)
    for name in ("0.weight", "4.weight"):
        grad = pipe.get_parameter(name).grad
        assert grad is not None
        assert not torch.isfinite(grad).all(), name


def test_hooks_on_tied_sparse_embeddings_run_on_the_whole_gradient() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        first, second = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
        second.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), Lookup(second))

    class Lookup(nn.Module):
        def __init__(self, embedding: nn.Embedding) -> None:
            super().__init__()
            self.embedding = embedding

        def forward(self, x: Tensor) -> Tensor:
            return x.sum(-1) + self.embedding(torch.arange(3)).sum()

    ids, target = torch.randint(0, 10, (8, 5)), torch.randn(8, 5)
    plain = model()
    for p in plain.parameters():
        p.register_hook(lambda grad: grad * 0.5)
    F.mse_loss(plain(ids), target).backward()
    pipe = GPipe(model(), [1, 2], chunks=4)
    for p in pipe.parameters():
        p.register_hook(lambda grad: grad * 0.5)
    Schedule1F1B(pipe, F.mse_loss).step(ids, target)
    expected = plain[0].weight.grad
    assert expected is not None
    for p in (pipe[0].weight, pipe[2].embedding.weight):
        assert p.grad is not None
        torch.testing.assert_close(p.grad.to_dense(), expected.to_dense())


def test_a_hook_removed_during_a_step_stays_removed() -> None:
    pipe = GPipe(_model(), [2, 3], chunks=4)
    calls: list[int] = []
    handle = pipe[2].weight.register_hook(lambda grad: calls.append(1))

    def remove(*_: Any) -> None:
        handle.remove()

    pipe[0].register_forward_pre_hook(remove)
    driver = ScheduleGPipe(pipe, F.mse_loss)
    for _ in range(2):
        driver.step(*_batch())
    assert calls == []
    assert not pipe[2].weight._backward_hooks


def test_a_first_gradient_is_the_stages_tensor_or_laid_out_as_the_parameter() -> None:
    pipe = GPipe(_model(), [2, 3], chunks=2)
    pipe[0].weight.register_hook(lambda grad: grad.t().contiguous().t())  # another layout
    pipe[2].weight.register_hook(lambda grad: None)
    ScheduleGPipe(pipe, F.mse_loss).step(*_batch())
    for p in (pipe[0].weight, pipe[2].weight):
        assert p.grad is not None
        assert p.grad.stride() == p.stride()


def test_a_hooked_gradient_keeps_the_layout_of_a_parameter_laid_out_otherwise() -> None:
    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3).t())  # shape (3, 4), strides (1, 3)

        def forward(self, x: Tensor) -> Tensor:
            return x @ self.w

    conv = nn.Conv3d(2, 3, 2).to(memory_format=torch.channels_last_3d)
    pipe = GPipe(nn.Sequential(conv, nn.Flatten(), Transposed()), [1, 2], chunks=2)
    for p in pipe.parameters():
        p.register_hook(lambda grad: grad * 2)
    ScheduleGPipe(pipe, F.mse_loss).step(torch.randn(4, 2, 2, 2, 2), torch.randn(4, 4))
    for name, p in pipe.named_parameters():
        assert p.grad is not None
        assert p.grad.stride() == p.stride(), name


def test_a_gpipe_inside_a_steps_partition_leaves_an_unreached_parameter_alone() -> None:
    class Cut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return x + self.lin(x).detach()  # lin never gets a gradient

    inner = GPipe(nn.Sequential(Cut(), nn.Tanh()), [1, 1], chunks=2)
    outer = GPipe(nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 3)), [1, 1, 1], chunks=2)
    called: list[str] = []
    for name, p in outer.named_parameters():
        p.register_hook(lambda grad, name=name: called.append(name))
    ScheduleGPipe(outer, F.mse_loss).step(*_batch())
    lin = inner[0].lin
    assert lin.weight.grad is None
    assert sorted(called) == ["0.bias", "0.weight", "2.bias", "2.weight"]


# Two threads, one GPipe: while one backward or step has the hooks set aside, another
# must wait, not find the hooks silent and call them per micro-batch (or with None).


class _Gate:
    """Stops the first backward through a :class:`_Gated` layer until the test opens it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wait(self) -> None:
        self.entered.set()
        if not self.opened.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")


class _Gated(nn.Module):
    """Identity; its backward waits at the gate."""

    def __init__(self, gate: _Gate) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: Tensor) -> Tensor:
        return OnBackward.apply(x, self.gate.wait)  # type: ignore[no-any-return]


def _gated_pair(gate: _Gate) -> tuple[nn.Sequential, GPipe]:
    """A plain model and the GPipe of a copy of it whose partition 0 waits at ``gate``."""
    plain = _model()
    layers = copy.deepcopy(plain)
    layers[3] = nn.Sequential(nn.Tanh(), _Gated(gate))  # what plain[3] computes
    return plain, GPipe(layers, [4, 1], chunks=2)


def _in_thread(fn: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    def target() -> None:
        try:
            fn()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _joined(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a backward or step never finished"


def _plain_grad(plain: nn.Module, loss: Callable[[nn.Module], Tensor], name: str) -> Tensor:
    (grad,) = torch.autograd.grad(loss(plain), dict(plain.named_parameters())[name])
    return grad


def test_two_threads_backward_through_one_gpipe_each_calls_a_hook_once() -> None:
    gate = _Gate()
    plain, pipe = _gated_pair(gate)
    seen: list[Tensor] = []
    pipe[0].bias.register_hook(lambda grad: seen.append(grad.clone()))
    pipe[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    (xa, _), (xb, _) = _batch(), (torch.randn(8, 4), None)
    out_a, out_b = pipe(xa), pipe(xb)
    reached = threading.Event()
    loss_b = OnBackward.apply(out_b, reached.set).sum()
    errors: list[BaseException] = []
    a = _in_thread(out_a.sum().backward, errors)
    assert gate.entered.wait(timeout=60)  # A's stages run, with the hooks set aside
    b = _in_thread(loss_b.backward, errors)
    assert reached.wait(timeout=60)  # B's engine goes on to the GPipe's node
    gate.opened.set()
    _joined(a, b)
    assert errors == []

    def bias(x: Tensor) -> Tensor:
        return _plain_grad(plain, lambda m: m(x).sum(), "0.bias")

    weight_a = _plain_grad(plain, lambda m: m(xa).sum(), "0.weight")
    weight_b = _plain_grad(plain, lambda m: m(xb).sum(), "0.weight")
    # A's backward, then B's: each hook once, with the backward's whole gradient.
    expected = [bias(xa), weight_a, bias(xb), weight_a + weight_b]
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_two_threads_stepping_one_gpipe_each_call_a_hook_once() -> None:
    gate = _Gate()
    plain, pipe = _gated_pair(gate)
    seen: list[Tensor] = []
    pipe[0].bias.register_hook(lambda grad: seen.append(grad.clone()))
    schedule = ScheduleGPipe(pipe, F.mse_loss)
    (xa, ya), (xb, yb) = _batch(), (torch.randn(8, 4), torch.randn(8, 3))
    errors: list[BaseException] = []
    a = _in_thread(lambda: schedule.step(xa, ya), errors)
    assert gate.entered.wait(timeout=60)  # A's stages run, with the hooks set aside
    started = threading.Event()
    b = _in_thread(lambda: (started.set(), schedule.step(xb, yb)), errors)
    assert started.wait(timeout=60)
    gate.opened.set()
    _joined(a, b)
    assert errors == []
    expected = [
        _plain_grad(plain, lambda m: F.mse_loss(m(xa), ya), "0.bias"),
        _plain_grad(plain, lambda m: F.mse_loss(m(xb), yb), "0.bias"),
    ]
    assert len(seen) == 2
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _bias_term(pipe: GPipe, gate: _Gate | None = None) -> Tensor:
    """A term of the loss that uses ``pipe[0].bias`` outside the GPipe, made before it.

    The engine runs it after the GPipe's node (made later), and only then accumulates
    the bias's gradient: the bias's gradient handed by the node waits for it. Its
    backward waits at ``gate``, or raises without one.
    """
    if gate is None:
        return BackwardFails.apply(pipe[0].bias).sum()  # type: ignore[no-any-return]
    return OnBackward.apply(pipe[0].bias * 1.0, gate.wait).sum()  # type: ignore[no-any-return]


def test_a_gradient_the_engine_has_yet_to_take_in_holds_the_gpipe() -> None:
    # A's node has handed the bias's gradient to the engine, which adds another before
    # it accumulates it and calls the hook: B's backward must not set the bias aside
    # meanwhile. The test gives B a second to show it would not wait.
    _, pipe = _gated_pair(_Gate())
    pipe[3][1].gate.opened.set()
    seen: list[str] = []
    pipe[0].bias.register_hook(lambda grad: seen.append(threading.current_thread().name))
    gate, reached, hooked_b = _Gate(), threading.Event(), threading.Event()
    term = _bias_term(pipe, gate)
    loss_a = pipe(torch.randn(8, 4)).sum() + term
    loss_b = OnBackward.apply(pipe(torch.randn(8, 4)), reached.set).sum()
    errors: list[BaseException] = []
    a = _in_thread(loss_a.backward, errors)
    assert gate.entered.wait(timeout=60)  # A's node is done; the bias's gradient waits
    b = _in_thread(lambda: (loss_b.backward(), hooked_b.set()), errors)
    assert reached.wait(timeout=60)
    assert not hooked_b.wait(timeout=1)  # B waits for A's engine
    gate.opened.set()
    _joined(a, b)
    assert errors == []
    assert seen == [a.name, b.name]


def test_a_backward_that_fails_after_the_gpipes_node_lets_go_of_it() -> None:
    # The engine drops the gradient the node handed it: the GPipe is let go of anyway.
    plain, pipe = _gated_pair(_Gate())
    pipe[3][1].gate.opened.set()
    seen: list[Tensor] = []
    pipe[0].bias.register_hook(lambda grad: seen.append(grad.clone()))
    term = _bias_term(pipe)
    with pytest.raises(ArithmeticError, match="in backward"):  # the node after the GPipe's
        (pipe(torch.randn(8, 4)).sum() + term).backward()
    assert seen == []  # as in the plain model: the bias's gradient was never accumulated
    x = torch.randn(8, 4)
    errors: list[BaseException] = []
    _joined(_in_thread(pipe(x).sum().backward, errors))  # another thread: no owner's way in
    assert errors == []
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], _plain_grad(plain, lambda m: m(x).sum(), "0.bias"))


@pytest.mark.parametrize("how", ["backward", "step"])
def test_a_backward_or_step_that_fails_in_the_stages_lets_go_of_the_gpipe(how: str) -> None:
    gate = _Gate()
    plain, pipe = _gated_pair(gate)
    seen: list[Tensor] = []
    pipe[0].bias.register_hook(lambda grad: seen.append(grad.clone()))
    gate.opened.set()
    x, y = _batch()
    pipe[3][1].gate = None  # type: ignore[assignment]  # its backward now raises
    if how == "backward":
        with pytest.raises(AttributeError, match="wait"):
            pipe(x).sum().backward()
    else:
        with pytest.raises(AttributeError, match="wait"):
            ScheduleGPipe(pipe, F.mse_loss).step(x, y)
    assert seen == []
    pipe[3][1].gate = gate
    errors: list[BaseException] = []
    _joined(_in_thread(pipe(x).sum().backward, errors))
    assert errors == []
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], _plain_grad(plain, lambda m: m(x).sum(), "0.bias"))


def test_a_step_whose_input_comes_from_a_gpipe_holding_it_runs_each_hook_once() -> None:
    # The step holds `inner` while its backward goes on into the caller's graph, where
    # `outer`'s worker reaches `inner` again (it is a layer of `outer`): that worker
    # works for the step, and goes in rather than wait for it.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    layers = copy.deepcopy(plain)
    inner = GPipe(layers[1], [1, 1], chunks=2)
    outer = GPipe(nn.Sequential(layers[0], inner), [1, 1], chunks=2)
    calls: dict[str, list[Tensor]] = {"plain": [], "gpipe": []}
    for name, weight in (("plain", plain[1][0].weight), ("gpipe", inner[0].weight)):
        weight.register_hook(lambda grad, name=name: calls[name].append(grad.clone()))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    F.mse_loss(plain[1](plain(x)), y).backward()
    errors: list[BaseException] = []
    _joined(_in_thread(lambda: ScheduleGPipe(inner, F.mse_loss).step(outer(x), y), errors))
    assert errors == []
    assert len(calls["gpipe"]) == len(calls["plain"]) == 1
    torch.testing.assert_close(calls["gpipe"][0], calls["plain"][0], rtol=1e-5, atol=1e-6)
    _assert_grads(outer, plain)


def test_two_threads_reaching_two_gpipes_in_opposite_orders_both_finish() -> None:
    # The bug: a backward keeps its GPipe held until the engine takes in the gradients
    # it handed; with a hold per GPipe, thread A kept g2's (g2 called twice, the second
    # node still to come) and waited for g1's, which thread B kept, waiting for g2's.
    # One hold for every GPipe: B waits for A's before it takes any.
    torch.manual_seed(0)
    g1, g2 = (
        GPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), [1, 1], chunks=4) for _ in "12"
    )
    params = [*g1.parameters(), *g2.parameters()]
    reached = {"a": threading.Event(), "b": threading.Event()}

    def meet(me: str) -> None:
        """Between a thread's first and second GPipe node: wait (boundedly) for the other."""
        reached[me].set()
        reached["b" if me == "a" else "a"].wait(timeout=2)

    def backward(me: str, first: GPipe, second: GPipe) -> None:
        x = torch.randn(8, 8)
        loss = first(OnBackward.apply(second(first(x)), partial(meet, me))).sum()
        loss.backward(inputs=params)  # every gradient handed to the engine: holds kept

    threads = [
        threading.Thread(target=backward, args=("a", g2, g1), daemon=True),
        threading.Thread(target=backward, args=("b", g1, g2), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"


def test_a_hook_that_keeps_its_gradient_keeps_it_unchanged_after_the_step() -> None:
    # Regression: .grad was the very tensor the hook kept, so a clip or a second,
    # accumulating step rewrote what the hook had logged; the engine copies there.
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), [2, 1], chunks=2)
    logged: list[torch.Tensor] = []
    model[0].weight.register_hook(logged.append)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    Schedule1F1B(model, nn.functional.mse_loss).step(x, y)
    kept = logged[0].clone()
    assert logged[0] is not model[0].weight.grad
    model.clip_grad_norm_(1e-3)
    Schedule1F1B(model, nn.functional.mse_loss).step(x, y)
    torch.testing.assert_close(logged[0], kept, rtol=0, atol=0)


def test_a_step_whose_output_cannot_be_joined_leaves_every_gradient_in_place() -> None:
    # Regression: the join ran inside the step's hooks and ties, so its failure put a
    # hooked parameter's .grad back to None and left a tied weight's copies unsummed,
    # where the README says .grad then holds the step's gradients.
    class Sized(nn.Module):
        def forward(self, h: Tensor) -> tuple[Tensor, int]:
            return h, h.shape[0]  # a number that differs between micro-batches

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        embedding, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        head.weight = embedding.weight
        return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), head, Sized())

    def loss(output: tuple[Tensor, int], target: Tensor) -> Tensor:
        return F.cross_entropy(output[0], target)

    ids, y = torch.randint(0, 10, (10,)), torch.randint(0, 10, (10,))  # 3, 3, 2, 2
    plain = build()
    loss(plain(ids), y).backward()
    pipe = GPipe(build(), balance=[2, 1, 2], chunks=4)
    pipe[1].weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="output\\[1\\] is 3 in micro-batch 0 but 2"):
        Schedule1F1B(pipe, loss).step(ids, y)
    expected = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters(remove_duplicate=False):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected[name].grad)
