"""A tied weight in a call that torch.func.functional_call gives tensors of its own."""

from __future__ import annotations

import copy

import pytest
import torch
from test_tied import VOCAB, WIDTH, _language_model
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from torchgpipe import GPipe, split, tied_given


def _given(model: nn.Module) -> dict[str, Tensor]:
    """The plain model's parameters, each once, as new leaves with other values."""
    return {k: (2 * v.detach()).requires_grad_() for k, v in model.named_parameters()}


def _ids() -> Tensor:
    return torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, params: dict[str, Tensor]) -> Tensor:
    return functional_call(model, params, (_ids(),)).square().sum()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_the_plain_models_names_give_the_weight_to_every_partition(checkpoint: str) -> None:
    # The bug: given the plain model's one name of the tied weight, functional_call
    # replaced the first partition's copy alone; the head computed with the old weight,
    # and the ties' sum wrote the head's gradient into the pipeline's own copies.
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    expected, got = _given(plain), _given(plain)
    assert list(got) == ["0.weight", "2.weight", "2.bias"]
    _loss(plain, expected).backward()
    _loss(pipe, got).backward()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name].grad, tensor.grad, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in pipe.parameters())
    # The copies are back in their slots, equal, and summed as before.
    assert pipe[0].weight is not pipe[4].weight
    assert isinstance(pipe[4].weight, nn.Parameter)
    torch.testing.assert_close(pipe[0].weight, pipe[4].weight, rtol=0, atol=0)
    F.cross_entropy(pipe(_ids()), torch.arange(8) % VOCAB).backward()
    F.cross_entropy(plain(_ids()), torch.arange(8) % VOCAB).backward()
    for copy_ in (pipe[0].weight, pipe[4].weight):
        torch.testing.assert_close(copy_.grad, plain[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_a_split_models_weight_given_under_its_first_name_reaches_every_stage() -> None:
    plain = _language_model()
    pipe = GPipe(split(copy.deepcopy(plain), _ids(), stages=2), [1, 1], chunks=4)
    expected = _given(plain)
    _loss(plain, expected).backward()
    names = dict(pipe.named_parameters())  # a copy per stage: given the first only
    owner = next(k for k, p in names.items() if p is pipe[0].get_parameter("0.weight"))
    got = {k: (2 * v.detach()).requires_grad_() for k, v in names.items()}
    head = [k for k in got if k != owner and got[k].shape == (VOCAB, WIDTH)]
    assert len(head) == 1
    del got[head[0]]
    out = functional_call(pipe, got, (_ids(),))
    torch.testing.assert_close(out, functional_call(plain, expected, (_ids(),)))
    out.square().sum().backward()
    torch.testing.assert_close(got[owner].grad, expected["0.weight"].grad, rtol=1e-5, atol=1e-5)


def test_one_tensor_under_every_name_gets_every_uses_gradient_once() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    expected, got = _given(plain), _given(plain)
    _loss(plain, expected).backward()
    _loss(pipe, {**got, "4.weight": got["0.weight"]}).backward()
    grad, want = got["0.weight"].grad, expected["0.weight"].grad
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in pipe.parameters())


def test_a_tensor_per_copy_gets_its_partitions_uses_only() -> None:
    # dict(pipe.named_parameters()) names each copy: given one tensor each, each
    # partition computes with its own; the caller's tensors are not the pipeline's
    # copies, and are not summed (their gradients add up to the weight's).
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    expected = _given(plain)
    _loss(plain, expected).backward()
    got = {k: (2 * v.detach()).requires_grad_() for k, v in pipe.named_parameters()}
    assert set(got) == {"0.weight", "2.weight", "2.bias", "4.weight"}
    _loss(pipe, got).backward()
    first, head = got["0.weight"].grad, got["4.weight"].grad
    assert first is not None
    assert head is not None
    assert not torch.allclose(first, expected["0.weight"].grad)  # type: ignore[arg-type]
    torch.testing.assert_close(first + head, expected["0.weight"].grad, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in pipe.parameters())


def test_several_tensors_for_some_copies_only_are_refused() -> None:
    class Project(nn.Module):  # uses the tied weight in a middle partition
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: Tensor) -> Tensor:
            return x @ self.weight.t() @ self.weight

    model = _language_model()
    model.insert(3, Project(model[0].weight))
    pipe = GPipe(model, [2, 2, 2], chunks=2)
    got = {k: (2 * v.detach()).requires_grad_() for k, v in pipe.named_parameters()}
    del got["5.weight"]  # the head's copy: which of the two given would it take?
    with pytest.raises(ValueError, match=r"tied weight 0\.weight .* 2 different tensors"):
        functional_call(pipe, got, (_ids(),))
    assert all(isinstance(p, nn.Parameter) for p in pipe.parameters())
    pipe(_ids()).sum().backward()  # the pipeline as it was


def test_copies_replaced_for_good_by_a_conversion_are_summed_from_then_on() -> None:
    # Under this flag, module.double() puts new parameters in every slot: they are the
    # copies now, not a call's given tensors, and the sum goes on over them.
    plain, pipe = _language_model().double(), GPipe(_language_model(), [2, 3], chunks=4)
    before = pipe[4].weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        pipe.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert pipe[4].weight is not before
    target = torch.arange(8) % VOCAB
    F.cross_entropy(plain(_ids()), target).backward()
    F.cross_entropy(pipe(_ids()), target).backward()
    for copy_ in (pipe[0].weight, pipe[4].weight):
        torch.testing.assert_close(copy_.grad, plain[0].weight.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_weight_given_reaches_a_partition_on_another_device_as_a_copy(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On two GPUs the head's slot takes the given tensor copied to its device: a tensor
    # with a node, which a checkpointed cell's recomputation uses again (refused for
    # parameters computed from others). The copy to another device, made here on one.
    def elsewhere(one: Tensor, device: torch.device) -> Tensor:
        made = one.to(device, copy=True)
        tied_given._MOVED[made] = True
        return made

    monkeypatch.setattr(tied_given, "moved", elsewhere)
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    expected, got = _given(plain), _given(plain)
    _loss(plain, expected).backward()
    _loss(pipe, got).backward()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name].grad, tensor.grad, rtol=1e-5, atol=1e-5)
    assert isinstance(pipe[4].weight, nn.Parameter)


def test_a_copy_replaced_by_a_parameter_by_hand_is_the_copy_from_then_on() -> None:
    # A module takes a parameter only, never a call's plain tensor: assigned by hand,
    # it is what the ties keep (the embedding keeps its own weight, as it did).
    pipe = GPipe(_language_model(), [2, 3], chunks=4)
    embedding = pipe[0].weight
    new = nn.Parameter(torch.randn(VOCAB, WIDTH))
    pipe[4].weight = new
    pipe(_ids()).sum().backward()
    assert pipe[0].weight is embedding
    assert pipe[4].weight is new
    assert new.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_weight_given_on_the_cpu_reaches_a_partition_on_a_gpu(checkpoint: str) -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], devices=["cpu", "cuda:0"], chunks=4,
                 checkpoint=checkpoint)  # type: ignore[arg-type]  # fmt: skip
    expected, got = _given(plain), _given(plain)
    _loss(plain, expected).backward()
    functional_call(pipe, got, (_ids(),)).square().sum().backward()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name].grad, tensor.grad, rtol=1e-4, atol=1e-4)
    assert pipe[4].weight.device.type == "cuda"


class _TwoHeads(nn.Module):
    """Two uses of the tied weight in one partition: one copy there, in two modules."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.a, self.b = (nn.Linear(WIDTH, VOCAB, bias=False) for _ in range(2))
        self.a.weight = self.b.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.b(torch.tanh(x))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_every_module_of_a_partition_holding_the_copy_gets_the_weight(checkpoint: str) -> None:
    # The bug: the ties knew one holder of each copy; the second module of the last
    # partition computed with the old copy.
    model = _language_model()
    model[4] = _TwoHeads(model[0].weight)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 3], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    expected, got = _given(plain), _given(plain)
    _loss(plain, expected).backward()
    _loss(pipe, got).backward()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name].grad, tensor.grad, rtol=1e-5, atol=1e-5)
    assert pipe[4].a.weight is pipe[4].b.weight
    assert all(p.grad is None for p in pipe.parameters())


def test_a_call_right_after_a_conversion_gives_the_weight_to_the_new_copies() -> None:
    # The copies replaced by new parameters and, before any plain forward, a call that
    # gives the weight: the new head's copy takes it.
    plain, pipe = _language_model().double(), GPipe(_language_model(), [2, 3], chunks=4)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        pipe.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    expected, got = _given(plain), _given(plain)
    _loss(plain, expected).backward()
    _loss(pipe, got).backward()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name].grad, tensor.grad, rtol=1e-9, atol=1e-9)
