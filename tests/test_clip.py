"""Clipping by the total norm: each weight once, tied copies and processes alike."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from distributed_helpers import run_threads
from nccl_rules import NCCLRules
from test_tied import _data, _language_model
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, ScheduleGPipe
from torchgpipe.distributed import PipelineStage, Transport


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_a_tied_weight_counts_once_and_training_follows_the_plain_model(
    norm_type: float,
) -> None:
    plain = _language_model()
    model = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    assert len(list(model.parameters())) == len(list(plain.parameters())) + 1  # a copy
    ours = torch.optim.SGD(model.parameters(), lr=0.5)
    theirs = torch.optim.SGD(plain.parameters(), lr=0.5)
    for k in range(20):
        ids, target = _data(k)
        ours.zero_grad()
        theirs.zero_grad()
        F.cross_entropy(model(ids), target).backward()
        F.cross_entropy(plain(ids), target).backward()
        total = model.clip_grad_norm_(0.05, norm_type)
        expected = nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-7)
        assert total > 0.05  # clipping is at work
        ours.step()
        theirs.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[0].weight, model[4].weight.to(model[0].weight.device))


def test_without_ties_it_is_torchs_clip() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2)
    x = torch.randn(6, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    total = model.clip_grad_norm_(0.1)
    torch.testing.assert_close(total, nn.utils.clip_grad_norm_(plain.parameters(), 0.1))
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_gradients_under_the_limit_are_left_alone() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), [1, 1], chunks=2)
    model(torch.randn(4, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    total = model.clip_grad_norm_(1e6)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert total < 1e6
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_non_finite_norm_raises_when_asked() -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2)), [1])
    model[0].weight.grad = torch.full((2, 2), math.inf)
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert model.clip_grad_norm_(1.0) == math.inf
    # A NaN norm scales every gradient by NaN, as torch's clip does.
    model[0].weight.grad = torch.full((2, 2), math.nan)
    model[0].bias.grad = torch.ones(2)
    assert model.clip_grad_norm_(1.0).isnan()
    assert model[0].bias.grad.isnan().all()


def test_arguments_as_torchs_clip_takes_them() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4))
    model = GPipe(copy.deepcopy(plain), [1])
    x = torch.randn(3, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    total = model.clip_grad_norm_(torch.tensor(0.1), "inf")  # type: ignore[arg-type]
    torch.testing.assert_close(total, nn.utils.clip_grad_norm_(plain.parameters(), 0.1, "inf"))
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def _trained_pair() -> tuple[GPipe, nn.Module]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2)
    x = torch.randn(8, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    return model, plain


def test_an_infinite_max_norm_gives_the_norm_and_clips_nothing() -> None:
    # torch's clip takes max_norm=inf (to log the norm); ours refused it before the fix.
    model, plain = _trained_pair()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    total = model.clip_grad_norm_(math.inf)
    torch.testing.assert_close(total, nn.utils.clip_grad_norm_(plain.parameters(), math.inf))
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_tensor_max_norm_that_wants_a_gradient_is_read_without_a_warning() -> None:
    model, _ = _trained_pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.clip_grad_norm_(torch.tensor(0.1, requires_grad=True))


def test_numpy_numbers_as_torchs_clip_takes_them() -> None:
    model, plain = _trained_pair()
    total = model.clip_grad_norm_(np.float32(0.1), np.int64(1))  # type: ignore[arg-type]
    expected = nn.utils.clip_grad_norm_(plain.parameters(), np.float32(0.1), np.int64(1))  # type: ignore[arg-type]
    torch.testing.assert_close(total, expected)
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "error", "match"),
    [
        ("1", 2.0, TypeError, "max_norm must be a real number, got '1' of type str"),
        (-1.0, 2.0, ValueError, r"max_norm must be a number >= 0 \(math.inf .*got -1.0"),
        (math.nan, 2.0, ValueError, "max_norm must be a number >= 0.*got nan"),
        (1.0, 0.0, ValueError, "norm_type must be positive"),
        (1.0, True, TypeError, "norm_type must be a real number, got True of type bool"),
        (np.bool_(True), 2.0, TypeError, "max_norm must be a real number, got np.True_"),
        (torch.tensor(True), 2.0, TypeError, "max_norm must be a real number"),
        (1.0, 1j, TypeError, "norm_type must be a real number, got 1j of type complex"),
    ],
)
def test_bad_arguments_are_refused(
    max_norm: object, norm_type: object, error: type[Exception], match: str
) -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2)), [1])
    with pytest.raises(error, match=match):
        model.clip_grad_norm_(max_norm, norm_type)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world", "balance", "norm_type"),
    [(2, [2, 3], 2.0), (3, [1, 2, 2], 2.0), (2, [2, 3], math.inf)],
)
def test_processes_clip_by_one_norm_and_train_as_the_plain_model(
    world: int, balance: list[int], norm_type: float
) -> None:
    # Each rank clipping its own parameters would clip by another norm, and the copies
    # of the tied weight would drift apart; clip_grad_norm_ adds up every rank's part.
    rules = NCCLRules(world)
    models = [_language_model() for _ in range(world)]
    steps = 10

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        schedule = (Schedule1F1B if world == 2 else ScheduleGPipe)(stage, F.cross_entropy)
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.5)
        totals = []
        for k in range(steps):
            ids, target = _data(k)
            optimizer.zero_grad()
            schedule.step(ids if stage.is_first else None, target if stage.is_last else None)
            totals.append(stage.clip_grad_norm_(0.05, norm_type))
            optimizer.step()
        return stage.state_dict(), totals

    results = run_threads(rank, world, timeout=60.0, observe=rules.group)
    for value in results:
        assert not isinstance(value, BaseException), value
    rules.check()
    plain = _language_model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    expected = []
    for k in range(steps):
        ids, target = _data(k)
        optimizer.zero_grad()
        F.cross_entropy(plain(ids), target).backward()
        expected.append(nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type))
        optimizer.step()
    for _, totals in results:  # every rank got the same total, the plain model's
        torch.testing.assert_close(torch.stack(totals), torch.stack(expected), rtol=1e-5, atol=1e-7)
    state: dict[str, Tensor] = {}
    for part, _ in results:
        state.update(part)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(results[0][0]["0.weight"], results[-1][0]["4.weight"])


def test_a_process_that_does_not_take_part_leaves_none_waiting() -> None:
    # Rank 1 gathers a trace while rank 0 clips: each learns of the other's call at once,
    # instead of waiting for a message that will not come.
    models = [_language_model() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=2)
        with stage.trace() as trace:
            ids, target = _data(0)
            Schedule1F1B(stage, F.cross_entropy).step(
                ids if stage.is_first else None, target if stage.is_last else None
            )
        if transport.rank == 0:
            return stage.clip_grad_norm_(1.0)
        return stage.gather_trace(trace, dst=0)

    def outcome(transport: Transport) -> Any:
        try:
            return rank(transport)
        except RuntimeError as error:
            return error

    zero, one = run_threads(outcome, 2, timeout=30.0)
    assert isinstance(zero, RuntimeError)
    assert "rank 1 called stage.gather_trace() while this process called" in str(zero)
    assert isinstance(one, RuntimeError)
    assert "rank 0 called stage.clip_grad_norm_() while this process called" in str(one)
