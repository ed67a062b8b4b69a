"""Clipping by the total norm: each weight once, tied copies and processes alike."""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from distributed_helpers import run_threads
from helpers import EmptyWeight
from nccl_rules import NCCLRules
from test_tied import VOCAB, WIDTH, Mean, _data, _language_model
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, ScheduleGPipe
from torchgpipe.distributed import PipelineStage, RemoteError, Transport


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


# Norm types as torch's clip takes them: 0 counts the gradients that are not zero, a
# negative p sums n ** p, -inf takes the smallest; a string that float() reads.
NORM_TYPES = [0, 0.0, -1.0, -0.5, -math.inf, 0.5, 3, "2", "inf", "-inf", " 1e0 "]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_every_norm_type_of_torchs_clip_gives_its_total_and_gradients(norm_type: Any) -> None:
    # Before, norm_type 0, negative ones and -inf were refused, and of the strings
    # only 'inf' was taken.
    plain = _language_model()
    model = GPipe(copy.deepcopy(plain), [2, 3], chunks=4)
    ids, target = _data(0)
    F.cross_entropy(model(ids), target).backward()
    F.cross_entropy(plain(ids), target).backward()
    max_norm = 1e-4  # below every total here but -0.5's: clipping is at work
    total = model.clip_grad_norm_(max_norm, norm_type)
    expected = nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    ours = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-5, atol=1e-9, msg=name)
    assert torch.equal(model[4].weight.grad, model[0].weight.grad)  # the copies alike


class _ComplexLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: Tensor) -> Tensor:
        return x.to(torch.complex64) @ self.w


class _Abs(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.abs()


def _complex_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_ComplexLinear(), _Abs(), nn.Linear(4, 4))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0, 0, -1.0, -math.inf])
def test_complex_gradients_are_clipped_as_torch_clips_them(norm_type: float) -> None:
    # Regression: the norm of a complex gradient was asked for in float64, which
    # torch refuses for complex input: every norm type raised.
    plain = _complex_model()
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2)
    x = torch.randn(4, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    total = model.clip_grad_norm_(0.1, norm_type)
    torch.testing.assert_close(total, nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type))
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def _with_grads(*dtypes: torch.dtype) -> tuple[GPipe, list[nn.Parameter]]:
    """A GPipe of one parameter per dtype, each given a gradient; the same parameters apart."""
    torch.manual_seed(0)
    plain = [nn.Parameter(torch.randn(3).to(dtype)) for dtype in dtypes]
    layers = [nn.Module() for _ in dtypes]
    for layer, p in zip(layers, plain, strict=True):
        layer.w = copy.deepcopy(p)
        layer.w.grad = torch.randn(3).to(p.dtype)
        p.grad = layer.w.grad.clone()
    return GPipe(nn.Sequential(*layers), [len(layers)]), plain


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float64,),
        (torch.float16,),
        (torch.bfloat16,),
        (torch.complex128,),
        (torch.float32, torch.float64),
        (torch.float16, torch.bfloat16),  # float32: the dtype that promotes both
        (torch.float16, torch.complex64),
    ],
    ids=str,
)
def test_the_total_has_the_dtype_of_torchs(dtypes: tuple[torch.dtype, ...]) -> None:
    # Regression: the total was always float32 (a float64 model's was rounded to it).
    model, plain = _with_grads(*dtypes)
    total = model.clip_grad_norm_(0.5)
    expected = nn.utils.clip_grad_norm_(plain, 0.5)
    assert total.dtype == expected.dtype
    # The same arithmetic as torch's: equal up to the order of the sum, in half precision
    # too (where the total was once taken in float64: 17.75 against torch's 17.875).
    torch.testing.assert_close(total, expected)
    for ours, theirs in zip(model.parameters(), plain, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize(
    ("fill", "norm_type", "dtypes"),
    [
        (1e20, 2.0, (torch.float32, torch.float32)),  # the sum of squares overflows float32
        (7000.0, 10.0, (torch.float32, torch.float32)),
        (40000.0, 2.0, (torch.float16, torch.float32)),  # one float16 gradient's own norm
        (1e-30, 2.0, (torch.float32, torch.float32)),  # the squares underflow to 0
        (1e-20, -2.0, (torch.float32, torch.float32)),
    ],
    ids=str,
)
def test_a_total_overflows_and_underflows_where_torchs_does(
    fill: float, norm_type: float, dtypes: tuple[torch.dtype, ...]
) -> None:
    # Regression: each gradient's norm was taken in float64, so a total torch finds
    # infinite (and clips every gradient to 0, or refuses with error_if_nonfinite) came
    # out finite here, and clipped as if nothing were wrong.
    model, plain = _with_grads(*dtypes)
    for p in [*model.parameters(), *plain]:
        p.grad = torch.full_like(p, fill)
    total = model.clip_grad_norm_(1.0, norm_type)
    expected = nn.utils.clip_grad_norm_(plain, 1.0, norm_type)
    torch.testing.assert_close(total, expected)
    for ours, theirs in zip(model.parameters(), plain, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    if not torch.isfinite(expected):
        for p in [*model.parameters(), *plain]:
            p.grad = torch.full_like(p, fill)
        with pytest.raises(RuntimeError):
            nn.utils.clip_grad_norm_(plain, 1.0, norm_type, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="cannot be clipped"):
            model.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)


def test_no_gradient_gives_a_total_of_zero_in_the_default_dtype() -> None:
    model, plain = _with_grads(torch.float64)
    for p in [*model.parameters(), *plain]:
        p.grad = None
    for norm_type in (2.0, -1.0, -math.inf, 0):
        total = model.clip_grad_norm_(0.5, norm_type)
        expected = nn.utils.clip_grad_norm_(plain, 0.5, norm_type)
        assert (
            (total.dtype, total.item()) == (expected.dtype, expected.item()) == (torch.float32, 0)
        )


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_is_taken_as_torchs_clip_takes_it(foreach: bool | None) -> None:
    model, plain = _trained_pair()
    total = model.clip_grad_norm_(0.1, 2.0, False, foreach)
    expected = nn.utils.clip_grad_norm_(plain.parameters(), 0.1, 2.0, False, foreach)
    torch.testing.assert_close(total, expected)
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
        (1.0, math.nan, ValueError, "norm_type must be a number, not NaN"),
        (1.0, "nan", ValueError, "norm_type must be a number, not NaN.*got 'nan'"),
        (1.0, "two", TypeError, r"norm_type must be a real number or a string that float\(\)"),
        (1.0, True, TypeError, "norm_type must be a real number.*got True of type bool"),
        (np.bool_(True), 2.0, TypeError, "max_norm must be a real number, got np.True_"),
        (torch.tensor(True), 2.0, TypeError, "max_norm must be a real number"),
        (1.0, 1j, TypeError, "norm_type must be a real number.*got 1j of type complex"),
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
    [
        (2, [2, 3], 2.0),
        (3, [1, 2, 2], 2.0),
        (2, [2, 3], math.inf),
        # The parts of these combine otherwise: counts added, the smallest, n ** p added.
        (2, [2, 3], 0.0),
        (3, [1, 2, 2], -math.inf),
        (2, [2, 3], -1.0),
    ],
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


class _ToDouble(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.double()


def _mixed_model() -> nn.Sequential:
    """Rank 0 (of balance [2, 3]): a complex64 weight; rank 1: float32, then float64."""
    torch.manual_seed(0)
    layers = [_ComplexLinear(), _Abs(), nn.Linear(4, 4), _ToDouble(), nn.Linear(4, 4).double()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("norm_type", [2.0, 0, -math.inf])
def test_processes_give_torchs_total_in_its_dtype_for_complex_and_mixed_gradients(
    norm_type: float,
) -> None:
    # Regression: a complex gradient made rank 0 raise, and rank 1 wait for its part;
    # the total was float32, where torch's over float32 and float64 gradients is float64.
    models = [_mixed_model() for _ in range(2)]
    x, y = torch.randn(6, 4), torch.randn(6, 4, dtype=torch.float64)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 3], transport=transport, chunks=2)
        Schedule1F1B(stage, F.mse_loss).step(
            x if stage.is_first else None, y if stage.is_last else None
        )
        total = stage.clip_grad_norm_(0.01, norm_type)
        return total, {name: p.grad for name, p in stage.named_parameters()}

    results = run_threads(rank, 2, timeout=30.0)
    plain = _mixed_model()
    F.mse_loss(plain(x), y).backward()
    expected = nn.utils.clip_grad_norm_(plain.parameters(), 0.01, norm_type)
    assert expected.dtype == torch.float64
    grads: dict[str, Tensor] = {}
    for value in results:
        assert not isinstance(value, BaseException), value
        total, mine = value
        assert total.dtype == torch.float64  # on rank 0 too, whose gradients are not
        torch.testing.assert_close(total, expected)
        grads.update(mine)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def _model_with_an_empty_weight() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), EmptyWeight(), Mean(), nn.Linear(WIDTH, WIDTH),
        nn.Linear(WIDTH, VOCAB),
    )  # fmt: skip


def test_a_process_that_fails_to_compute_its_part_fails_the_others_at_once() -> None:
    # Regression: only refused arguments were told to the other processes; a failure in
    # the norm of rank 0's gradients left rank 1 waiting until the transport's timeout,
    # which then said that rank 0 had died.
    models = [_model_with_an_empty_weight() for _ in range(2)]
    ids, target = _data(0)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [3, 2], transport=transport, chunks=2)
        Schedule1F1B(stage, F.cross_entropy).step(
            ids if stage.is_first else None, target if stage.is_last else None
        )
        failed, start = None, time.monotonic()
        try:
            stage.clip_grad_norm_(1.0, norm_type=math.inf)
        except Exception as error:
            failed = error
        seconds = time.monotonic() - start
        stage.zero_grad()  # no sparse gradient left: the next call runs as usual
        return failed, seconds, stage.clip_grad_norm_(1.0, norm_type=math.inf)

    results = run_threads(rank, 2, timeout=20.0)  # the transports wait 10 s at most
    for value in results:
        assert not isinstance(value, BaseException), value
    (own, own_seconds, own_next), (told, told_seconds, told_next) = results
    assert type(own) is RuntimeError
    assert "torchgpipe: raised on rank 0 in stage.clip_grad_norm_(); the other ranks" in str(
        own.__notes__
    )
    assert isinstance(told, RemoteError)
    assert told.rank == 0
    assert "rank 0 (stages [0]) raised RuntimeError: " in str(told)
    assert "in stage.clip_grad_norm_()" in str(told)
    assert max(own_seconds, told_seconds) < 5.0  # not the transport's timeout
    assert own_next.item() == told_next.item() == 0.0
