"""Backward of ``model(x)`` that asks for some tensors only: ``inputs=``, ``autograd.grad``.

Each test compares a GPipe with the plain ``nn.Sequential`` it wraps, with gradients
already in ``.grad`` (a second backward accumulates): the tensors named get the plain
model's gradient added, the others keep their ``.grad`` untouched (None or the tensor).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_training import FailsBackward
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe

CHECKPOINTS = ["always", "except_last", "never"]
CASES = ["param", "input", "param_and_input", "grad_params", "grad_input"]

# Every test that takes ``backward_by`` runs both ways ``model(x)``'s backward can go:
# on the partitions' threads (CPU), and in PyTorch's engine (GPU partitions), where a
# checkpointed cell's node has its parameters as inputs and hands their gradients to the
# engine like the plain model's graph does.


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


def _prime(model: nn.Module, x: Tensor) -> None:
    """Earlier gradients, alike in both models: all but the first bias hold one."""
    for k, p in enumerate(model.parameters()):
        p.grad = None if k == 1 else torch.full_like(p, 0.25 * (k + 1))
    x.grad = torch.full_like(x, -0.5)


def _grads(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _run(
    model: nn.Module, case: str, x: Tensor, pick: Callable[[nn.Module], list[Tensor]]
) -> tuple[Any, list[Tensor | None], Tensor | None]:
    """Do ``case`` on ``model``; what it returned, then every ``.grad`` and ``x.grad``."""
    weight = torch.linspace(-1, 1, 3)
    loss = (model(x) * weight).square().sum()
    returned: Any = None
    if case == "param":
        loss.backward(inputs=pick(model))
    elif case == "input":
        loss.backward(inputs=[x])
    elif case == "param_and_input":
        loss.backward(inputs=[*pick(model), x])
    elif case == "grad_params":
        returned = torch.autograd.grad(loss, pick(model))
    else:
        returned = torch.autograd.grad(loss, x)
    return returned, _grads(model), None if x.grad is None else x.grad.clone()


def _assert_same(got: Any, expected: Any) -> None:
    if expected is None or got is None:
        assert got is None
        assert expected is None
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            _assert_same(a, b)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _p(model: Any, k: int, name: str = "weight") -> Tensor:
    """Parameter ``name`` of layer ``k``."""
    p = getattr(model[k], name)
    assert isinstance(p, Tensor)
    return p


def _equal(a: Tensor | None, b: Tensor | None) -> bool:
    return a is not None and b is not None and torch.equal(a, b)


def _last_weight_and_first_bias(model: nn.Module) -> list[Tensor]:
    return [_p(model, 4), _p(model, 0, "bias")]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("case", CASES)
def test_backward_inputs_match_the_plain_model(
    case: str, checkpoint: str, backward_by: str
) -> None:
    plain = _layers()
    model = GPipe(copy.deepcopy(plain), [2, 2, 1], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(6, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    _prime(plain, y)
    _prime(model, x)
    expected = _run(plain, case, y, _last_weight_and_first_bias)
    got = _run(model, case, x, _last_weight_and_first_bias)
    _assert_same(got, expected)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_backward_inputs_every_parameter_matches_a_plain_backward(
    checkpoint: str, backward_by: str
) -> None:
    model = GPipe(_layers(), [2, 2, 1], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    twin = copy.deepcopy(model)
    x = torch.randn(6, 4)
    _prime(model, x.clone())
    _prime(twin, x.clone())
    model(x).square().sum().backward(inputs=list(model.parameters()))
    twin(x).square().sum().backward()
    _assert_same(_grads(model), _grads(twin))


def test_backward_inputs_a_gan_step_fills_the_generator_only() -> None:
    # The discriminator's loss backward through the generator: inputs= names the
    # generator's parameters; the discriminator, a GPipe too, is left as it was.
    generator = GPipe(_layers(), [2, 3], chunks=2)
    discriminator = GPipe(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), [2, 1])
    plain_g, plain_d = copy.deepcopy(generator), copy.deepcopy(discriminator)
    z = torch.randn(4, 4)
    loss = discriminator(generator(z)).mean()
    loss.backward(inputs=list(generator.parameters()))
    assert all(p.grad is None for p in discriminator.parameters())
    plain_loss = nn.Sequential(*plain_d)(nn.Sequential(*plain_g)(z)).mean()
    plain_loss.backward(inputs=list(plain_g.parameters()))
    _assert_same(_grads(generator), _grads(plain_g))


def test_backward_inputs_a_second_backward_is_still_refused() -> None:
    model = GPipe(_layers(), [2, 3], chunks=2)
    loss = model(torch.randn(4, 4)).sum()
    loss.backward(inputs=[_p(model, 0)], retain_graph=True)
    with pytest.raises(RuntimeError, match=r"ran twice.*Run the forward again"):
        loss.backward(inputs=[_p(model, 0)])


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("how", ["backward", "inputs", "grad"])
def test_backward_inputs_a_hook_runs_once_with_the_whole_gradient(
    how: str, checkpoint: str
) -> None:
    plain = _layers()
    model = GPipe(copy.deepcopy(plain), [2, 3], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    calls: dict[str, list[Tensor]] = {"plain": [], "gpipe": []}
    after: dict[str, int] = {"plain": 0, "gpipe": 0}

    def watch(name: str, layers: nn.Module) -> None:
        def hook(grad: Tensor) -> Tensor:
            calls[name].append(grad)
            return grad * 2

        def counted(_: Tensor) -> None:
            after[name] += 1

        _p(layers, 2).register_hook(hook)
        _p(layers, 2).register_post_accumulate_grad_hook(counted)

    watch("plain", plain)
    watch("gpipe", model)
    x = torch.randn(6, 4)
    results: dict[str, tuple[Tensor, ...]] = {}
    layers: nn.Module
    for name, layers in (("plain", plain), ("gpipe", model)):
        loss = layers(x).square().sum()
        if how == "backward":
            loss.backward()
        elif how == "inputs":
            loss.backward(inputs=[_p(layers, 2)])
        else:
            results[name] = torch.autograd.grad(loss, [_p(layers, 2)])
    assert len(calls["gpipe"]) == len(calls["plain"]) == 1
    torch.testing.assert_close(calls["gpipe"][0], calls["plain"][0])
    assert after["gpipe"] == after["plain"]
    _assert_same(results.get("gpipe"), results.get("plain"))
    _assert_same(_grads(model), _grads(plain))


@pytest.mark.parametrize("how", ["inputs", "grad"])
def test_backward_inputs_reaching_a_checkpointed_cell_with_hooked_parameters_is_refused(
    how: str, engine_backward: None
) -> None:
    # The engine's way: such a cell keeps its parameters out of its node (a plain
    # backward accumulates them itself, running their hooks per micro-batch).
    model = GPipe(_layers(), [2, 3], chunks=3, checkpoint="always")
    _p(model, 2).register_hook(lambda grad: grad)
    x = torch.randn(6, 4, requires_grad=True)
    loss = model(x).square().sum()
    run = (
        (lambda: loss.backward(inputs=[x]))
        if how == "inputs"
        else (lambda: torch.autograd.grad(loss, [x]))
    )
    with pytest.raises(RuntimeError, match=r"reached the checkpointed cell 1B2.*hooks"):
        run()


def test_backward_inputs_naming_an_unhooked_parameter_beside_a_hooked_one_is_refused(
    engine_backward: None,
) -> None:
    # The cell kept every parameter out of its node where one had a hook: a backward
    # naming another parameter of it never reached the cell, and left its .grad None,
    # silently. The unhooked ones are inputs of the node now: it is reached, and refused.
    model = GPipe(_layers(), [2, 3], chunks=3, checkpoint="always")
    hooked, other = [p for p in model.partitions[1].parameters()][:2]
    hooked.register_hook(lambda grad: grad)
    loss = model(torch.randn(6, 4)).square().sum()
    with pytest.raises(RuntimeError, match=r"reached the checkpointed cell 1B2.*hooks"):
        loss.backward(inputs=[other])


class _Scaled(nn.Module):
    """A linear map times a tensor that is not a registered parameter (kept in a list)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.kept = [torch.tensor(1.5, requires_grad=True)]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.kept[0]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_backward_inputs_a_plain_backward_reaches_tensors_that_are_not_parameters(
    checkpoint: str, backward_by: str
) -> None:
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(_Scaled(), nn.Tanh()), [1, 1], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    plain = nn.Sequential(_Scaled(), nn.Tanh())
    plain.load_state_dict(model.state_dict())
    x = torch.randn(6, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(model[0].kept[0].grad, plain[0].kept[0].grad)


class Unused(nn.Module):
    """Identity, with a parameter the forward does not use."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Parameter(torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        return x


@pytest.mark.parametrize("how", ["backward", "inputs"])
def test_backward_inputs_a_hooked_parameter_the_forward_left_unused(how: str) -> None:
    # Given None, the engine would call its hook with None; it gets zeros instead (the
    # plain model calls no hook and leaves .grad None: the one difference, see README).
    model = GPipe(nn.Sequential(nn.Linear(4, 4), Unused()), [1, 1], chunks=2)
    spare = _p(model, 1, "spare")
    seen: list[Tensor] = []
    spare.register_hook(lambda grad: seen.append(grad))
    loss = model(torch.randn(4, 4)).sum()
    if how == "backward":
        loss.backward()
    else:
        loss.backward(inputs=[spare, _p(model, 0)])
    assert len(seen) == 1
    assert torch.equal(seen[0], torch.zeros(2))
    assert spare.grad is not None
    assert torch.equal(spare.grad, torch.zeros(2))
    (spare * 3).sum().backward()  # its hook is back
    assert len(seen) == 2
    assert torch.equal(spare.grad, torch.full((2,), 3.0))


class _BigOnly(nn.Module):
    """A layer whose parameter a small batch leaves unused (an expert given no tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) if x.shape[0] > 4 else x * 2


@pytest.mark.parametrize("how", ["backward", "inputs"])
@pytest.mark.parametrize("order", ["big first", "small first"])
def test_backward_inputs_a_hooked_parameter_used_in_one_call_of_two(how: str, order: str) -> None:
    # The model called twice in one loss, the parameter used in one call only: the hook
    # runs once, with the whole gradient, as in the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _BigOnly())
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=1)
    big, small = torch.randn(8, 4), torch.randn(3, 4)
    first, second = (big, small) if order == "big first" else (small, big)
    calls: dict[str, list[Tensor]] = {"plain": [], "gpipe": []}
    for name, layers in (("plain", plain), ("gpipe", model)):
        weight = layers[2].linear.weight
        weight.register_hook(lambda grad, name=name: calls[name].append(grad.clone()))
        loss = layers(first).square().sum() + layers(second).square().sum()
        if how == "backward":
            loss.backward()
        else:
            loss.backward(inputs=list(layers.parameters()))
    assert len(calls["gpipe"]) == len(calls["plain"]) == 1
    torch.testing.assert_close(calls["gpipe"][0], calls["plain"][0])
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


class Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def _language_model() -> nn.Sequential:
    """Embedding, a body, and an output head tied to the embedding (as in test_tied)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, Mean(), nn.Linear(6, 6), nn.Tanh(), head)


def _tied() -> tuple[nn.Sequential, GPipe, Tensor, Tensor]:
    """A tied model, plain and wrapped, after a first backward; its data."""
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=2)
    ids = torch.randint(0, 11, (8, 5))
    target = torch.randint(0, 11, (8,))
    for model in (plain, pipe):
        _loss(model, ids, target).backward()
    return plain, pipe, ids, target


def _loss(model: nn.Module, ids: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(model(ids), target)


def test_backward_inputs_tied_weights_every_copy_named() -> None:
    plain, pipe, ids, target = _tied()
    _loss(plain, ids, target).backward(inputs=list(plain.parameters()))
    _loss(pipe, ids, target).backward(inputs=list(pipe.parameters()))
    torch.testing.assert_close(_p(pipe, 0).grad, _p(plain, 0).grad)
    assert _equal(_p(pipe, 4).grad, _p(pipe, 0).grad)
    torch.testing.assert_close(_p(pipe, 2).grad, _p(plain, 2).grad)


def test_backward_inputs_tied_weights_left_out_stay_as_they_were() -> None:
    plain, pipe, ids, target = _tied()
    before = _grads(pipe)
    _loss(plain, ids, target).backward(inputs=[_p(plain, 2)])
    _loss(pipe, ids, target).backward(inputs=[_p(pipe, 2)])
    torch.testing.assert_close(_p(pipe, 2).grad, _p(plain, 2).grad)
    assert _equal(_p(pipe, 0).grad, before[0])
    assert _equal(_p(pipe, 4).grad, before[0])


@pytest.mark.parametrize("named", [0, 4])
def test_backward_inputs_one_copy_of_a_tied_weight_is_refused(named: int) -> None:
    _, pipe, ids, target = _tied()
    left_out = _p(pipe, 4 - named)
    grad = left_out.grad
    assert grad is not None
    value = grad.clone()
    with pytest.raises(RuntimeError, match=r"tied weight.*[Nn]ame every copy"):
        _loss(pipe, ids, target).backward(inputs=[_p(pipe, named)])
    assert left_out.grad is grad  # the copy left out gets its .grad back, as it was
    assert torch.equal(grad, value)


def test_backward_inputs_autograd_grad_of_a_tied_weight_is_refused(backward_by: str) -> None:
    # The engine's way (GPUs) took it, and the sum at the end wrote the copies' .grad.
    _, pipe, ids, target = _tied()
    before = _grads(pipe)
    with pytest.raises(RuntimeError, match=r"tied weight.*torch.autograd.grad"):
        torch.autograd.grad(_loss(pipe, ids, target), [_p(pipe, 0)])
    _assert_same(_grads(pipe), before)


def test_backward_inputs_with_a_frozen_tied_weight(backward_by: str) -> None:
    # The check of the named copies asked a frozen weight's gradient edge, which torch
    # refuses ("does not require gradients"): every backward(inputs=...) failed.
    plain, pipe, ids, target = _tied()
    for model in (plain, pipe):
        model[0].weight.requires_grad_(False)
        model.zero_grad()
    _loss(pipe, ids, target).backward(inputs=[_p(pipe, 2)])
    _loss(plain, ids, target).backward(inputs=[plain[2].weight])
    torch.testing.assert_close(_p(pipe, 2).grad, plain[2].weight.grad)
    assert pipe[0].weight.grad is None


def test_backward_inputs_a_failing_backward_gives_every_grad_and_hook_back() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4), FailsBackward(), nn.Linear(4, 2)), [2, 1])
    weight = _p(model, 2)
    earlier = torch.ones_like(weight)
    weight.grad = earlier
    seen: list[Tensor] = []
    weight.register_hook(lambda grad: seen.append(grad))
    with pytest.raises(ArithmeticError, match="in backward"):
        model(torch.randn(4, 4)).sum().backward(inputs=[_p(model, 0), weight])
    assert weight.grad is earlier
    assert torch.equal(earlier, torch.ones_like(weight))
    assert _p(model, 0).grad is None
    (weight * 2).sum().backward()
    assert len(seen) == 1
