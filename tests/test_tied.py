"""Weights tied across partitions: a copy per partition, equal gradients, equal updates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, ScheduleZeroBubble
from torchgpipe.tied import check_layers

VOCAB, WIDTH = 11, 6


class Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def _language_model() -> nn.Sequential:
    """Embedding, a body, and an output head tied to the embedding."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, Mean(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), head)


def _data(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (8, 5), generator=generator)
    return ids, torch.randint(0, VOCAB, (8,), generator=generator)


def test_each_partition_gets_a_copy_equal_to_the_owner() -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    owner, copy_ = pipe[0].weight, pipe[4].weight
    assert owner is not copy_
    torch.testing.assert_close(owner, copy_, rtol=0, atol=0)
    # Both names, as the plain model's state dict has them.
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert sum(p is owner or p is copy_ for p in pipe.parameters()) == 2


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_copy_holds_the_sum_of_the_gradients_of_all_uses(checkpoint: str) -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    ids, target = _data(1)
    for _ in range(2):  # a second backward accumulates, as the plain model's does
        F.cross_entropy(pipe(ids), target).backward()
        F.cross_entropy(plain(ids), target).backward()
        expected = plain[0].weight.grad
        assert expected is not None
        torch.testing.assert_close(pipe[0].weight.grad, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(pipe[4].weight.grad, pipe[0].weight.grad)


@pytest.mark.parametrize("schedule", [None, Schedule1F1B, ScheduleZeroBubble])
def test_copies_stay_equal_over_fifty_adam_steps(schedule: type | None) -> None:
    plain = _language_model()
    pipe = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ours = torch.optim.Adam(pipe.parameters(), lr=0.01)
    theirs = torch.optim.Adam(plain.parameters(), lr=0.01)
    stepper = schedule(pipe, F.cross_entropy) if schedule is not None else None
    for k in range(50):
        ids, target = _data(100 + k)
        ours.zero_grad()
        theirs.zero_grad()
        if stepper is None:
            F.cross_entropy(pipe(ids), target).backward()
        else:
            stepper.step(ids, target)
        F.cross_entropy(plain(ids), target).backward()
        ours.step()
        theirs.step()
        assert torch.equal(pipe[0].weight, pipe[4].weight), f"copies differ after step {k}"
    torch.testing.assert_close(pipe[0].weight, plain[0].weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pipe[2].weight, plain[2].weight, rtol=1e-4, atol=1e-5)


def test_a_meta_model_fills_the_copies_from_the_owner() -> None:
    with torch.device("meta"):
        model = _language_model()
    pipe = GPipe(model, [2, 3])
    assert not pipe[0].weight.is_meta
    torch.testing.assert_close(pipe[4].weight, pipe[0].weight, rtol=0, atol=0)


def test_a_module_in_two_partitions_is_refused() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Linear module is part of layers in partitions 0 and 1"):
        GPipe(nn.Sequential(nn.Sequential(shared), nn.Sequential(shared)), [1, 1])


def test_across_processes_shared_tensors_are_still_refused() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(ValueError, match=r"1\.weight is the same tensor as 0\.weight.*processes"):
        check_layers(nn.Sequential(a, b), ties=False)
