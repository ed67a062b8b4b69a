"""Pipelines over processes, on gloo over loopback: the same gradients, and failures.

Each test starts its processes once and runs several cases in them (starting 4
processes costs seconds); the checks run here, in the parent, on what ranks returned.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import (
    DIED,
    Widen,
    bn_net,
    mlp,
    record_net,
    skip_net,
    spawn,
    widening,
)
from helpers import EmptyWeight
from torch import Tensor, nn

import torchgpipe.training as single
from torchgpipe import GPipe
from torchgpipe.distributed import (
    PipelineSchedule,
    PipelineStage,
    ProcessGroupTransport,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    all_reduce_gradients,
)

pytestmark = pytest.mark.distributed

SCHEDULES: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zero-bubble": ScheduleZeroBubble,
}
SINGLE: dict[str, Callable[..., single.PipelineSchedule]] = {
    "gpipe": single.ScheduleGPipe,
    "1f1b": single.Schedule1F1B,
    "zero-bubble": single.ScheduleZeroBubble,
    "interleaved": single.ScheduleInterleaved1F1B,
}
CHECKPOINTS = ("always", "except_last", "never")


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _step(schedule: PipelineSchedule, x: Any, y: Any) -> Any:
    stage = schedule.pipe
    return schedule.step(x if stage.is_first else None, y if stage.is_last else None)


# What each rank runs.


def _transparency_rank(rank: int, world: int) -> dict[str, Any]:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    out: dict[str, Any] = {}
    for name, factory in SCHEDULES.items():
        for checkpoint in CHECKPOINTS:
            stage = PipelineStage(mlp(), [8 // world] * world, chunks=4, checkpoint=checkpoint)
            result = _step(factory(stage, _mse), x, y)
            out[f"mlp/{name}/{checkpoint}"] = (result.loss, _grads(stage), result.output)
    stage = PipelineStage(mlp(), [4 // world] * 2 * world, chunks=4)
    result = _step(ScheduleInterleaved1F1B(stage, _mse), x, y)
    out["mlp/interleaved/except_last"] = (result.loss, _grads(stage), result.output)

    # A skip from stage 0 to the last stage, counting what each rank sends.
    stage = PipelineStage(skip_net(), [8 // world] * world, chunks=4, transport=_Counting())
    result = _step(Schedule1F1B(stage, _mse), x, y)
    out["skip/1f1b/except_last"] = (result.loss, _grads(stage), result.output)
    assert isinstance(stage.transport, _Counting)
    out["sent"] = stage.transport.sent

    # Dicts, lists, strings and masks between stages; a new sequence length each step.
    stage = PipelineStage(record_net(), [4 // world] * world, chunks=2, checkpoint="always")
    schedule = Schedule1F1B(stage, _mse)
    for length in (3, 5):
        stage.zero_grad()
        result = _step(schedule, _batch(length, 4, length, 4), _batch(length + 1, 4, 4))
        out[f"record/{length}"] = (result.loss, _grads(stage), result.output)

    # Deferred batch norm: the statistics of the whole mini-batch, on every stage.
    balance = [3, 2] if world == 2 else [2, 1, 1, 1]
    stage = PipelineStage(bn_net(), balance, chunks=4, deferred_batch_norm=True)
    result = _step(ScheduleZeroBubble(stage, _mse), x, y)
    out["bn"] = (result.loss, _grads(stage), result.output, stage.state_dict())

    # An input made by a layer before the pipeline, on the first rank: that layer's
    # gradient, for every micro-batch at once.
    before = _before()
    stage = PipelineStage(mlp(), [8 // world] * world, chunks=4, checkpoint="always")
    _step(Schedule1F1B(stage, _mse), before(x), y)
    out["before"] = (None, _grads(stage), _grads(before))
    return out


def _before() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(4, 4)


class _Counting(ProcessGroupTransport):
    """Records the key of every message this rank sends, and to whom."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, Any]] = []

    def send(self, peer: int, header: Any, tensors: Any) -> None:
        self.sent.append((peer, header[1] if header[0] == "metadata" else header[0]))
        super().send(peer, header, tensors)


def _reference(model: nn.Sequential, x: Any, y: Tensor) -> tuple[Tensor, dict[str, Tensor], Any]:
    model = copy.deepcopy(model)
    output = model(x)
    loss = _mse(output, y)
    loss.backward()
    return loss.detach(), _grads(model), output.detach()


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, Tensor]:
    grads: dict[str, Tensor] = {}
    for out in results:
        assert not set(grads) & set(out[key][1]), "two ranks hold the same parameter"
        grads.update(out[key][1])
    return grads


def _assert_close(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _single_process(kind: str, balance: list[int], checkpoint: str) -> dict[str, Tensor]:
    model = GPipe(mlp(), balance, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    extra = {"virtual_stages": 2} if kind == "interleaved" else {}
    SINGLE[kind](model, _mse, **extra).step(_batch(1, 8, 4), _batch(2, 8, 4))
    return _grads(model)


@functools.cache
def _transparency(world: int) -> list[dict[str, Any]]:
    return spawn(_transparency_rank, world)  # shared by the tests that read it


@pytest.mark.parametrize("world", [2, 4])
def test_steps_across_processes_match_the_plain_model_and_one_process(world: int) -> None:
    results = _transparency(world)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    loss, grads, output = _reference(mlp(), x, y)
    for key in results[0]:
        if not key.startswith("mlp/"):
            continue
        _, kind, checkpoint = key.split("/")
        merged = _merged(results, key)
        _assert_close(merged, grads)
        per_rank = 2 if kind == "interleaved" else 1
        balance = [8 // (world * per_rank)] * world * per_rank
        _assert_close(merged, _single_process(kind, balance, checkpoint))
        for out in results:  # every rank knows the loss; the last has the output
            torch.testing.assert_close(out[key][0], loss)
        torch.testing.assert_close(results[-1][key][2], output)
        assert all(out[key][2] is None for out in results[:-1])

    loss, grads, _ = _reference(skip_net(), x, y)
    _assert_close(_merged(results, "skip/1f1b/except_last"), grads)
    torch.testing.assert_close(results[0]["skip/1f1b/except_last"][0], loss)

    for length in (3, 5):
        key = f"record/{length}"
        loss, grads, output = _reference(
            record_net(), _batch(length, 4, length, 4), _batch(length + 1, 4, 4)
        )
        _assert_close(_merged(results, key), grads)
        torch.testing.assert_close(results[-1][key][2], output)

    # Each micro-batch is normalized by its own statistics, as in one process, and the
    # running statistics gather the whole mini-batch's.
    balance = [3, 2] if world == 2 else [2, 1, 1, 1]
    model = GPipe(bn_net(), balance, chunks=4, deferred_batch_norm=True)
    single.ScheduleZeroBubble(model, _mse).step(x, y)
    _assert_close(_merged(results, "bn"), _grads(model))
    plain = bn_net()
    plain(x)
    for out in results:
        for name, value in out["bn"][3].items():
            torch.testing.assert_close(value, model.state_dict()[name], msg=name)
    first = results[0]["bn"][3]  # the first batch norm sees the same inputs as the plain one
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(first[name], plain.state_dict()[name], msg=name)

    before, plain = _before(), mlp()
    _mse(plain(before(x)), y).backward()
    _assert_close(_merged(results, "before"), _grads(plain))
    _assert_close(results[0]["before"][2], _grads(before))
    assert all(not out["before"][2] for out in results[1:])


def test_a_skip_travels_from_the_stashing_rank_straight_to_the_popping_one() -> None:
    results = _transparency(4)
    sent = [out["sent"] for out in results]
    skips = [(rank, peer, key) for rank in range(4) for peer, key in sent[rank] if key[0] == "S"]
    assert sorted(skips) == [(0, 3, ("S", 0, i)) for i in range(4)]
    skip_grads = [
        (rank, peer, key) for rank in range(4) for peer, key in sent[rank] if key[0] == "SG"
    ]
    assert sorted(skip_grads) == [(3, 0, ("SG", 0, i)) for i in range(4)]
    # The activations go one hop at a time.
    hops = {(rank, peer) for rank in range(4) for peer, key in sent[rank] if key[0] == "F"}
    assert hops == {(0, 1), (1, 2), (2, 3)}


# Failures


class _Armed(nn.Module):
    """The identity, which raises on its ``on``-th forward call while ``armed``."""

    def __init__(self, on: int) -> None:
        super().__init__()
        self.on, self.calls, self.armed = on, 0, False

    def forward(self, x: Tensor) -> Tensor:
        from torchgpipe import is_recomputing

        if not is_recomputing():
            self.calls += 1
            if self.armed and self.calls == self.on:
                raise ZeroDivisionError(f"boom on call {self.calls}")
        return x


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise KeyError("no gradient today")


class _BackwardBomb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        return _FailingBackward.apply(x) if self.armed else x


class _Unprintable(Exception):
    """An exception whose ``str()`` has a bug of its own."""

    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except AttributeError:
        return "<unprintable>"


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except BaseException as error:
        return {
            "type": type(error).__name__,
            "text": _text(error),
            "notes": getattr(error, "__notes__", []),
            "rank": getattr(error, "rank", None),
            "stages": getattr(error, "stages", None),
            "action": getattr(error, "action", None),
            "seconds": time.monotonic() - start,
        }
    return {"type": None, "seconds": time.monotonic() - start}


def _faults_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = _batch(1, 4, 4), _batch(2, 4, 4)
    model = mlp()
    model[2] = _Armed(on=3)  # stage 1's first layer: its third forward, micro-batch 2
    model[4] = _BackwardBomb()  # stage 2
    stage = PipelineStage(model, [2, 2, 2, 2], chunks=4)
    schedule = ScheduleGPipe(stage, _mse)
    if rank == 1:
        model[2].armed = True
    out["forward"] = _outcome(lambda: _step(schedule, x, y))
    if rank == 1:
        model[2].armed = False
    out["after"] = _outcome(lambda: _step(schedule, x, y))

    if rank == 2:
        model[4].armed = True
    out["backward"] = _outcome(lambda: _step(Schedule1F1B(stage, _mse), x, y))
    if rank == 2:
        model[4].armed = False

    def bad_loss(output: Tensor, target: Tensor) -> Tensor:
        raise ValueError("the loss refuses")

    out["loss"] = _outcome(lambda: _step(ScheduleZeroBubble(stage, bad_loss), x, y))

    def unprintable_loss(output: Tensor, target: Tensor) -> Tensor:
        raise _Unprintable()

    out["unprintable"] = _outcome(lambda: _step(ScheduleGPipe(stage, unprintable_loss), x, y))
    out["no input"] = _outcome(lambda: ScheduleGPipe(stage, _mse).step(None, y))

    # Different balances, then different layers: every rank refuses to start.
    balance = [2, 2, 3, 1] if rank == 2 else [2, 2, 2, 2]
    out["balance"] = _outcome(lambda: PipelineStage(mlp(), balance, chunks=4))
    other = mlp()
    if rank == 1:
        other[4] = nn.Linear(8, 8, bias=False)
    out["layers"] = _outcome(lambda: PipelineStage(other, [2, 2, 2, 2], chunks=4))
    out["last"] = _outcome(lambda: _step(ScheduleGPipe(stage, _mse), x, y))
    return out


def test_a_failure_on_one_rank_fails_every_rank_and_names_it() -> None:
    results = spawn(_faults_rank, 4)
    forward = [out["forward"] for out in results]
    assert forward[1]["type"] == "ZeroDivisionError"
    assert any("raised in 1F2 (stage 1 on rank 1" in note for note in forward[1]["notes"])
    for rank in (0, 2, 3):
        assert forward[rank]["type"] == "RemoteError"
        assert (forward[rank]["rank"], forward[rank]["stages"]) == (1, (1,))
        assert forward[rank]["action"] == "1F2"
        text = forward[rank]["text"]
        assert "rank 1 (stages [1]) raised ZeroDivisionError: boom on call 3" in text
        assert "Traceback on rank 1" in forward[rank]["text"]
    assert all(out["after"]["type"] is None for out in results)  # the stages go on

    backward = [out["backward"] for out in results]
    assert backward[2]["type"] == "KeyError"
    assert all(backward[r]["type"] == "RemoteError" for r in (0, 1, 3))
    assert all(backward[r]["action"].startswith("2B") for r in (0, 1, 3))

    loss = [out["loss"] for out in results]
    assert loss[3]["type"] == "ValueError"
    assert all(loss[r]["type"] == "RemoteError" and loss[r]["rank"] == 3 for r in (0, 1, 2))

    # An exception that cannot say what it is still ends the step on every rank.
    unprintable = [out["unprintable"] for out in results]
    assert unprintable[3]["type"] == "_Unprintable"
    for r in (0, 1, 2):
        assert unprintable[r]["type"] == "RemoteError"
        assert unprintable[r]["rank"] == 3
        assert "_Unprintable: <its str() raised AttributeError>" in unprintable[r]["text"]
        assert unprintable[r]["seconds"] < 30

    no_input = [out["no input"] for out in results]
    assert no_input[0]["type"] == "ValueError"
    assert "needs the input" in no_input[0]["text"]
    assert all(no_input[r]["rank"] == 0 for r in (1, 2, 3))

    texts = {out["balance"]["text"] for out in results}
    assert len(texts) == 1  # the same message everywhere
    assert all(out["balance"]["type"] == "ValueError" for out in results)
    assert "balance is [2, 2, 2, 2] on rank 0 but [2, 2, 3, 1] on rank 2" in texts.pop()
    layers = results[0]["layers"]
    assert layers["type"] == "ValueError"
    assert (
        "layer 4 is 4: Linear(weight (8, 8) float32, bias (8,) float32) on rank 0"
        in (layers["text"])
    )
    assert all(out["last"]["type"] is None for out in results)


def _death_rank(rank: int, world: int) -> dict[str, Any]:
    model = mlp()
    model[2] = _Armed(on=2)
    stage = PipelineStage(model, [2] * 4, chunks=4)
    if rank == 1:
        original = model[2].forward

        def die(x: Tensor) -> Tensor:
            if model[2].calls == 1:
                os._exit(7)  # a rank that dies in the middle of a step
            return original(x)

        model[2].forward = die  # type: ignore[method-assign]
    return _outcome(lambda: _step(Schedule1F1B(stage, _mse), _batch(1, 4, 4), _batch(2, 4, 4)))


def test_a_rank_that_dies_is_reported_by_every_other_before_any_timeout() -> None:
    timeout = 60.0
    results = spawn(_death_rank, 4, timeout=timeout, dies=1)
    assert results[1] == DIED
    for rank in (0, 2, 3):
        out = results[rank]
        assert out["type"] == "RemoteError", out
        assert out["rank"] == 1
        assert "rank 1 (stages [1]) died or cannot be reached" in out["text"]
        assert out["seconds"] < timeout / 2  # seen by the transport, not by a timeout


def _death_between_steps_rank(rank: int, world: int) -> dict[str, Any]:
    from torchgpipe.distributed import exchange

    exchange.LOST_GRACE = 2.0  # this process's: the test waits less
    stage = PipelineStage(mlp(), [2] * 4, chunks=4)
    schedule = Schedule1F1B(stage, _mse)
    x, y = _batch(1, 4, 4), _batch(2, 4, 4)
    _step(schedule, x, y)
    if rank == 1:
        os._exit(7)  # a rank that dies between two steps
    return {"next": _outcome(lambda: _step(schedule, x, y))}


def test_a_rank_that_dies_between_steps_is_reported_by_every_other_before_any_timeout() -> None:
    # Regression: the death could stall a living process's gloo connections (its event
    # loop spinning): the others then waited for its end until the timeout.
    timeout = 60.0
    results = spawn(_death_between_steps_rank, 4, timeout=timeout, dies=1)
    assert results[1] == DIED
    for rank in (0, 2, 3):
        out = results[rank]["next"]
        assert out["type"] == "RemoteError", out
        assert out["rank"] == 1, out
        assert "rank 1 (stages [1]) died or cannot be reached" in out["text"]
        assert out["seconds"] < timeout / 4  # LOST_GRACE at most, not the timeout


# What runs after the ranks agreed that a step ended well can still fail on one rank:
# a parameter's hook (a guard that refuses a gradient that is not finite), the backward
# into the caller's graph on rank 0. Regression: that rank alone failed, the others
# returned the step's result and stepped their optimizers, and the ranks drifted apart.


def _guard(grad: Tensor) -> Tensor:
    raise FloatingPointError("the gradient is not finite")


def _after_the_end_rank(rank: int, world: int) -> dict[str, Any]:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    stage = PipelineStage(mlp(), [4, 4], chunks=4)
    schedule = Schedule1F1B(stage, _mse)
    out: dict[str, Any] = {}
    handles = [p.register_hook(_guard) for p in stage.parameters()] if stage.is_last else []
    out["hook"] = _outcome(lambda: _step(schedule, x, y))
    out["hook grads"] = _grads(stage)
    for handle in handles:
        handle.remove()
    stage.zero_grad()
    made = _before()(x)
    made.sum().backward()  # frees the graph that made the input
    out["upstream"] = _outcome(lambda: _step(schedule, made, y))
    stage.zero_grad()
    out["next"] = _outcome(lambda: _step(schedule, x, y))
    out["next grads"] = _grads(stage)
    return out


def test_a_hook_or_the_callers_backward_failing_on_one_rank_fails_every_rank() -> None:
    timeout = 60.0
    results = spawn(_after_the_end_rank, 2, timeout=timeout)
    own, told = results[1]["hook"], results[0]["hook"]
    assert own["type"] == "FloatingPointError", own
    assert any("raised in the parameters' hooks on rank 1" in note for note in own["notes"])
    assert results[1]["hook grads"] == {}  # the hooked parameters' .grad as before the step
    assert told["type"] == "RemoteError", told
    assert (told["rank"], told["stages"], told["action"]) == (1, (1,), None)
    assert told["text"].startswith(
        "rank 1 (stages [1]) raised FloatingPointError: the gradient is not finite in the "
        "parameters' hooks, after the step had ended well on every rank"
    )
    own, told = results[0]["upstream"], results[1]["upstream"]
    assert own["type"] == "RuntimeError", own
    assert "backward through the graph a second time" in own["text"]
    assert told["type"] == "RemoteError", told
    assert (told["rank"], told["stages"]) == (0, (0,))
    assert "rank 0 (stages [0]) raised RuntimeError: " in told["text"]
    assert "in the backward into the caller's graph, after the step" in told["text"]
    for out in results:
        assert out["hook"]["seconds"] < timeout / 2
        assert out["next"]["type"] is None, out["next"]
    _, grads, _ = _reference(mlp(), _batch(1, 8, 4), _batch(2, 8, 4))
    _assert_close({**results[0]["next grads"], **results[1]["next grads"]}, grads)


def _refused_rank(rank: int, world: int, refusing: tuple[int, ...]) -> dict[str, Any]:
    # The ranks `refusing` are given a bad argument: each raises before building its
    # transport and its process ends (os._exit, as an uncaught exception would end it).
    # The others wait for each other before they leave: one that left would be gone too
    # for a slower one's greeting.
    live = dist.new_group([r for r in range(world) if r not in refusing])
    balance = [8 // world] * world
    chunks = 0 if rank in refusing else 2
    outcome = _outcome(lambda: PipelineStage(mlp(), balance, chunks=chunks))
    if rank in refusing:
        os._exit(3)
    dist.barrier(group=live)
    return outcome


@pytest.mark.parametrize(("world", "refusing"), [(2, (1,)), (4, (2,)), (4, (2, 3))])
def test_a_rank_that_refuses_its_arguments_is_reported_as_a_remote_error_naming_it(
    world: int, refusing: tuple[int, ...]
) -> None:
    results = spawn(_refused_rank, world, refusing, timeout=60.0, dies=len(refusing))
    for rank, out in enumerate(results):
        if rank in refusing:
            continue
        assert out["type"] == "RemoteError", out
        assert out["seconds"] < 30
        if len(refusing) == 1:
            [gone] = refusing
            assert (out["rank"], out["stages"]) == (gone, (gone,)), out
            assert f"could not reach rank {gone} while setting up" in out["text"]
            assert "failed before building its stage" in out["text"]
        else:  # which failed first is not known: every one is named
            assert (out["rank"], out["stages"]) == (-1, ()), out
            assert f"could not reach ranks {list(refusing)} while setting up" in out["text"]


def _destroyed_rank(rank: int, world: int) -> dict[str, Any]:
    stage = PipelineStage(mlp(), [4, 4], chunks=2)
    schedule = ScheduleGPipe(stage, _mse)
    x, y = _batch(1, 4, 4), _batch(2, 4, 4)
    schedule.step(x if rank == 0 else None, y if rank == 1 else None)
    dist.destroy_process_group()
    return _outcome(lambda: schedule.step(x if rank == 0 else None, y if rank == 1 else None))


def test_a_step_after_the_process_group_was_destroyed_is_refused_saying_so() -> None:
    # The transport holds the group, whose connections stay up after the destroy: a step
    # would run on a group torch.distributed no longer knows of.
    for out in spawn(_destroyed_rank, 2):
        assert out["type"] == "RuntimeError", out
        assert "the pipeline's process group was destroyed" in out["text"]
        assert "build the process group and the PipelineStage anew" in out["text"]


def _other_call_rank(rank: int, world: int) -> dict[str, Any]:
    stage = PipelineStage(mlp(), [4, 4], chunks=4)
    schedule = Schedule1F1B(stage, _mse)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    _step(schedule, x, y)
    out: dict[str, Any] = {}
    for case, clipping in [("1 clips", 1), ("0 clips", 0)]:
        if rank == clipping:
            out[case] = _outcome(lambda: stage.clip_grad_norm_(1.0))
        else:
            out[case] = _outcome(lambda: _step(schedule, x, y))
    stage.zero_grad()
    out["next"] = _step(schedule, x, y).loss, _grads(stage)
    return out


def test_a_rank_that_clips_while_the_other_steps_fails_both_before_any_timeout() -> None:
    # Before, each waited for the other's message until the process group's timeout,
    # then said the other had died.
    timeout = 60.0
    results = spawn(_other_call_rank, 2, timeout=timeout)
    for case, clipping in [("1 clips", 1), ("0 clips", 0)]:
        for rank, out in enumerate(results):
            failed = out[case]
            assert failed["type"] == "RuntimeError", (case, rank, failed)
            other = "stage.clip_grad_norm_()" if rank != clipping else "schedule.step()"
            mine = "schedule.step()" if rank != clipping else "stage.clip_grad_norm_()"
            said = f"rank {1 - rank} called {other} while this process called {mine}"
            assert said in failed["text"], (case, rank, failed)
            assert failed["seconds"] < timeout / 6, (case, rank, failed)
    loss, grads, _ = _reference(mlp(), _batch(1, 8, 4), _batch(2, 8, 4))
    merged: dict[str, Tensor] = {}
    for out in results:
        torch.testing.assert_close(out["next"][0], loss)
        merged.update(out["next"][1])
    assert sorted(merged) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-5, atol=1e-6)


def _build_during_step_rank(rank: int, world: int) -> dict[str, Any]:
    stage = PipelineStage(mlp(), [4, 4], chunks=4)
    schedule = Schedule1F1B(stage, _mse)
    _step(schedule, _batch(1, 8, 4), _batch(2, 8, 4))
    if rank == 0:  # uneven loops: rank 1 builds its next stage while rank 0 steps
        failed = _outcome(lambda: _step(schedule, _batch(1, 8, 4), _batch(2, 8, 4)))
        # The channels are out of step: the next call is refused at once, saying why.
        failed["next"] = _outcome(lambda: _step(schedule, _batch(1, 8, 4), _batch(2, 8, 4)))
        return failed
    return _outcome(lambda: PipelineStage(mlp(1), [4, 4], chunks=4))


def test_a_rank_that_builds_a_stage_while_another_steps_fails_both_in_python() -> None:
    # The new stage's greeting (8 bytes) met the step's header (512 bytes) under one
    # tag: gloo ended rank 1's process in C++, and rank 0 could not read what came.
    timeout = 60.0
    stepping, building = spawn(_build_during_step_rank, 2, timeout=timeout)
    assert stepping["type"] == "RemoteError", stepping
    assert "rank 1 (stages [1]) built a PipelineStage during this call" in stepping["text"]
    assert building["type"] == "RuntimeError", building
    assert "while rank(s) [0] of the pipeline make a call" in building["text"]
    for out in (stepping, building):
        assert "build the stages in every process at once" in out["text"]
        assert out["seconds"] < timeout / 6, out
    refused = stepping["next"]
    assert refused["type"] == "RuntimeError", refused
    assert "rank 1 built a PipelineStage in a call" in refused["text"]
    assert "Start every process anew" in refused["text"]
    assert refused["seconds"] < timeout / 6, refused


class _Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def _empty_clip_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)  # torch takes no inf norm of the empty weight's gradient
    model = nn.Sequential(nn.Embedding(8, 4), EmptyWeight(), _Mean(), nn.Linear(4, 4))
    stage = PipelineStage(model, [3, 1], chunks=2)
    ids, y = (
        torch.randint(0, 8, (4, 3), generator=torch.Generator().manual_seed(1)),
        _batch(2, 4, 4),
    )
    _step(Schedule1F1B(stage, _mse), ids, y)
    out = {"clip": _outcome(lambda: stage.clip_grad_norm_(1.0, norm_type=math.inf))}
    stage.zero_grad()
    out["next"] = _outcome(lambda: stage.clip_grad_norm_(1.0, norm_type=math.inf))
    return out


def test_a_rank_that_fails_to_compute_its_part_of_a_clip_fails_every_rank_at_once() -> None:
    # Regression: rank 1 waited for rank 0's part until the process group's timeout,
    # then said rank 0 had died (or, had rank 0 clipped again, took that call's part).
    timeout = 60.0
    results = spawn(_empty_clip_rank, 2, timeout=timeout)
    own, told = (out["clip"] for out in results)
    assert own["type"] == "RuntimeError", own
    assert any("raised on rank 0 in stage.clip_grad_norm_()" in note for note in own["notes"])
    assert told["type"] == "RemoteError", told
    assert told["rank"] == 0
    assert told["text"].startswith("rank 0 (stages [0]) raised RuntimeError: ")
    assert "in stage.clip_grad_norm_()" in told["text"]
    assert max(own["seconds"], told["seconds"]) < timeout / 6
    assert [out["next"]["type"] for out in results] == [None, None]  # it runs as usual


# Data parallelism: each stage replicated over a group of its own.


def _data_parallel_rank(rank: int, world: int) -> dict[str, Any]:
    # Ranks 0 and 1 are one pipeline, 2 and 3 the other; 0 and 2 replicate stage 0.
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, position = divmod(rank, 2)
    stage = PipelineStage(mlp(), [4, 4], chunks=2, group=pipelines[replica])
    assert stage.rank == position
    schedule = Schedule1F1B(stage, _mse)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    half = slice(4 * replica, 4 * replica + 4)
    _step(schedule, x[half], y[half])
    all_reduce_gradients(stage, replicas[position])
    grads = _grads(stage)
    optimizer.step()
    return {"grads": grads, "weights": stage.state_dict()}


def test_data_parallel_replicas_of_each_stage_match_the_plain_model() -> None:
    results = spawn(_data_parallel_rank, 4)
    plain = mlp()
    _, grads, _ = _reference(plain, _batch(1, 8, 4), _batch(2, 8, 4))
    for replica in (0, 1):
        merged = {**results[2 * replica]["grads"], **results[2 * replica + 1]["grads"]}
        _assert_close(merged, grads)
    for name, p in plain.named_parameters():
        p.grad = grads[name]
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    for out in results:
        for name, value in out["weights"].items():
            torch.testing.assert_close(value, plain.state_dict()[name], msg=name)


def _wrong_replicas_rank(rank: int, world: int) -> dict[str, Any]:
    # The pipeline's own group passed as the replicas': stage 0's gradients were averaged
    # with stage 1's (the same shapes), silently. Then a parameter frozen on one replica.
    stage = PipelineStage(mlp(), [4, 4], chunks=2)
    _step(Schedule1F1B(stage, _mse), _batch(1, 8, 4), _batch(2, 8, 4))
    grads = _grads(stage)
    out = {"stages": _outcome(functools.partial(all_reduce_gradients, stage, None))}
    after = _grads(stage)
    out["untouched"] = after.keys() == grads.keys() and all(
        torch.equal(after[k], grads[k]) for k in grads
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    net[0].bias.requires_grad_(rank == 0)
    net(torch.randn(2, 4)).sum().backward()
    out["frozen"] = _outcome(functools.partial(all_reduce_gradients, net, None))
    return out


def test_all_reduce_gradients_refuses_a_group_whose_members_hold_different_stages() -> None:
    results = spawn(_wrong_replicas_rank, 2, timeout=60.0)
    for rank, out in enumerate(results):
        for case, held in (("stages", f"stages [{rank}], 4 "), ("frozen", f"{4 - rank} ")):
            refused = out[case]
            assert refused["type"] == "ValueError", refused
            assert refused["text"].startswith(
                f"the members of group do not all hold the same stages and trainable "
                f"parameters: this process holds {held}trainable parameter tensors"
            ), refused["text"]
        assert out["untouched"]


class _ThreeHeads(nn.Module):
    """``used`` on every replica, ``partial`` on rank 0 only, ``unused`` on none."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.partial, self.unused = nn.Linear(2, 1), nn.Linear(2, 1), nn.Linear(2, 1)

    def forward(self, x: Tensor, rank: int) -> Tensor:
        y: Tensor = self.used(x)
        return y + self.partial(x) if rank == 0 else y


def _reduce_rank(rank: int, world: int) -> dict[tuple[str, str], Any]:
    pair = dist.new_group([0, 1])  # every process makes it; rank 2 is not in it
    out: dict[tuple[str, str], Any] = {}
    for op in ("mean", "sum"):
        torch.manual_seed(0)
        net = _ThreeHeads()
        net(torch.full((1, 2), rank + 1.0), rank).sum().backward()
        out[op, "own"] = _grads(net)
        out[op, "error"] = _outcome(functools.partial(all_reduce_gradients, net, pair, op=op))
        out[op, "reduced"] = {name: p.grad for name, p in net.named_parameters()}
    # A list of ranks for a group: torch failed on it with "unhashable type: 'list'".
    out["list", "error"] = _outcome(functools.partial(all_reduce_gradients, net, [0, 1, 2]))
    return out


def test_all_reduce_gradients_leaves_none_where_no_replica_has_a_gradient() -> None:
    # Regression: a parameter no replica used got a zero gradient (the plain model
    # leaves None, and AdamW's weight decay then moved it); and a process outside the
    # group flipped the sign of its gradients (its group size read -1).
    results = spawn(_reduce_rank, 3, timeout=30.0)
    for op, divide in [("mean", 2.0), ("sum", 1.0)]:
        mine = [results[r][op, "own"] for r in range(3)]
        for rank in (0, 1):
            assert results[rank][op, "error"]["type"] is None
            got = results[rank][op, "reduced"]
            for name in ("used.weight", "used.bias"):
                torch.testing.assert_close(got[name], (mine[0][name] + mine[1][name]) / divide)
            for name in ("partial.weight", "partial.bias"):  # rank 1 counts zero
                torch.testing.assert_close(got[name], mine[0][name] / divide)
            assert [got["unused.weight"], got["unused.bias"]] == [None, None]
        outside = results[2][op, "error"]
        assert outside["type"] == "ValueError", outside
        assert outside["text"].startswith(
            "this process (global rank 2) is not in the process group given as group=; "
            "pass a group that includes it, the group of this stage's replicas"
        )
        left = results[2][op, "reduced"]  # as they were
        assert {name for name, grad in left.items() if grad is not None} == set(mine[2])
        for name, grad in mine[2].items():
            torch.testing.assert_close(left[name], grad)
    for out in results:
        refused = out["list", "error"]
        assert refused["type"] == "TypeError", refused
        assert refused["text"].startswith(
            "group must be a ProcessGroup, or None for the default group; got [0, 1, 2] of "
            "type list: make the group with dist.new_group([0, 1, 2]) in every process"
        )


# Sparse gradients (nn.Embedding(sparse=True)). Regression: the replica with one
# failed in its flat bucket (reshape of a sparse tensor), and a replica without one
# waited in the all_reduce until the process group's timeout.
#
# Per case, what each replica does: the rows it looks up with a weight each (row 5's
# weight is 0: named by the gradient, which is 0 there), nothing, or a dense use.
_SPARSE_CASES: dict[str, list[Any]] = {
    "one replica": [([1, 3, 5], [1.0, 2.0, 0.0]), None],
    "both": [([1, 3, 5], [1.0, 2.0, 0.0]), ([3, 4, 3], [1.0, -1.0, 0.5])],
    "sparse and dense": [([1, 3, 5], [1.0, 2.0, 0.0]), "dense"],
}


def _sparse_rank(rank: int, world: int) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for case, uses in _SPARSE_CASES.items():
        for op in ("mean", "sum"):
            torch.manual_seed(0)
            net = nn.ModuleDict({"emb": nn.Embedding(6, 3, sparse=True), "head": nn.Linear(3, 1)})
            use = uses[rank]
            if use == "dense":
                net["head"](net["emb"].weight).sum().backward()
            elif use is not None:
                rows, weights = use
                h = net["head"](net["emb"](torch.tensor(rows)))
                (h.squeeze(1) * torch.tensor(weights)).sum().backward()
            out[case, op, "own"] = {  # copies: a dense .grad is reduced in place
                n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()
            }
            start = time.monotonic()
            out[case, op, "error"] = _outcome(
                functools.partial(all_reduce_gradients, net, None, op=op)
            )
            out[case, op, "seconds"] = time.monotonic() - start
            out[case, op, "reduced"] = {n: p.grad for n, p in net.named_parameters()}
    return out


def _half_mean_rank(rank: int, world: int) -> Tensor:
    net = nn.Linear(2, 1, bias=False).half()
    net.weight.grad = torch.full_like(net.weight, 40000.0)
    all_reduce_gradients(net, None, op="mean")
    return net.weight.grad


def test_all_reduce_gradients_mean_of_float16_fits_where_the_sum_would_not() -> None:
    # Summed first, two float16 gradients of 40000 made inf (over 65504) before the
    # division; DDP divides first, and so does this.
    for grad in spawn(_half_mean_rank, 2, timeout=30.0):
        assert torch.equal(grad, torch.full((1, 2), 40000.0, dtype=torch.half))


def test_all_reduce_gradients_averages_sparse_gradients_as_the_plain_sum_would() -> None:
    results = spawn(_sparse_rank, 2, timeout=30.0)
    for case, op in [(case, op) for case in _SPARSE_CASES for op in ("mean", "sum")]:
        owns = [results[r][case, op, "own"] for r in range(2)]
        for name in ("emb.weight", "head.weight", "head.bias"):
            present = [own[name] for own in owns if own[name] is not None]
            expected = present[0]
            for grad in present[1:]:  # autograd's sum: sparse where every part is
                expected = grad + expected if expected.is_sparse else expected + grad
            expected = expected / 2 if op == "mean" else expected
            for r in range(2):
                assert results[r][case, op, "error"]["type"] is None, results[r][case, op]
                got = results[r][case, op, "reduced"][name]
                assert got.layout == expected.layout, (case, op, name, r)
                if got.is_sparse:  # the rows the replicas' gradients name, row 5 too
                    want = expected.coalesce()
                    assert got.is_coalesced()
                    assert torch.equal(got.indices(), want.indices()), (case, op, r)
                    torch.testing.assert_close(got.values(), want.values())
                else:
                    torch.testing.assert_close(got, expected, msg=f"{case} {op} {name}")
    assert results[0]["one replica", "mean", "reduced"]["emb.weight"].indices().tolist() == [
        [1, 3, 5]
    ]


def _meta_trace_and_forward_only_rank(rank: int, world: int) -> dict[str, Any]:
    plain = mlp()  # every process seeds alike: the same plain model
    with torch.device("meta"):
        model = mlp()
    stage = PipelineStage(model, [4, 4], chunks=4, state_dict=plain.state_dict())
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.ones(8, 4)
    schedule = Schedule1F1B(stage, _mse)
    with stage.trace() as trace:
        result = schedule.step(x if stage.is_first else None, y if stage.is_last else None)
    merged = stage.gather_trace(trace)
    stage.eval()
    output = schedule.forward_only(x if stage.is_first else None)
    return {
        "loss": result.loss,
        "expected_loss": _mse(plain(x), y).detach(),
        "stages": sorted({e.j for e in merged.events}) if merged is not None else None,
        "threads": sorted({e.thread.split(":")[0] for e in merged.events}) if merged else None,
        "output": output,
        "expected_output": plain.eval()(x).detach(),
        "meta_elsewhere": all(
            p.is_meta for name, layer in model.named_children()
            if name not in dict(stage.named_children()) for p in layer.parameters()
        ),
    }  # fmt: skip


def test_a_meta_model_traced_then_served_across_processes() -> None:
    results = spawn(_meta_trace_and_forward_only_rank, 2)
    for r in results:
        torch.testing.assert_close(r["loss"], r["expected_loss"])
        assert r["meta_elsewhere"]  # each process allocated its own layers only
    assert results[0]["stages"] == [0, 1]
    assert results[0]["threads"] == ["rank 0", "rank 1"]
    assert results[1]["stages"] is None
    assert results[0]["output"] is None
    torch.testing.assert_close(results[1]["output"], results[1]["expected_output"])


def _recorded_rank(rank: int, world: int, schedule: str) -> list[tuple[str, list[Any]]]:
    """Steps, each group of point-to-point operations recorded as the transport issues it."""
    from torchgpipe.distributed import transport

    record: list[tuple[str, list[Any]]] = []
    real = transport.ProcessGroupTransport.issue

    def recording(self: Any, transfers: Any) -> Any:
        ops = [(t.peer, t.kind, t.buffer.numel() * t.buffer.element_size()) for t in transfers]
        record.append((threading.current_thread().name, ops))
        return real(self, transfers)

    transport.ProcessGroupTransport.issue = recording  # type: ignore[method-assign]
    name, _, static = schedule.partition(" ")
    factory = {**SCHEDULES, "interleaved": ScheduleInterleaved1F1B}[name]
    stages = world * (2 if name == "interleaved" else 1)
    stage = PipelineStage(
        skip_net(), [8 // stages] * stages, chunks=4, static_shapes=static == "static"
    )
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for _ in range(2):
        _step(factory(stage, _mse), x, y)
    return record


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved", "1f1b static"])
def test_a_step_issues_what_nccl_would_run(schedule: str) -> None:
    from nccl_rules import NCCLRules

    records = spawn(_recorded_rank, 2, schedule)
    rules = NCCLRules(2)
    for rank, record in enumerate(records):
        assert record, "no transfers were issued"
        for thread, ops in record:
            rules.group(rank, ops, thread=thread)
    rules.check()


# A value laid out otherwise than at the last step on the same input: moved whole.


def _moving_rank(rank: int, world: int) -> list[tuple[float, float, list[str]]]:
    stage = PipelineStage(widening(), [4, 6], chunks=4)
    sent: list[str] = []
    send = stage.transport.send

    def noted(peer: int, header: Any, tensors: Any) -> None:
        sent.append(header[0])
        send(peer, header, tensors)

    stage.transport.send = noted  # type: ignore[method-assign]
    schedule = Schedule1F1B(stage, _mse)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    plain = widening()
    loss = _mse(plain(x), y)
    loss.backward()
    expected = dict(plain.named_parameters())
    out = []
    for wide in [False, True, True, True, False]:
        Widen.wide = wide
        stage.zero_grad()
        before = len(sent)
        result = _step(schedule, x, y)
        error = max(
            float((p.grad - expected[n].grad).abs().max())  # type: ignore[operator]
            for n, p in stage.named_parameters()
        )
        out.append((float(result.loss) - float(loss), error, sent[before:]))
    return out


def test_a_value_laid_out_anew_moves_whole_between_gloo_processes() -> None:
    # Stage 0's output (and so its gradient) is one feature wider at steps 1 to 3.
    for out in spawn(_moving_rank, 2):
        for loss_error, grad_error, _ in out:
            assert abs(loss_error) < 1e-6
            assert grad_error < 1e-6
        kinds = [[k for k in sent if k in ("metadata", "moved")] for _, _, sent in out]
        assert kinds[0] == ["metadata"] * 4  # nothing known yet: one per micro-batch
        assert kinds[1] == ["moved"] * 4  # laid out anew: moved whole
        assert kinds[2] == ["metadata"] * 4  # a step that moved is not remembered
        assert kinds[3] == []  # the wider layout, known
        assert kinds[4] == ["moved"] * 4  # and back


# Every process's default generator moves on alike: a loop shuffling its data on each
# rank under one seed keeps its inputs and targets together.


def _meta_layers() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())


def _generator_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(5)
    stage = PipelineStage(_meta_layers(), [2, 2], chunks=2)  # each rank resets its own
    x, y = _batch(1, 8, 4), _batch(2, 8, 16)
    schedule = Schedule1F1B(stage, _mse)
    for _ in range(2):
        _step(schedule, x, y)
    schedule.forward_only(x if rank == 0 else None)
    values = {name: value.detach() for name, value in stage.state_dict().items()}
    return {"generator": torch.get_rng_state(), "values": values}


def test_every_process_default_generator_moves_on_alike() -> None:
    # Rank 0 alone drew each step's seed, and each rank's resets drew for its own layers.
    results = spawn(_generator_rank, 2)
    assert torch.equal(results[0]["generator"], results[1]["generator"])
    # A layer's values depend on the seed and its place: whatever the balance fills it.
    torch.manual_seed(5)
    one = GPipe(_meta_layers(), [3, 1], chunks=2)
    values = {**results[0]["values"], **results[1]["values"]}
    assert values.keys() == one.state_dict().keys()
    for name, value in one.state_dict().items():
        torch.testing.assert_close(values[name], value, rtol=0, atol=0, msg=name)


# Randomness across processes: the seed rank 0 draws, not what each process drew before.


def _dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))


def _dropout_rank(rank: int, world: int) -> dict[str, Any]:
    stage = PipelineStage(_dropout_model(), [2, 2], chunks=2)
    torch.manual_seed(5)
    if rank == 1:  # as a data loader of the last rank only might: another generator state
        torch.rand(7)
    x, y = _batch(1, 8, 4), _batch(2, 8, 16)
    schedule = Schedule1F1B(stage, _mse)
    _step(schedule, x, y)
    return {"grads": _grads(stage), "output": schedule.forward_only(x if rank == 0 else None)}


def test_dropout_across_processes_follows_the_seed_rank_0_draws() -> None:
    results = spawn(_dropout_rank, 2)
    one = GPipe(_dropout_model(), [2, 2], chunks=2)
    torch.manual_seed(5)
    x, y = _batch(1, 8, 4), _batch(2, 8, 16)
    single.Schedule1F1B(one, _mse).step(x, y)
    output = single.Schedule1F1B(one, _mse).forward_only(x)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert grads.keys() == _grads(one).keys()
    for name, grad in _grads(one).items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    torch.testing.assert_close(results[1]["output"], output)


def _ddp_rank(rank: int, world: int, checkpoint: str) -> float:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    plain = build()
    reference = nn.parallel.DistributedDataParallel(plain)
    pipe = GPipe(build(), [1, 2], chunks=4, checkpoint=checkpoint)
    # A gradient per micro-batch reaches each parameter: static_graph takes it (README).
    wrapped = nn.parallel.DistributedDataParallel(pipe, static_graph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, pipe)]
    for k in range(3):
        x, y = _batch(10 * k + rank, 8, 4), _batch(10 * k + rank + 1, 8, 3)
        for model, optimizer in zip((reference, wrapped), optimizers, strict=True):
            optimizer.zero_grad()
            _mse(model(x), y).backward()
            optimizer.step()
    pairs = zip(plain.parameters(), pipe.parameters(), strict=True)
    return max(float((p - q).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_distributed_data_parallel_around_a_gpipe_averages_as_around_the_plain_model(
    checkpoint: str,
) -> None:
    for difference in spawn(_ddp_rank, 2, checkpoint):
        assert difference < 1e-6
