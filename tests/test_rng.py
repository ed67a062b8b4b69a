"""Random numbers: what a cell draws depends on the seed, the micro-batch and the partition.

Not on the checkpoint mode, the schedule, the threads' timing or what other threads draw;
recomputation draws what the forward drew. Each test here can fail: a cell that drew
from the process-wide generator would break them.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import torchgpipe
from torchgpipe import GPipe, executor, is_recomputing
from torchgpipe.rng import CellRandomness, cell_seed, draw_seed, random_functions
from torchgpipe.training import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)

CHECKPOINTS = ["always", "except_last", "never"]


def dropout_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Dropout(0.5),
        nn.Linear(16, 16),
        nn.Dropout(0.3),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Dropout(0.5),
        nn.Linear(16, 4),
    )


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@contextmanager
def drawing_elsewhere() -> Iterator[None]:
    """Another thread draws from the default generator all the while (data augmentation)."""
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.rand(64)

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# The bug this module fixes: recomputation drew other masks when another thread drew.


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("path", ["model(x)", "Schedule1F1B"])
def test_rng_recomputation_draws_the_forwards_masks_while_another_thread_draws(
    path: str, checkpoint: str
) -> None:
    # With x = 1 and dropout layers only, the output reveals the forward's masks and the
    # input's gradient the recomputation's.
    n = 3
    model = GPipe(nn.Sequential(*[nn.Dropout(0.5) for _ in range(n)]), [1] * n, chunks=8,
                  checkpoint=checkpoint)  # fmt: skip
    schedule = Schedule1F1B(model, lambda out, _: out.sum(), reduction="sum")
    with drawing_elsewhere():
        for _ in range(10):
            x = torch.ones(16, 256, requires_grad=True)
            if path == "model(x)":
                out = model(x)
                out.sum().backward()
            else:
                out = schedule.step(x, torch.zeros(16)).output
            assert x.grad is not None
            mask = out.detach() != 0
            assert torch.equal(x.grad * mask, mask * 2.0**n)
            assert torch.equal(x.grad != 0, mask)


# Reproducible in every mode, and the modes interchangeable.


def _run(checkpoint: str, seed: int = 3, **options: Any) -> tuple[Tensor, list[Tensor]]:
    model = GPipe(dropout_net(), [2, 2, 2, 2], chunks=4, checkpoint=checkpoint, **options)
    return _forward_backward(model, seed)


def _forward_backward(model: GPipe, seed: int) -> tuple[Tensor, list[Tensor]]:
    torch.manual_seed(seed)
    out = model(torch.randn(12, 8, generator=torch.Generator().manual_seed(1)))
    out.sum().backward()
    return out.detach(), _grads(model)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_rng_runs_repeat_under_manual_seed(checkpoint: str) -> None:
    out1, grads1 = _run(checkpoint)
    out2, grads2 = _run(checkpoint)
    assert torch.equal(out1, out2)
    for g1, g2 in zip(grads1, grads2, strict=True):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_rng_once_the_seed_is_drawn_other_threads_change_nothing(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another thread that draws moves the default generator, so it changes the seed a
    # forward reads (that is the one draw a forward makes); given the seed, nothing else.
    monkeypatch.setattr(executor, "draw_seed", lambda: 1234)
    models = [GPipe(dropout_net(), [2, 2, 2, 2], chunks=4, checkpoint=checkpoint) for _ in "ab"]
    out1, grads1 = _forward_backward(models[0], 3)
    with drawing_elsewhere():
        out2, grads2 = _forward_backward(models[1], 3)
    assert torch.equal(out1, out2)
    for g1, g2 in zip(grads1, grads2, strict=True):
        assert torch.equal(g1, g2)


def test_rng_another_seed_draws_other_masks() -> None:
    assert not torch.equal(_run("never", seed=3)[0], _run("never", seed=4)[0])


def test_rng_checkpoint_modes_draw_the_same_numbers() -> None:
    out, grads = _run("never")
    for checkpoint in ("always", "except_last"):
        other_out, other_grads = _run(checkpoint)
        torch.testing.assert_close(other_out, out, rtol=0, atol=0)
        for g, h in zip(other_grads, grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)


def test_rng_devices_do_not_change_what_cells_draw() -> None:
    # 'cpu:0' and 'cpu:1' are different devices to ==, and the same generator.
    out, _ = _run("always")
    indexed, _ = _run("always", devices=["cpu:0", "cpu:1", "cpu", "cpu:0"])
    assert torch.equal(out, indexed)


SCHEDULES: dict[str, Callable[..., Any]] = {
    "ScheduleGPipe": ScheduleGPipe,
    "Schedule1F1B": Schedule1F1B,
    "ScheduleZeroBubble": ScheduleZeroBubble,
    "ScheduleInterleaved1F1B": partial(ScheduleInterleaved1F1B, virtual_stages=2),
}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_rng_schedules_draw_what_model_x_draws(schedule: str, checkpoint: str) -> None:
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))

    reference = GPipe(dropout_net(), [2, 2, 2, 2], chunks=4, checkpoint="never")
    torch.manual_seed(9)
    expected = reference(x)
    _mse(expected, target).backward()

    model = GPipe(dropout_net(), [2, 2, 2, 2], chunks=4, checkpoint=checkpoint)
    torch.manual_seed(9)
    result = SCHEDULES[schedule](model, _mse).step(x, target)
    torch.testing.assert_close(result.output, expected.detach(), rtol=0, atol=0)
    for g, h in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)


def test_rng_a_forward_reads_the_default_generator_once_and_never_sets_it() -> None:
    model = GPipe(dropout_net(), [2, 2, 2, 2], chunks=4, checkpoint="always")
    x = torch.randn(12, 8)
    torch.manual_seed(5)
    out = model(x)
    after_forward = torch.get_rng_state()
    torch.manual_seed(5)
    draw_seed()
    assert torch.equal(torch.get_rng_state(), after_forward)  # one draw: the seed
    out.sum().backward()  # recomputation draws from the cells' own generators
    assert torch.equal(torch.get_rng_state(), after_forward)
    torch.manual_seed(5)
    GPipe(nn.Sequential(), [])(x)  # an empty GPipe's forward too (it drew nothing)
    assert torch.equal(torch.get_rng_state(), after_forward)


# The cells' generators, and the functions that draw from them.


def test_rng_cell_seeds_differ_between_cells_and_runs() -> None:
    seeds = {cell_seed(seed, i, j) for seed in (0, 1) for i in range(32) for j in range(8)}
    assert len(seeds) == 2 * 32 * 8
    assert all(0 <= s < 2**63 for s in seeds)


def _twice(fn: Callable[[], Any], seed: int = 11) -> tuple[Any, Any]:
    """``fn()`` in a cell's forward and in its replay."""
    randomness = CellRandomness(seed)
    results = []
    for scope in (randomness.forward, randomness.replay):  # one line: the calls' sites
        with scope():
            results.append(fn())
        torch.rand(100)  # the default generator moves on in between
    return results[0], results[1]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return torch.equal(a, b)
    return all(_equal(x, y) for x, y in zip(a, b, strict=True))


def x8() -> Tensor:
    return torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(0))


CALLS: dict[str, Callable[[], Any]] = {
    "rand": lambda: torch.rand(5),
    "randn": lambda: torch.randn(2, 3, dtype=torch.float64),
    "randint": lambda: torch.randint(0, 100, (7,)),
    "randperm": lambda: torch.randperm(10),
    "normal": lambda: torch.normal(torch.zeros(5), torch.ones(5)),
    "normal floats": lambda: torch.normal(0.0, 1.0, (5,)),
    "bernoulli": lambda: torch.bernoulli(torch.full((9,), 0.5)),
    "multinomial": lambda: torch.multinomial(torch.ones(10), 4),
    "poisson": lambda: torch.poisson(torch.full((6,), 3.0)),
    "Tensor.uniform_": lambda: torch.empty(5).uniform_(-1, 1),
    "Tensor.normal_": lambda: torch.empty(5).normal_(),
    "Tensor.bernoulli_": lambda: torch.empty(5).bernoulli_(0.5),
    "Tensor.random_": lambda: torch.empty(5).random_(0, 10),
    "Tensor.exponential_": lambda: torch.empty(5).exponential_(),
    "rand_like": lambda: torch.rand_like(torch.empty(3, 2)),
    "randn_like": lambda: torch.randn_like(torch.empty(3, 2, dtype=torch.float64)),
    "randint_like": lambda: torch.randint_like(torch.empty(4), 3, 9),
    "init": lambda: nn.init.kaiming_uniform_(torch.empty(4, 4)),
    "dropout": lambda: F.dropout(torch.ones(64), 0.5),
    "nn.Dropout": lambda: nn.Dropout(0.2)(torch.ones(64)),
    "dropout2d": lambda: F.dropout2d(x8(), 0.5),
    "alpha_dropout": lambda: F.alpha_dropout(torch.ones(64), 0.5, training=True),
    "torch.dropout": lambda: torch.dropout(torch.ones(64), 0.5, True),
    "torch.native_dropout": lambda: torch.native_dropout(torch.ones(64), 0.5, True),
    "rrelu": lambda: F.rrelu(-torch.ones(64), training=True),
    "gumbel_softmax": lambda: F.gumbel_softmax(torch.zeros(4, 5), hard=True),
    "fractional_max_pool2d": lambda: F.fractional_max_pool2d(x8(), 2, output_size=4),
    "attention dropout": lambda: F.scaled_dot_product_attention(
        x8()[:, :2, :, :4], x8()[:, :2, :, :4], x8()[:, :2, :, :4], dropout_p=0.5
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_rng_each_random_function_draws_from_the_cell(name: str) -> None:
    first, second = _twice(CALLS[name])
    assert _equal(first, second)  # the replay draws what the forward drew
    other, _ = _twice(CALLS[name], seed=12)
    assert not _equal(first, other)  # and the cell's seed decides it


@pytest.mark.parametrize("name", ["rand_like", "randn_like"])
def test_rng_a_like_function_works_under_vmap_in_a_cell(name: str) -> None:
    # torch.func's transforms refuse requires_grad_ at all, even requires_grad_(False).
    draw = getattr(torch, name)

    class Noise(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.vmap(lambda r: r + draw(r), randomness="different")(x)

    model = GPipe(nn.Sequential(nn.Linear(3, 3), Noise()), [1, 1], chunks=2)
    torch.manual_seed(5)
    first = model(torch.ones(4, 3))
    torch.manual_seed(5)
    assert torch.equal(model(torch.ones(4, 3)), first)


def test_rng_a_generator_given_explicitly_is_kept() -> None:
    def draw() -> Tensor:
        return torch.rand(5, generator=torch.Generator().manual_seed(1))

    first, _ = _twice(draw, seed=1)
    other, _ = _twice(draw, seed=2)
    assert torch.equal(first, other)
    assert torch.equal(first, torch.rand(5, generator=torch.Generator().manual_seed(1)))


def test_rng_random_functions_are_listed() -> None:
    names = random_functions()
    for name in ("torch.rand", "Tensor.bernoulli_", "torch.nn.functional.dropout",
                 "torch.nn.functional.scaled_dot_product_attention"):  # fmt: skip
        assert name in names


# The dropout family, rewritten on generators, keeps torch's semantics.


def _in_cell(fn: Callable[[], Any]) -> Any:
    with CellRandomness(5).forward():
        return fn()


def test_rng_dropout_scales_the_kept_and_zeroes_the_rest() -> None:
    out = _in_cell(lambda: F.dropout(torch.ones(10_000), 0.25))
    kept = out != 0
    assert torch.equal(out[kept], torch.full_like(out[kept], 1 / 0.75))
    assert 0.7 < kept.double().mean().item() < 0.8


def test_rng_native_dropout_returns_the_mask_it_applied() -> None:
    x = torch.ones(1000, requires_grad=True)
    out, mask = _in_cell(lambda: torch.native_dropout(x, 0.5, True))
    assert mask.dtype == torch.bool
    assert torch.equal(out, mask * 2.0)
    out.sum().backward()
    assert torch.equal(x.grad, mask * 2.0)
    out, mask = _in_cell(lambda: torch.native_dropout(x, 0.5, False))
    assert torch.equal(out, x)
    assert bool(mask.all())


def test_rng_dropout_edge_cases() -> None:
    x = torch.randn(3, 4)
    assert _in_cell(lambda: F.dropout(x, 0.5, training=False)) is x
    assert torch.equal(_in_cell(lambda: F.dropout(x, 0.0)), x)
    assert torch.equal(_in_cell(lambda: F.dropout(x, 1.0)), torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"between 0 and 1, but got 1\.5"):
        _in_cell(lambda: F.dropout(x, 1.5))
    y = torch.ones(100)
    out = _in_cell(lambda: F.dropout(y, 0.5, inplace=True))
    assert out is y


def test_rng_feature_dropout_drops_whole_channels() -> None:
    out = _in_cell(lambda: F.dropout2d(torch.ones(8, 16, 5, 5), 0.5))
    per_channel = out.flatten(2)
    assert torch.equal(per_channel.amin(-1), per_channel.amax(-1))  # a channel all alike
    unbatched = _in_cell(lambda: F.dropout1d(torch.ones(16, 7), 0.5))
    assert unbatched.shape == (16, 7)
    assert torch.equal(unbatched.amin(-1), unbatched.amax(-1))


def test_rng_alpha_dropout_keeps_mean_and_variance() -> None:
    x = torch.randn(200_000, dtype=torch.float64)
    out = _in_cell(lambda: F.alpha_dropout(x, 0.2, training=True))
    assert abs(out.mean().item()) < 0.02
    assert abs(out.var().item() - 1) < 0.03


def test_rng_dropout_gradients_follow_the_mask() -> None:
    x = torch.ones(1000, requires_grad=True)
    out = _in_cell(lambda: F.dropout(x, 0.5))
    out.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, out.detach())


def test_rng_attention_dropout_matches_the_plain_formula() -> None:
    q, k, v = (
        torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)
    )
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def ours() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)

    def by_hand() -> Tensor:
        scores = (q @ k.transpose(-2, -1) / math.sqrt(4)).masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        return F.dropout(weights, 0.3) @ v  # the same draws, in the same order

    torch.testing.assert_close(_in_cell(ours), _in_cell(by_hand))
    without = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(_in_cell(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask)), without)  # fmt: skip


def test_rng_gumbel_softmax_hard_is_one_hot_with_soft_gradients() -> None:
    logits = torch.randn(6, 5, requires_grad=True)
    out = _in_cell(lambda: F.gumbel_softmax(logits, tau=0.5, hard=True))
    assert torch.equal(out.detach().sum(-1), torch.ones(6))
    assert set(out.detach().unique().tolist()) <= {0.0, 1.0}
    out[:, 0].sum().backward()
    assert logits.grad is not None
    assert logits.grad.abs().sum() > 0


def test_rng_models_copied_draw_alike() -> None:
    model = GPipe(dropout_net(), [4, 4], chunks=2)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(1)
    b = twin(x)
    assert torch.equal(a, b)


# Layers whose random draws happen inside C++ code, and calls of every shape.


class Recorder(nn.Module):
    """Records its layer's output in forward and in recomputation."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.seen: dict[str, list[Tensor]] = {"forward": [], "recompute": []}

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x)
        y = y[0] if isinstance(y, tuple) else y
        self.seen["recompute" if is_recomputing() else "forward"].append(y.detach().clone())
        return y


class SelfAttention(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x, need_weights=self.need_weights)[0]


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "MultiheadAttention": lambda: SelfAttention(need_weights=False),
    "MultiheadAttention with weights": lambda: SelfAttention(need_weights=True),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(16, 2, 32, 0.5, batch_first=True),
    "LSTM": lambda: nn.LSTM(16, 16, 2, dropout=0.5, batch_first=True),
    "GRU": lambda: nn.GRU(16, 16, 3, dropout=0.5, batch_first=True),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rng_layers_that_draw_inside_cpp_recompute_their_forwards_draws(name: str) -> None:
    torch.manual_seed(0)
    recorder = Recorder(LAYERS[name]())
    model = GPipe(nn.Sequential(recorder, nn.Linear(16, 1)), [1, 1], chunks=2,
                  checkpoint="always")  # fmt: skip
    with drawing_elsewhere():
        model(torch.randn(4, 5, 16)).sum().backward()
    forward, recomputed = recorder.seen["forward"], recorder.seen["recompute"]
    assert len(recomputed) == 2
    for again in recomputed:  # recomputed with grad on, which may round differently
        assert any(torch.allclose(again, first, rtol=1e-5, atol=1e-6) for first in forward)
    torch.manual_seed(1)
    other = Recorder(LAYERS[name]())
    other.load_state_dict(recorder.state_dict())
    with CellRandomness(1).forward():
        a = other(torch.ones(2, 5, 16))
    with CellRandomness(2).forward():
        b = other(torch.ones(2, 5, 16))
    assert not torch.equal(a, b)  # the seed decides the dropout


def test_rng_generators_given_positionally_are_kept() -> None:
    def draw() -> Tensor:
        return torch.poisson(torch.full((5,), 4.0), torch.Generator().manual_seed(3))

    first, _ = _twice(draw, seed=1)
    other, _ = _twice(draw, seed=2)
    assert torch.equal(first, other)


POSITIONAL_NONE: dict[str, Callable[..., Any]] = {  # called with (None,) or without
    "poisson": lambda *g: torch.poisson(torch.full((5,), 4.0), *g),
    "binomial": lambda *g: torch.binomial(torch.full((5,), 9.0), torch.full((5,), 0.5), *g),
    "_standard_gamma": lambda *g: torch._standard_gamma(torch.full((5,), 2.0), *g),
    "_sample_dirichlet": lambda *g: torch._sample_dirichlet(torch.full((5,), 2.0), *g),
    "rrelu": lambda *g: torch.rrelu(torch.full((5,), -1.0), 0.1, 0.3, True, *g),
    "init.uniform_": lambda *g: nn.init.uniform_(torch.empty(5), 0.0, 1.0, *g),
    "init.kaiming_uniform_": lambda *g: nn.init.kaiming_uniform_(
        torch.empty(3, 5), 0.0, "fan_in", "leaky_relu", *g
    ),
}


@pytest.mark.parametrize("name", sorted(POSITIONAL_NONE))
def test_rng_a_generator_of_none_given_positionally_draws_from_the_cell(name: str) -> None:
    # A layer's optional generator (None by default) passed on positionally: the cell
    # added its own by keyword as well, and the call raised "multiple values".
    call = POSITIONAL_NONE[name]
    positional, replayed = _twice(lambda: call(None))
    assert torch.equal(positional, replayed)
    left_out, _ = _twice(lambda: call())  # the same seed: the cell's numbers, as without
    assert torch.equal(positional, left_out)
    other, _ = _twice(lambda: call(None), seed=12)
    assert not torch.equal(positional, other)


class OwnGenerator(nn.Module):
    """Drops what its own generator says (a layer seeded apart from the process)."""

    def __init__(self, positional: bool = False) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)
        self.positional = positional

    def forward(self, x: Tensor) -> Tensor:
        if self.positional:
            keep = torch.poisson(torch.full_like(x, 0.7), self.generator) > 0
        else:
            keep = torch.rand(x.shape, generator=self.generator) > 0.5
        return x * keep


def own_generator_net(positional: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), OwnGenerator(positional), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("positional", [False, True])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("path", ["model(x)", "Schedule1F1B", "ScheduleZeroBubble"])
def test_rng_a_layers_own_generator_is_replayed_and_advanced_once(
    path: str, checkpoint: str, positional: bool
) -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    plain = own_generator_net(positional)
    for _ in range(2):  # the second step draws on from where the first left it
        plain.zero_grad()
        _mse(plain(x), y).backward()

    model = GPipe(own_generator_net(positional), [2, 2], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    for _ in range(2):
        model.zero_grad()
        if path == "model(x)":
            _mse(model(x), y).backward()
        else:
            {"Schedule1F1B": Schedule1F1B, "ScheduleZeroBubble": ScheduleZeroBubble}[path](
                model, _mse
            ).step(x, y)
    for got, expected in zip(_grads(model), _grads(plain), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[1].generator.get_state(), plain[1].generator.get_state())


def test_rng_a_generator_given_and_drawn_from_by_another_thread_is_replayed() -> None:
    # The bug: the forward noted the generator's state, then drew from the generator
    # itself; a data thread drawing from it in between (torch.default_generator, passed
    # on explicitly) made the recomputation replay a state the forward never drew from.
    # The input's gradient shows the recomputation's mask, the output the forward's.
    class Given(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * (torch.rand(x.shape, generator=torch.default_generator) < 0.5)

    model = GPipe(nn.Sequential(nn.Identity(), Given(), Given()), [1, 1, 1], chunks=8,
                  checkpoint="always")  # fmt: skip
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the gap is hit within a few steps
    try:
        with drawing_elsewhere():
            for _ in range(10):
                x = torch.ones(16, 512, requires_grad=True)
                out = model(x)
                out.sum().backward()
                assert x.grad is not None
                assert torch.equal(x.grad, out.detach())
    finally:
        sys.setswitchinterval(switch)


@pytest.mark.parametrize("where", ["layer", "loss"])
def test_rng_a_recomputation_drawing_more_from_its_own_generator_fails(where: str) -> None:
    generator = torch.Generator().manual_seed(3)

    class Sneaky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if is_recomputing():
                return x * torch.rand(x.shape, generator=generator)
            return x

    def noisy(output: Tensor, target: Tensor) -> Tensor:
        return _mse(output + torch.randn(output.shape, generator=generator), target)

    last = Sneaky() if where == "layer" else nn.Identity()
    model = GPipe(nn.Sequential(nn.Linear(4, 4), last), [1, 1], chunks=2)

    def run() -> None:
        if where == "layer":
            model(torch.randn(4, 4)).sum().backward()
        else:  # computed in the recomputation of the checkpointed last cells only
            ScheduleGPipe(model, noisy).step(torch.randn(4, 4), torch.randn(4, 4))

    # The layer's extra call is refused as any random call its forward did not make;
    # the loss's (the forward computes none) at the generator it brings.
    match = (
        r"called rand at .*test_rng\.py:\d+ as its random call 1, where its forward called "
        r"nothing more"
        if where == "layer"
        else "with a generator of its own more often"
    )
    with pytest.raises(RuntimeError, match=match):
        run()


def test_rng_layers_of_several_partitions_sharing_a_generator_replay_their_draws() -> None:
    generator = torch.Generator().manual_seed(7)
    drawn: dict[tuple[int, float, bool], Tensor] = {}
    lock = threading.Lock()

    class Shared(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: Tensor) -> Tensor:
            noise = torch.rand(64, 256, generator=generator)  # big: the draws overlap
            with lock:
                drawn[(self.index, round(x.sum().item(), 3), is_recomputing())] = noise
            return x * self.scale + noise[: x.shape[0], : x.shape[1]]

    model = GPipe(nn.Sequential(*(Shared(k) for k in range(3))), [1, 1, 1], chunks=8)
    model(torch.randn(16, 4)).sum().backward()
    forwards = {key[:2]: noise for key, noise in drawn.items() if not key[2]}
    replays = {key[:2]: noise for key, noise in drawn.items() if key[2]}
    assert len(replays) == 3 * 7  # every cell but the last micro-batch's ('except_last')
    for key, noise in replays.items():
        assert torch.equal(noise, forwards[key]), key


def test_rng_tensors_given_by_keyword() -> None:
    first, second = _twice(lambda: torch.multinomial(num_samples=3, input=torch.ones(10)))
    assert torch.equal(first, second)
    first, second = _twice(lambda: torch.bernoulli(p=0.5, input=torch.ones(20)))
    assert torch.equal(first, second)


def test_rng_distributions_sample_from_the_cell() -> None:
    from torch.distributions import Beta, Binomial, Dirichlet, Gamma

    for make in (
        lambda: Gamma(torch.full((4,), 2.0), torch.ones(4)),
        lambda: Beta(torch.full((4,), 2.0), torch.full((4,), 3.0)),
        lambda: Dirichlet(torch.ones(4)),
        lambda: Binomial(10, torch.full((4,), 0.3)),
    ):
        first, second = _twice(lambda make=make: make().sample())
        assert torch.equal(first, second)


def test_rng_meta_tensors_draw_nothing_and_keep_their_shape() -> None:
    with CellRandomness(1).forward():
        assert torch.rand(5, device="meta").shape == (5,)
        assert F.dropout(torch.empty(3, 4, device="meta"), 0.5).shape == (3, 4)


def test_rng_the_loss_of_a_schedule_draws_alike_in_forward_and_recomputation() -> None:
    # A checkpointed cell's loss is computed once, in its recomputation; an
    # uncheckpointed one's in its forward. Both draw the same dropout masks.
    drawn: list[tuple[bool, Tensor]] = []

    def noisy_loss(output: Tensor, target: Tensor) -> Tensor:
        loss = F.mse_loss(F.dropout(output, 0.5), target)
        drawn.append((is_recomputing(), loss.detach()))
        return loss

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    results = {}
    for mode in ("always", "never"):
        torch.manual_seed(0)
        model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2,
                      checkpoint=mode)  # fmt: skip
        drawn.clear()
        torch.manual_seed(1)
        results[mode] = ScheduleGPipe(model, noisy_loss).step(x, y)
        assert [again for again, _ in drawn] == [mode == "always"] * 2  # once per micro-batch
        assert sorted(float(loss) for _, loss in drawn) == sorted(map(float, results[mode].losses))
    assert torch.equal(torch.stack(results["always"].losses), torch.stack(results["never"].losses))
    assert not torch.equal(results["always"].losses[0], results["always"].losses[1])


def test_rng_dropout_family_shapes_and_errors_follow_torch() -> None:
    with pytest.raises(RuntimeError, match="dropout1d: Expected 2D or 3D input"):
        _in_cell(lambda: F.dropout1d(torch.ones(2, 3, 4, 5), 0.5))
    x = torch.ones(8, 6)
    assert _in_cell(lambda: F.dropout1d(x, 0.5, inplace=True)) is x  # unbatched, in place
    # dropout3d adds a batch dimension to anything but 5-D: whole slices of dim 0 drop.
    out = _in_cell(lambda: F.dropout3d(torch.ones(6, 5, 4), 0.5))
    assert torch.equal(out.flatten(1).amin(1), out.flatten(1).amax(1))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        _in_cell(lambda: torch.dropout(torch.ones(3), 1.5, True))


def test_rng_attention_dropout_keeps_torch_semantics_at_the_edges() -> None:
    q = torch.randn(1, 2, 3, 4)
    masked = torch.zeros(3, 3, dtype=torch.bool)
    out = _in_cell(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=masked,
                                                          dropout_p=0.5))  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))  # a row masked whole gives zeros
    with pytest.raises(RuntimeError, match="should not be given when is_causal"):
        _in_cell(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=masked,
                                                        dropout_p=0.5, is_causal=True))  # fmt: skip
    half = q.half()
    out = _in_cell(lambda: F.scaled_dot_product_attention(half, half, half,
                                                          attn_mask=torch.zeros(3, 3),
                                                          dropout_p=0.5))  # fmt: skip
    assert out.dtype == torch.float16


def test_the_seed_comes_from_the_cpu_generator_whatever_the_default_device() -> None:
    torch.manual_seed(5)
    expected = draw_seed()
    torch.manual_seed(5)
    with torch.device("meta"):  # a default device that a context leaves as it was
        assert draw_seed() == expected  # a meta draw would have no value at all


class _TagsOnce(nn.Module):
    """Draws a tag outside recomputation only (as README warns against), then Dropout."""

    def forward(self, x: Tensor) -> Tensor:
        if not is_recomputing():
            self.tag = torch.rand(())
        return F.dropout(x, 0.5)


@pytest.mark.parametrize(
    "layer", [_TagsOnce, lambda: nn.Sequential(nn.LazyLinear(4), nn.Dropout(0.5))]
)
@pytest.mark.parametrize("backward_by", ["workers", "engine"], indirect=True)
def test_rng_a_recomputation_that_draws_otherwise_than_its_forward_is_refused(
    layer: Callable[[], nn.Module], backward_by: str
) -> None:
    # Its Dropout masks would not be the forward's: a silently wrong gradient.
    model = GPipe(nn.Sequential(nn.Linear(4, 4), layer()), [1, 1], chunks=2, checkpoint="always")
    loss = model(torch.randn(4, 4, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match=r"recomputation of a checkpointed cell called dropout"):
        loss.backward()


class _LogsNoisyOnce(nn.Module):
    """Draws for a statistic outside recomputation only, by the function it draws with next.

    Each call matched the forward's by its function, one short: a count or the functions
    alone cannot tell; the line of the call can.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not is_recomputing():
            self.noisy = F.dropout(x.detach(), 0.5).std()
        return F.dropout(x, 0.5)


@pytest.mark.parametrize("backward_by", ["workers", "engine"], indirect=True)
def test_rng_a_recomputation_that_skips_a_draw_of_the_same_function_is_refused(
    backward_by: str,
) -> None:
    # Every call matched the forward's by its function, one short: its Dropout took the
    # statistic's mask, and the gradients were off by up to 20, silently.
    layers = [nn.Linear(4, 4), _LogsNoisyOnce(), nn.Linear(4, 4), _LogsNoisyOnce()]
    model = GPipe(nn.Sequential(*layers), [2, 2], chunks=2, checkpoint="always")
    loss = model(torch.randn(4, 4, requires_grad=True)).sum()
    line = r"at .*test_rng\.py:\d+"
    with pytest.raises(RuntimeError, match=rf"called dropout {line} as its random call 1, "):
        loss.backward()


def _drop(x: Tensor) -> Tensor:  # one helper for every dropout of a layer
    return F.dropout(x, 0.5)


class _LogsThroughAHelper(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if not is_recomputing():
            self.noisy = _drop(x.detach()).std()
        return _drop(x)


@pytest.mark.parametrize("backward_by", ["workers", "engine"], indirect=True)
def test_rng_a_skipped_draw_through_a_helper_is_refused(backward_by: str) -> None:
    # Both draws had the helper's line: the call's caller tells them apart.
    model = GPipe(nn.Sequential(nn.Identity(), _LogsThroughAHelper()), [1, 1], chunks=1,
                  checkpoint="always")  # fmt: skip
    loss = model(torch.randn(8, 8, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match=r"called dropout at .*test_rng\.py:\d+ from "):
        loss.backward()


_INSTALLED = """
import torch
from torch import nn
from torchgpipe import GPipe, pipeline
pipeline.workers_run_backward = lambda devices: False  # the engine's way, as on a GPU
model = GPipe(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5)),
              [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint="always")
model(torch.randn(4, 8, requires_grad=True)).sum().backward()
print("ok")
"""


def test_rng_installed_beside_torch_the_library_is_not_taken_for_torch(tmp_path: Path) -> None:
    # ".../site-packages/torchgpipe" starts with ".../site-packages/torch": the library's
    # own frames counted as torch's, and a checkpointed Dropout failed its recomputation.
    (tmp_path / "torch").symlink_to(Path(torch.__file__).parent)
    shutil.copytree(Path(torchgpipe.__file__).parent, tmp_path / "torchgpipe")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    ran = subprocess.run(
        [sys.executable, "-c", _INSTALLED], env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "ok"


class _LazyRandomFeatures(nn.Module):
    """A random projection made at its first forward, with no draw after it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("projection", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.projection is None:
            self.projection = torch.randn(x.shape[-1], 3)
        return torch.cos(x @ self.projection)


@pytest.mark.parametrize("backward_by", ["workers", "engine"], indirect=True)
def test_rng_a_lazy_draw_with_nothing_drawn_after_passes_the_check(backward_by: str) -> None:
    # Refused for a while by a count of the calls: the recomputation made none, the
    # forward one, yet its numbers were the forward's (none).
    torch.manual_seed(0)
    model = GPipe(nn.Sequential(nn.Linear(4, 4), _LazyRandomFeatures()), [1, 1], chunks=2,
                  checkpoint="always")  # fmt: skip
    x = torch.randn(4, 4, requires_grad=True)
    model(x).sum().backward()
    plain = nn.Sequential(copy.deepcopy(model[0]), copy.deepcopy(model[1]))
    y = x.detach().requires_grad_()
    plain(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("backward_by", ["workers", "engine"], indirect=True)
def test_rng_a_recomputation_that_stops_short_passes_the_check(backward_by: str) -> None:
    # A lazy layer draws its weights in the first forward only; nothing is drawn after,
    # so the recomputation's numbers are the forward's (none): as the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    plain(torch.randn(2, 4))  # its weights made, to be overwritten
    model = GPipe(nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3)), [1, 1], chunks=2,
                  checkpoint="always")  # fmt: skip
    x = torch.randn(4, 4)
    out = model(x)  # the lazy layer makes its weights in this forward
    plain.load_state_dict(model.state_dict())
    out.sum().backward()
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


class _InnerCheckpoint(nn.Module):
    """A block that checkpoints its body itself (a model's own gradient checkpointing)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Tanh())

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def _inner_checkpoint_net(p: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), _InnerCheckpoint(p), _InnerCheckpoint(p), nn.Linear(8, 2))


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("path", ["model(x)", "ScheduleGPipe"])
def test_rng_a_draw_inside_torch_utils_checkpoint_in_a_cell_is_refused(
    path: str, checkpoint: str
) -> None:
    # The bug: torch's checkpoint recomputed its body in the backward from the default
    # generator, where the forward had drawn from the cell's: other Dropout masks, and
    # silently wrong gradients in every mode.
    model = GPipe(_inner_checkpoint_net(0.3), [2, 2], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def train() -> None:
        if path == "model(x)":
            _mse(model(x), y).backward()
        else:
            ScheduleGPipe(model, _mse).step(x, y)

    with pytest.raises(RuntimeError, match=r"drew inside torch\.utils\.checkpoint"):
        train()
    model.eval()
    with torch.no_grad():  # no backward, no recomputation: nothing to refuse
        model(x)
    model.train()
    for p in model.parameters():  # frozen: nothing wants a gradient, torch recomputes nothing
        p.requires_grad_(False)
    model(x)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_rng_torch_utils_checkpoint_drawing_nothing_in_a_cell_runs_as_the_plain_model(
    checkpoint: str,
) -> None:
    plain = _inner_checkpoint_net(0.0)
    model = GPipe(_inner_checkpoint_net(0.0), [2, 2], chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    _mse(plain(x), y).backward()
    _mse(model(x), y).backward()
    for got, expected in zip(_grads(model), _grads(plain), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
