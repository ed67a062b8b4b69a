"""A layer swapped after wrapping: the forward, parameters() and state_dict() agree."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from torchgpipe import GPipe, ScheduleGPipe
from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.skip import pop, skippable, stash


def _named() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(body=nn.Linear(4, 4), act=nn.Tanh(), fc=nn.Linear(4, 3)))


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_layer_assigned_under_its_name_is_the_one_the_forward_runs(checkpoint: str) -> None:
    # Regression: the partitions kept the old layer: the forward ran it, while
    # parameters() held the new one, which an optimizer trained for nothing.
    plain = _named()
    model = GPipe(
        copy.deepcopy(plain), [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint
    )
    torch.manual_seed(1)
    head = nn.Linear(4, 5)
    old = model.fc
    model.fc = head
    plain.fc = copy.deepcopy(head)
    x = torch.randn(4, 4)
    torch.testing.assert_close(model(x), plain(x))
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert head.weight.grad is not None
    torch.testing.assert_close(_grads(model), _grads(plain))
    assert any(p is head.weight for p in model.parameters())
    assert not any(p is old.weight for p in model.parameters())
    assert model.partitions[1].fc is head
    assert model.state_dict()["fc.weight"].shape == (5, 4)


def test_a_layer_assigned_into_a_partition_alone_is_refused_saying_how() -> None:
    # parameters() would not hold it until a call: an optimizer made first would miss it.
    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"], chunks=2)
    old, head = model.fc, nn.Linear(4, 5)
    model.partitions[1][0] = head
    with pytest.raises(RuntimeError, match=r"'fc' was swapped in partition 1 alone: .*setattr"):
        model(torch.randn(4, 4))
    model.partitions[1][0] = old  # undone (the property does not refuse: the call does)
    assert model(torch.randn(4, 4)).shape == (4, 3)
    model.partitions[1][0] = head
    model.fc = head  # the same layer on both sides: the message's other way
    assert model(torch.randn(4, 4)).shape == (4, 5)
    assert any(p is head.weight for p in model.parameters())


def test_a_layer_assigned_where_another_layer_is_already_is_refused() -> None:
    # Used in two partitions, which construction refuses: under deferred batch norm two
    # workers updated one layer's statistics at once.
    model = GPipe(
        nn.Sequential(
            nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False), nn.Linear(3, 3), nn.Identity()
        ),
        [2, 2],
    )
    setattr(model, "3", model[1])
    with pytest.raises(
        RuntimeError, match="the new layer '3' is, or shares a tensor with, another"
    ):
        model(torch.randn(4, 3))


def test_an_injector_that_wraps_every_linear_trains_its_adapters() -> None:
    class Adapter(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.full((base.in_features, 2), 0.1))
            self.b = nn.Parameter(torch.full((2, base.out_features), 0.1))

        def forward(self, x: Tensor) -> Tensor:
            return self.base(x) + x @ self.a @ self.b

    def inject(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Adapter(child))

    plain = _named()
    model = GPipe(copy.deepcopy(plain), [1, 2], devices=["cpu", "cpu"], chunks=2)
    inject(model)
    inject(plain)
    for module in (model, plain):
        for name, p in module.named_parameters():
            p.requires_grad_(name.endswith((".a", ".b")))
    x = torch.randn(4, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(_grads(model), _grads(plain))
    assert len(_grads(model)) == 4


def test_a_schedule_steps_the_swapped_layer() -> None:
    plain = _named()
    model = GPipe(copy.deepcopy(plain), [2, 1], devices=["cpu", "cpu"], chunks=2)
    torch.manual_seed(2)
    model.body = nn.Linear(4, 4)
    plain.body = copy.deepcopy(model.body)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    ScheduleGPipe(model, nn.functional.mse_loss).step(x, y)
    nn.functional.mse_loss(plain(x), y).backward()
    torch.testing.assert_close(_grads(model), _grads(plain))


def test_modules_attached_later_are_not_layers() -> None:
    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    last = model[-1]
    model.criterion = nn.MSELoss()
    model.aux_head = nn.Linear(3, 1)
    assert len(model) == 3
    assert model[-1] is last
    assert [type(x) for x in model] == [nn.Linear, nn.Tanh, nn.Linear]
    assert list(model[0:3]._modules) == ["body", "act", "fc"]
    assert model(torch.randn(2, 4)).shape == (2, 3)


def test_deferred_batch_norm_follows_a_converted_layer_swapped_in() -> None:
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, deferred_batch_norm=True)
    norm = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(3))
    setattr(model, "1", norm)
    plain[1] = nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    model(x)
    plain(x)
    torch.testing.assert_close(norm.running_mean, plain[1].running_mean)
    torch.testing.assert_close(norm.running_var, plain[1].running_var)


@skippable(stash=["h"])
class _Stash(nn.Module):
    def forward(self, x: Tensor) -> Any:
        yield stash("h", x)
        return x


@skippable(pop=["h"])
class _Pop(nn.Module):
    def forward(self, x: Tensor) -> Any:
        return x + (yield pop("h"))


def _refusal(model: GPipe, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        model(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"build it again from your nn\.Sequential"):
        model(torch.randn(2, 4))


def test_swaps_the_pipeline_cannot_follow_are_refused() -> None:
    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    del model.fc
    _refusal(model, "layer 'fc' was removed")

    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    model.fc = nn.Linear(4, 3)
    model.partitions[1][0] = nn.Linear(4, 3)  # (the partitions follow model.fc first)
    _refusal(model, "swapped in partition 1 alone")

    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    model.fc = nn.Linear(4, 3, device="meta")
    _refusal(model, r"'fc' is on meta, its partition on cpu: move it there")

    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    model.fc = _Pop()
    _refusal(model, "skippable")

    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    shared = nn.Linear(4, 4)
    shared.weight = model.body.weight
    model.act = shared
    _refusal(model, "'act' is, or shares a tensor with, another layer")

    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    model.partitions[1].append(nn.Identity())
    _refusal(model, r"its partitions hold \{0: 2, 1: 2\} layers, built with \{0: 2, 1: 1\}")

    model = GPipe(
        nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), [1, 1], deferred_batch_norm=True
    )
    setattr(model, "1", nn.BatchNorm1d(3))
    with pytest.raises(RuntimeError, match="convert_deferred_batch_norm"):
        model(torch.randn(2, 3))


def test_a_layer_holding_a_tied_weight_is_not_swapped() -> None:
    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = GPipe(nn.Sequential(embedding, nn.Linear(4, 4), head), [1, 2])
    setattr(model, "2", nn.Linear(4, 10, bias=False))
    with pytest.raises(RuntimeError, match="layer '2' holds a weight tied to another layer"):
        model(torch.randint(0, 10, (2,)))


def test_a_skippable_pair_stays_as_built() -> None:
    model = GPipe(nn.Sequential(_Stash(), nn.Linear(4, 4), _Pop()), [1, 2])
    x = torch.randn(2, 4)
    expected = model(x)
    setattr(model, "0", _Stash())
    with pytest.raises(RuntimeError, match="layer '0' \\(old or new\\) is skippable"):
        model(x)
    assert expected.shape == (2, 4)


def test_a_removed_layer_leaves_the_others_indexable() -> None:
    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"])
    del model.act
    assert len(model) == 2
    assert list(model[:]._modules) == ["body", "fc"]
    assert [type(x) for x in model] == [nn.Linear, nn.Linear]
    with pytest.raises(RuntimeError, match="layer 'act' was removed"):
        model(torch.randn(2, 4))


def test_a_copy_of_a_model_refuses_to_swap_a_tied_holder_as_the_original_does() -> None:
    # Regression: the holders were kept by id, which a copy does not share.
    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = copy.deepcopy(GPipe(nn.Sequential(embedding, nn.Linear(4, 4), head), [1, 2]))
    setattr(model, "2", nn.Linear(4, 10, bias=False))
    with pytest.raises(RuntimeError, match="layer '2' holds a weight tied to another layer"):
        model(torch.randint(0, 10, (2,)))


def test_a_layer_equal_to_every_other_is_still_swapped() -> None:
    class EqualToAll(nn.Linear):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = nn.Linear.__hash__

    model = GPipe(nn.Sequential(EqualToAll(4, 4), nn.Tanh()), [1, 1])
    setattr(model, "0", EqualToAll(4, 5))
    assert model(torch.randn(2, 4)).shape == (2, 5)


def test_a_gpipe_pickled_before_swaps_were_followed_loads() -> None:
    model = GPipe(_named(), [2, 1], devices=["cpu", "cpu"], deferred_batch_norm=True)
    state = model.__getstate__()
    state["_guards"] = list(state["_guards"].values())  # as it was then
    state["_deferred"] = []
    del state["_layers"]
    old = GPipe.__new__(GPipe)
    old.__setstate__(state)
    x = torch.randn(2, 4)
    torch.testing.assert_close(old(x), model(x))
    old.fc = nn.Linear(4, 5)
    assert old(x).shape == (2, 5)
