"""Every schedule's step, played under NCCL's point-to-point rules (issue 13, part 2).

Threads play the ranks on a LocalTransport mesh that reports every group of transfers
to :class:`nccl_rules.NCCLRules` as it is issued: a second issuing thread in a rank
fails that rank at once, and ``check()`` afterwards plays the groups out as NCCL would
and fails where it would hang or mismatch. Each step must also give the unwrapped
model's loss, output and gradients: the same data, moved by the new transfers.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from distributed_helpers import Widen, mlp, record_net, run_threads, skip_net, widening
from nccl_rules import NCCLRules
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.distributed import (
    LocalTransport,
    PipelineStage,
    RemoteError,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    Transport,
)

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zero-bubble": ScheduleZeroBubble,
    "interleaved": ScheduleInterleaved1F1B,
}


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bn_net8(seed: int = 0) -> nn.Sequential:
    """Eight layers with batch norm in three places, for deferred batch norm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 4),
        nn.BatchNorm1d(4),
    )


def _loss_or_error(driver: Any, x: Tensor, y: Tensor | None) -> Any:
    """One step's loss, or what it raised; each rank passes what its stages need."""
    stage = driver.pipe
    try:
        result = driver.step(x if stage.is_first else None, y if stage.is_last else None)
        return float(result.loss)
    except BaseException as error:
        return error


def _balance(world: int, schedule: str, layers: int) -> list[int]:
    stages = world * (2 if schedule == "interleaved" else 1)
    return [layers // stages] * stages


def _play(
    world: int,
    schedule: str,
    build: Callable[[], nn.Sequential],
    batches: list[tuple[Tensor, Tensor]],
    **options: Any,
) -> tuple[list[Any], NCCLRules]:
    """Steps of ``schedule`` over ``build()``'s stages on ``world`` ranks, under the rules."""
    rules = NCCLRules(world)
    models = [build() for _ in range(world)]  # before the threads: the global RNG

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank],
            _balance(world, schedule, len(models[0])),
            transport=transport,
            **options,
        )
        driver = SCHEDULES[schedule](stage, _mse)
        steps = []
        for x, y in batches:
            stage.zero_grad()
            result = driver.step(x if stage.is_first else None, y if stage.is_last else None)
            grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
            steps.append((result.loss, result.output, grads))
        return steps, stage.state_dict()

    return run_threads(rank, world, timeout=30.0, observe=rules.group), rules


def _check_against_plain(
    results: list[Any],
    build: Callable[[], nn.Sequential],
    batches: list[tuple[Tensor, Tensor]],
    *,
    reference: Callable[[nn.Sequential], nn.Module] = lambda model: model,
) -> None:
    """Each step's loss, output and gradients, and the state after, as ``reference``'s.

    ``reference`` wraps the plain model (in a GPipe, for deferred batch norm, whose
    normalization is per micro-batch).
    """
    for value in results:
        assert not isinstance(value, BaseException), value
    model = reference(copy.deepcopy(build()))
    for k, (x, y) in enumerate(batches):
        model.zero_grad()
        output = model(x)
        loss = _mse(output, y)
        loss.backward()
        grads: dict[str, Tensor] = {}
        for steps, _ in results:
            grads.update(steps[k][2])
        expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert sorted(grads) == sorted(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        for steps, _ in results:
            torch.testing.assert_close(steps[k][0], loss.detach(), rtol=1e-5, atol=1e-6)
        last_output = results[-1][0][k][1]
        torch.testing.assert_close(last_output, output.detach(), rtol=1e-5, atol=1e-6)
    state: dict[str, Tensor] = {}
    for _, part in results:
        state.update(part)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=name)


# Two steps of different batch sizes: shapes change between steps.
BATCHES = [(_batch(1, 8, 4), _batch(2, 8, 4)), (_batch(3, 12, 4), _batch(4, 12, 4))]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_with_skips_obeys_nccl_rules(
    world: int, schedule: str, checkpoint: str
) -> None:
    results, rules = _play(world, schedule, skip_net, BATCHES, chunks=4, checkpoint=checkpoint)
    _check_against_plain(results, skip_net, BATCHES)
    rules.check()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world", [2, 4])
def test_deferred_batch_norm_obeys_nccl_rules(world: int, schedule: str) -> None:
    results, rules = _play(world, schedule, bn_net8, BATCHES, chunks=4, deferred_batch_norm=True)
    _check_against_plain(
        results,
        bn_net8,
        BATCHES,
        reference=lambda model: GPipe(model, [4, 4], chunks=4, deferred_batch_norm=True),
    )
    rules.check()


def test_structured_values_obey_nccl_rules() -> None:
    # Dicts, lists, strings and a bool mask between the stages.
    batches = [(_batch(5, 4, 3, 4), _batch(6, 4, 4)), (_batch(7, 4, 5, 4), _batch(8, 4, 4))]
    results, rules = _play(2, "1f1b", record_net, batches, chunks=2)
    _check_against_plain(results, record_net, batches)
    rules.check()


class _Fan(nn.Module):
    """Hands on four tensors: two independent, and one tensor twice."""

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        g = h + 1
        return h.tanh(), h * 2, g, g


class _InPlace(nn.Module):
    """Changes two of its inputs in place; the first of them saved by nothing."""

    def forward(self, p: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        a, b, c, d = p
        torch.relu_(b)  # a, which sin() saves, is another tensor: untouched
        c.mul_(2)  # d is c: doubled too
        return a.sin() + b + c * d


def fan_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), _Fan(), _InPlace(), nn.Linear(4, 4))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_received_tensors_are_as_independent_as_the_sent_ones(
    schedule: str, checkpoint: str
) -> None:
    # The tensors of one message arrive in one buffer: each must still be a tensor of
    # its own (an in-place change of one is no change of another), and one tensor sent
    # twice must arrive as one.
    results, rules = _play(2, schedule, fan_net, BATCHES, chunks=4, checkpoint=checkpoint)
    _check_against_plain(results, fan_net, BATCHES)
    rules.check()


def test_a_failed_step_leaves_the_transfers_matched_and_the_next_step_works() -> None:
    rules = NCCLRules(2)
    models = [skip_net() for _ in range(2)]

    class Fails(nn.Module):
        armed = True

        def forward(self, x: Tensor) -> Tensor:
            if Fails.armed and x.shape[0] == 2 and x.sum() > -1e9:
                Fails.armed = False
                raise RuntimeError("boom, once")
            return x

    def rank(transport: Transport) -> Any:
        model = models[transport.rank]
        model[5] = nn.Sequential(model[5], Fails())  # stage 1 of 2 fails once
        stage = PipelineStage(model, [4, 4], transport=transport, chunks=4)
        driver = Schedule1F1B(stage, _mse)
        x, y = BATCHES[0]
        return [_loss_or_error(driver, x, y) for _ in range(2)]

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    first = [outcomes[0] for outcomes in results]
    assert isinstance(first[0], RemoteError)
    assert first[0].rank == 1
    assert isinstance(first[1], RuntimeError)
    assert "boom" in str(first[1])
    second = [outcomes[1] for outcomes in results]
    assert all(isinstance(loss, float) for loss in second), second
    assert second[0] == second[1]
    rules.check()


@pytest.mark.parametrize("fails", [False, True])
def test_the_callers_graph_gets_its_gradients_only_from_a_step_that_ended_well(
    fails: bool,
) -> None:
    # The last rank fails after its last action (its output does not gather: a number
    # that differs between micro-batches), when the first rank already holds every
    # gradient of its input.
    class Aux(nn.Module):
        def forward(self, x: Tensor) -> Any:
            return (x, float(x.detach().mean())) if fails else x

    def loss(output: Any, target: Tensor) -> Tensor:
        return _mse(output[0], target) + output[1] if fails else _mse(output, target)

    rules = NCCLRules(2)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Aux()) for _ in range(2)]
    embeddings = [nn.Linear(4, 4) for _ in range(2)]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [1, 2], transport=transport, chunks=4)
        embedding = embeddings[transport.rank]
        try:
            ScheduleZeroBubble(stage, loss).step(
                embedding(x) if stage.is_first else None, y if stage.is_last else None
            )
        except Exception as error:
            return error, embedding.weight.grad
        return None, embedding.weight.grad

    (first, grad), (last, _) = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    if fails:
        assert isinstance(first, RemoteError)
        assert isinstance(last, ValueError)
        assert grad is None  # as in one process: a failed step leaves the caller's graph
    else:
        assert first is None
        assert last is None
        assert grad is not None
    rules.check()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_only_obeys_nccl_rules(schedule: str) -> None:
    rules = NCCLRules(4)
    models = [skip_net() for _ in range(4)]
    x = _batch(9, 8, 4)

    def rank(transport: Transport) -> Any:
        balance = _balance(4, schedule, 8)
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        return SCHEDULES[schedule](stage, _mse).forward_only(x if stage.is_first else None)

    results = run_threads(rank, 4, timeout=30.0, observe=rules.group)
    assert results[:3] == [None, None, None]
    with torch.no_grad():
        torch.testing.assert_close(results[3], skip_net()(x))
    rules.check()


def test_ranks_that_disagree_on_the_call_fail_and_leave_the_transfers_matched() -> None:
    # Rank 0 serves (forward_only) while rank 1 trains (step): rank 1 refuses, after
    # taking in what rank 0 sent by rank 0's plan; both then run a step together.
    rules = NCCLRules(2)
    models = [skip_net() for _ in range(2)]
    x, y = BATCHES[0]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [4, 4], transport=transport, chunks=4)
        driver = Schedule1F1B(stage, _mse)
        outcomes: list[Any] = []
        try:
            if stage.is_first:
                outcomes.append(driver.forward_only(x))
            else:
                outcomes.append(driver.step(None, y))
        except BaseException as error:
            outcomes.append(error)
        result = driver.step(x if stage.is_first else None, y if stage.is_last else None)
        return [*outcomes, float(result.loss)]

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    assert isinstance(results[1][0], ValueError)
    assert "rank 0 runs schedule.forward_only() but rank 1 runs schedule.step()" in str(
        results[1][0]
    )
    assert isinstance(results[0][0], RemoteError)
    assert results[0][0].rank == 1
    assert results[0][1] == results[1][1]
    rules.check()


def test_a_value_that_cannot_cross_fails_its_rank_and_leaves_the_transfers_matched() -> None:
    # Stage 0's output holds a lambda once: its metadata cannot be pickled, so no bytes
    # may go either; the next step works on both ranks.
    rules = NCCLRules(2)

    class Wrap(nn.Module):
        calls = 0

        def forward(self, x: Tensor) -> Any:
            Wrap.calls += 1
            return (x, (lambda: 0) if Wrap.calls == 2 else None)

    class Unwrap(nn.Module):
        def forward(self, pair: Any) -> Tensor:
            return pair[0]

    def build() -> nn.Sequential:
        layers = list(skip_net())
        return nn.Sequential(*layers[:3], Wrap(), Unwrap(), *layers[3:])

    models = [build() for _ in range(2)]
    x, y = BATCHES[0]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [4, 6], transport=transport, chunks=4)
        driver = Schedule1F1B(stage, _mse)
        return [_loss_or_error(driver, x, y) for _ in range(2)]

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    assert "pickle" in str(results[0][0])
    assert isinstance(results[1][0], RemoteError)
    with torch.no_grad():
        expected = float(_mse(build()(x), y))
    assert results[0][1] == pytest.approx(expected, rel=1e-6)
    assert results[1][1] == pytest.approx(expected, rel=1e-6)
    rules.check()


def test_a_rank_halted_before_the_start_came_still_takes_its_part(monkeypatch: Any) -> None:
    # Three ranks; the last has no target and fails. Rank 1 hears of it before rank 0's
    # start (played by its take of the start raising Stopped): rank 0 may already have
    # sent it metadata, so rank 1 must still issue the matching receives.
    from torchgpipe.distributed import exchange

    rules = NCCLRules(3)
    models = [mlp() for _ in range(3)]
    real_take = exchange.Exchange.take
    first = {"done": False}

    def take(self: Any, key: Any) -> Any:
        if key == ("start",) and self.rank == 1 and not first["done"]:
            first["done"] = True
            self.wait_for(("hold",), 2)  # until rank 2 has ended: it failed
            raise exchange.Stopped
        return real_take(self, key)

    monkeypatch.setattr(exchange.Exchange, "take", take)
    x, y = BATCHES[0]

    def rank(transport: Transport) -> Any:
        balance = [2, 2, 4]
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        driver = Schedule1F1B(stage, _mse)
        # The first step forgets the target on the last rank.
        return [_loss_or_error(driver, x, target) for target in (None, y)]

    results = run_threads(rank, 3, timeout=30.0, observe=rules.group)
    assert isinstance(results[2][0], ValueError)
    assert all(isinstance(r[0], RemoteError) for r in results[:2])
    with torch.no_grad():
        expected = float(_mse(mlp()(x), y))
    assert [r[1] for r in results] == pytest.approx([expected] * 3, rel=1e-6)
    rules.check()


def test_a_round_that_cannot_be_built_is_left_whole_for_the_drain() -> None:
    # Rank 1's round: two receives from rank 0. The second's metadata is not there (the
    # step halts meanwhile): nothing of the round may be used up, so that the drain
    # issues both receives, matching rank 0's two sends.
    from torchgpipe.distributed.plan import Message, RankPlan
    from torchgpipe.distributed.transfers import Transfers
    from torchgpipe.distributed.transport import Transfer
    from torchgpipe.distributed.wire import pack
    from torchgpipe.mailbox import Stopped

    rules = NCCLRules(2)
    t0, t1 = LocalTransport.mesh(2, timeout=5.0, observe=rules.group)
    messages = (Message(("F", 1, 0), 0, 1), Message(("S", 0, 0), 0, 1))
    frames = {m.key: ("metadata", m.key, [((2,), torch.float32)], b"") for m in messages}
    consumed: list[Any] = []

    def metadata(message: Message, draining: bool) -> Any:
        if message.key == ("S", 0, 0) and not draining:
            raise Stopped
        return frames[message.key]

    transfers = Transfers(
        t1,
        metadata=metadata,
        arrived=lambda message: False,
        consume=consumed.append,
        lose=print,
        lost=lambda peer: False,
    )
    transfers.follow(RankPlan(starts=(1.0,), rounds=((0.0, messages),), receives=frozenset()))
    with pytest.raises(Stopped):
        transfers.issue_before(0)
    assert consumed == []
    sent = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    t0.issue([Transfer("send", 1, pack([t], torch.device("cpu"))) for t in sent])
    got = [transfers.receive(m.key) for m in messages]  # nothing yet: not issued
    assert got == [None, None]
    transfers.drain()
    assert consumed == [("F", 1, 0), ("S", 0, 0)]
    rules.check()


def _counting(transport: Transport, counts: list[str]) -> Transport:
    """``transport``, noting the metadata and the moved values it sends on the side channel."""
    send = transport.send

    def counted(peer: int, header: Any, tensors: Any) -> None:
        if header[0] in ("metadata", "moved"):
            counts.append(header[0])
        send(peer, header, tensors)

    transport.send = counted  # type: ignore[method-assign]
    return transport


class _GPULike(LocalTransport):
    """A LocalTransport that reads no marks, as on a GPU wire (NCCL's default path)."""

    reads_marks = False  # type: ignore[assignment]


def _gpu_like(transport: Transport) -> Transport:
    transport.__class__ = _GPULike
    return transport


@pytest.mark.parametrize("mode", ["static", "default", "default on a GPU wire"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layouts", [1, 8])
def test_no_metadata_travels_once_the_input_repeats(
    schedule: str, layouts: int, mode: str, monkeypatch: Any
) -> None:
    # With static shapes, as promised; by default, as predicted from the last step where
    # a mark can be read; on a GPU wire the default sends metadata at every step.
    from torchgpipe.distributed import schedule as step_module

    monkeypatch.setattr(step_module, "LAYOUTS", layouts)  # how many layouts are remembered
    rules = NCCLRules(2)
    models = [skip_net() for _ in range(2)]
    first, second = BATCHES
    batches = [first, first, second, second, first]  # a new input shape, then the old
    counts: list[list[str]] = [[] for _ in batches]

    def rank(transport: Transport) -> Any:
        seen: list[str] = []
        if mode == "default on a GPU wire":
            transport = _gpu_like(transport)
        stage = PipelineStage(
            models[transport.rank],
            _balance(2, schedule, 8),
            transport=_counting(transport, seen),
            chunks=4,
            static_shapes=mode == "static",
        )
        driver = SCHEDULES[schedule](stage, _mse)
        out = []
        for k, (x, y) in enumerate(batches):
            stage.zero_grad()
            before = len(seen)
            result = driver.step(x if stage.is_first else None, y if stage.is_last else None)
            counts[k] += seen[before:]
            grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
            out.append((result.loss, result.output, grads))
        return out, stage.state_dict()

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    _check_against_plain(results, skip_net, batches)
    assert all("moved" not in c for c in counts)  # every value laid out as predicted
    sent = [len(c) for c in counts]
    assert sent[0] > 0  # the first step sends metadata
    if mode == "default on a GPU wire":
        assert sent == [sent[0]] * len(batches)
        rules.check()
        return
    assert sent[2] == sent[0]  # and so does the first with a new input shape
    assert sent[1] == sent[3] == 0  # the repeats send none
    if layouts > 1:
        assert sent[4] == 0  # the first input's layout is still remembered
    else:
        assert sent[4] == sent[0]  # only the last one is: this step sends again
    rules.check()


def test_static_shapes_refuse_a_value_that_changes_and_keep_the_transfers_matched() -> None:
    # The second step's stage 0 output is one feature wider at the same input shape.
    rules = NCCLRules(2)

    models = [widening() for _ in range(2)]
    x, y = _batch(1, 4, 4), _batch(2, 4, 4)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank], [4, 6], transport=transport, chunks=4, static_shapes=True
        )
        driver = Schedule1F1B(stage, _mse)
        outcomes: list[Any] = []
        for k in range(3):
            if stage.is_first:
                Widen.wide = k == 1  # stage 0 alone runs it
            outcomes.append(_loss_or_error(driver, x, y))
        return outcomes

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    error = results[0][1]
    assert isinstance(error, ValueError)
    assert "static_shapes=True, but the value under ('F', 1, 0)" in str(error)
    assert "tensors [1, 8] float32 then, [1, 9] float32 now" in str(error)
    assert isinstance(results[1][1], RemoteError)
    Widen.wide = False
    with torch.no_grad():
        expected = float(_mse(widening()(x), y))
    for outcomes in results:
        assert outcomes[0] == pytest.approx(expected, rel=1e-6)
        assert outcomes[2] == pytest.approx(expected, rel=1e-6)  # then a step that works
    rules.check()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(
    ("world", "schedule"),
    [(2, "gpipe"), (2, "1f1b"), (2, "zero-bubble"), (2, "interleaved"), (4, "1f1b"), (4, "gpipe")],
)
def test_a_value_laid_out_anew_moves_to_the_side_channel(
    world: int, schedule: str, checkpoint: str
) -> None:
    # By default a step on a repeated input predicts every value's layout from the last
    # step; stage 0's output (and its gradient) here is one feature wider at steps 1
    # and 2. Those values go whole on the side channel, the planned transfers carry
    # zeros marked so (still matched as NCCL wants), and step 2 predicts the new layout.
    rules = NCCLRules(world)
    models = [widening() for _ in range(world)]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    wide = [False, True, True, True, False]
    balance = [4, 2, 2, 2] if world == 4 or schedule == "interleaved" else [4, 6]

    def rank(transport: Transport) -> Any:
        seen: list[str] = []
        stage = PipelineStage(
            models[transport.rank],
            balance,
            transport=_counting(transport, seen),
            chunks=4,
            checkpoint=checkpoint,
        )
        driver = SCHEDULES[schedule](stage, _mse)
        out = []
        for widen in wide:
            if stage.is_first:
                Widen.wide = widen  # stage 0 alone runs it, and waits for no other rank
            stage.zero_grad()
            before = len(seen)
            result = driver.step(x if stage.is_first else None, y if stage.is_last else None)
            grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
            out.append((result.loss, result.output, grads, seen[before:]))
        return out

    results = run_threads(rank, world, timeout=30.0, observe=rules.group)
    Widen.wide = False
    rules.check()
    plain = widening()
    plain(x).sub(y).pow(2).mean().backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    names = {n for out in results for n in out[0][2]}
    assert names == set(expected)
    for out in results:
        for loss, output, grads, _ in out:
            if loss is not None:
                with torch.no_grad():
                    assert float(loss) == pytest.approx(float(_mse(plain(x), y)), rel=1e-6)
            if output is not None:
                torch.testing.assert_close(output, plain(x).detach())
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name])
    sent = [[kind for out in results for kind in out[k][3]] for k in range(len(wide))]
    assert "metadata" in sent[0]  # nothing known yet
    assert "moved" not in sent[0]
    assert sent[1] == ["moved"] * 8  # stage 0's output and its gradient, 4 micro-batches
    assert sent[2] == ["metadata"] * len(sent[0])  # a step that moved is not remembered
    assert sent[3] == []  # the wider layout, learned
    assert sent[4] == ["moved"] * 8  # and back


def test_a_value_that_changes_at_every_step_moves_every_other_step() -> None:
    received: list[int] = []

    class Tag(nn.Module):
        step = 0

        def forward(self, x: Tensor) -> tuple[Tensor, int]:
            return x, Tag.step

    class Untag(nn.Module):
        def forward(self, pair: tuple[Tensor, int]) -> Tensor:
            received.append(pair[1])
            return pair[0]

    def build() -> nn.Sequential:
        layers = list(mlp())
        return nn.Sequential(*layers[:4], Tag(), Untag(), *layers[4:])

    models = [build() for _ in range(2)]
    x, y = BATCHES[0]
    rules = NCCLRules(2)

    steps = 4

    def rank(transport: Transport) -> Any:
        seen: list[str] = []
        stage = PipelineStage(
            models[transport.rank],
            [5, 5],
            transport=_counting(transport, seen),
            chunks=2,
            checkpoint="never",
        )
        driver = ScheduleGPipe(stage, _mse)
        losses, sent = [], []
        for k in range(steps):
            if stage.is_first:
                Tag.step = k
            before = len(seen)
            losses.append(_loss_or_error(driver, x, y))
            sent.append(seen[before:])
        return losses, sent

    results = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    rules.check()
    with torch.no_grad():
        expected = float(_mse(build()(x), y))
    for losses, _ in results:
        assert losses == [pytest.approx(expected, rel=1e-6)] * steps
    # Rank 0 sends the tagged value: metadata, then a move (the tag changed), then
    # metadata (a step that moved is not remembered), then a move.
    assert results[0][1] == [["metadata"] * 2, ["moved"] * 2, ["metadata"] * 2, ["moved"] * 2]
    assert received[:8] == [0, 0, 1, 1, 2, 2, 3, 3]  # each micro-batch's, each step's own


def test_an_input_that_cannot_be_pickled_stays_on_rank_0() -> None:
    class Apply(nn.Module):
        def forward(self, pair: Any) -> Tensor:
            x, fn = pair
            return fn(x)

    def build() -> nn.Sequential:
        return nn.Sequential(Apply(), *mlp())

    models = [build() for _ in range(2)]
    x, y = BATCHES[0]
    double = lambda v: v * 2  # noqa: E731  # what cannot be pickled

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [5, 4], transport=transport, chunks=4)
        result = Schedule1F1B(stage, _mse).step((x, double) if stage.is_first else None, y)
        return float(result.loss)

    results = run_threads(rank, 2, timeout=30.0)
    with torch.no_grad():
        expected = float(_mse(build()((x, double)), y))
    assert results == pytest.approx([expected, expected], rel=1e-6)


def test_static_shapes_name_a_change_of_which_tensors_want_a_gradient() -> None:
    models = [mlp() for _ in range(2)]
    x, y = BATCHES[0]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank], [4, 4], transport=transport, chunks=4, static_shapes=True
        )
        driver = Schedule1F1B(stage, _mse)
        driver.step(x if stage.is_first else None, y if stage.is_last else None)
        stage.requires_grad_(False)  # frozen on every rank: stage 0's output wants none
        try:
            driver.step(x if stage.is_first else None, y if stage.is_last else None)
        except BaseException as error:
            return error
        return None

    results = run_threads(rank, 2, timeout=30.0)
    assert isinstance(results[0], ValueError)
    assert "which tensors want a gradient: [True] then, [False] now" in str(results[0])
    assert "frozen or unfrozen" in str(results[0])


def test_static_shapes_follow_the_stages_between_train_and_eval() -> None:
    # Checkpointed cells (training) mark a mask that wants no gradient as wanting one;
    # in eval mode nothing is checkpointed. Each mode remembers its own layouts.
    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return self.linear(x), torch.zeros(x.shape[0], 4)

    class UseMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
            return self.linear(pair[0]) + pair[1]

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(WithMask(), UseMask())

    models = [build() for _ in range(2)]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    modes = ["train", "eval", "eval", "train", "train"]

    def rank(transport: Transport) -> Any:
        seen: list[str] = []
        stage = PipelineStage(
            models[transport.rank],
            [1, 1],
            transport=_counting(transport, seen),
            chunks=2,
            static_shapes=True,
        )
        driver = Schedule1F1B(stage, _mse)
        out = []
        for mode in modes:
            stage.train(mode == "train")
            before = len(seen)
            out.append((_loss_or_error(driver, x, y), len(seen) - before))
        return out

    results = run_threads(rank, 2, timeout=30.0)
    with torch.no_grad():
        expected = float(_mse(build()(x), y))
    for out in results:
        assert [loss for loss, _ in out] == pytest.approx([expected] * len(modes), rel=1e-6)
    sent = [sum(out[k][1] for out in results) for k in range(len(modes))]
    assert sent[0] > 0  # the first step of each mode sends metadata
    assert sent[1] > 0
    assert sent[2] == sent[3] == sent[4] == 0  # then each mode's layouts are remembered


def test_a_static_message_marks_real_data_apart_from_a_failed_senders_zeros() -> None:
    from torchgpipe.distributed.plan import Message, RankPlan
    from torchgpipe.distributed.transfers import Transfers
    from torchgpipe.distributed.wire import DATA, FAILED, MARK, MOVED, pack

    (transport,) = LocalTransport.mesh(1)
    key = ("F", 1, 0)
    frame = ("metadata", key, [((2,), torch.float32)], b"")
    transfers = Transfers(
        transport,
        metadata=lambda message, draining: None,
        arrived=lambda message: False,
        consume=lambda key: None,
        lose=print,
        lost=lambda peer: False,
    )
    plan = RankPlan(starts=(), rounds=((0.0, (Message(key, 0, 1),)),), receives=frozenset())
    transfers.follow(plan, {key: frame})
    real = pack([torch.ones(2)], torch.device("cpu"), mark=True)
    assert real is not None
    assert real.numel() == 16 + MARK
    assert transfers.mark(real) == DATA
    assert transfers.mark(transfers.zeros(key)) == FAILED
    assert transfers.mark(transfers.zeros(key, MOVED)) == MOVED
    assert transfers.zeros(key, MOVED).numel() == real.numel()


class _ReadsMarks(LocalTransport):
    reads_marks = True  # type: ignore[assignment]


def test_a_transport_that_says_it_reads_marks_off_a_cpu_wire_is_refused() -> None:
    # Reading a mark on a GPU would wait for its transfer: a transport that claims to
    # read marks with buffers elsewhere is refused at the first mark of a step on known
    # frames (in a take, where every rank follows the plan and the step fails cleanly).
    from torchgpipe.distributed.plan import RankPlan
    from torchgpipe.distributed.transfers import Transfers
    from torchgpipe.distributed.wire import DATA

    transport = LocalTransport.mesh(2)[0]
    transport.__class__ = _ReadsMarks
    transport.wire = torch.device("meta")  # not the CPU, and in every build of torch
    transfers = Transfers(
        transport,
        metadata=lambda message, draining: None,
        arrived=lambda message: True,
        consume=lambda key: None,
        lose=lambda error: None,
        lost=lambda peer: False,
    )
    plan = RankPlan(rounds=(), starts=(0,), receives=frozenset())
    buffer = torch.zeros(32, dtype=torch.uint8)
    transfers.follow(plan, None)  # no known frames: no marks to read
    assert transfers.mark(buffer) == DATA
    transfers.follow(plan, {})  # known frames: following is fine, reading a mark is not
    with pytest.raises(RuntimeError, match=r"says it reads marks, but its wire is meta"):
        transfers.mark(buffer)


class _Started:
    """The work of a transfer that did start; notes that it was waited for."""

    def __init__(self, waited: list[int], peer: int) -> None:
        self._waited, self._peer = waited, peer

    def wait(self) -> None:
        self._waited.append(self._peer)


class _Unmatched:
    """The work of a transfer that started and never completes: its peer failed first."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.returned = False

    def wait(self) -> None:
        self.entered.set()
        self.released.wait(timeout=10)
        self.returned = True


class _HalfStarts(LocalTransport):
    """Starts a group's first transfer, then fails to reach the next one's peer (gloo)."""

    started: _Unmatched

    def issue(self, transfers: Any) -> list[Any]:
        from torchgpipe.distributed.channel import TransportError

        error = TransportError(f"rank 1 could not send to rank {transfers[1].peer}", 2)
        error.started = [(transfers[0], self.started)]
        raise error


def test_a_round_that_fails_half_started_still_waits_for_the_started_transfers() -> None:
    # On gloo the transfers of a round start one by one. Regression: where a dead peer's
    # failed to start, those started before it (a send to a live rank) were dropped
    # unwaited, which gloo never delivers: the live rank waited for its data in vain.
    # They are waited for apart: the peer's own round may have failed before their
    # match, and the drain must not wait for them.
    from torchgpipe.distributed.plan import Message, RankPlan
    from torchgpipe.distributed.transfers import Transfers
    from torchgpipe.mailbox import Stopped

    transport = LocalTransport.mesh(3)[1]
    transport.__class__ = _HalfStarts
    transport.started = started = _Unmatched()
    messages = (Message(("F", 0, 0), 1, 0), Message(("F", 2, 0), 1, 2))
    lost: list[int] = []
    transfers = Transfers(
        transport,
        metadata=lambda message, draining: None,
        arrived=lambda message: True,
        consume=lambda key: None,
        lose=lambda error: lost.append(error.peer),
        lost=lambda peer: peer in lost,
    )
    transfers.follow(RankPlan(starts=(1.0,), rounds=((0.0, messages),), receives=frozenset()))
    for m in messages:
        transfers.hold(m.key, ("metadata", m.key, [], b""), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(Stopped):
        transfers.issue_before(0)
    assert lost == [2]
    transfers.drain()  # returns: the started send is not its to wait for
    assert not started.returned
    assert started.entered.wait(timeout=30)  # waited for all the same
    started.released.set()


class _Unreached:
    def wait(self) -> None:
        from torchgpipe.distributed.channel import TransportError

        raise TransportError("rank 0 could not send to rank 1: closed", 1)


def test_a_tied_weight_sent_to_a_dead_holder_still_goes_to_the_live_ones() -> None:
    # Regression: the owner's send to holder 1 failed (dead) and the one to holder 2 was
    # dropped unwaited, never delivered: holder 2 waited on the owner until the group's
    # timeout, then named the owner, not the dead holder.
    from torchgpipe.distributed.channel import TransportError
    from torchgpipe.distributed.ties import AcrossRanks

    waited: list[int] = []
    issued: list[tuple[str, int]] = []

    class Owner:
        rank, wire = 0, torch.device("cpu")

        def issue(self, transfers: Any) -> list[Any]:
            issued.extend((t.kind, t.peer) for t in transfers)
            return [_Unreached(), _Started(waited, 2)]

    ties = AcrossRanks(Owner())  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="rank 1"):
        ties._from_owner((0, 1, 2), torch.ones(3))
    assert issued == [("send", 1), ("send", 2)]
    assert waited == [2]


def test_why_a_peer_left_replaces_its_being_unreachable() -> None:
    # A peer that builds a stage during a call says so (its greeting) and leaves: this
    # rank's listener reads why while its own thread may fail a transfer to it first.
    # Regression: the first reason stayed, and the step said the peer had died.
    from torchgpipe.distributed.exchange import Exchange
    from torchgpipe.worker import WorkerPool

    here, *there = LocalTransport.mesh(3, timeout=5.0)
    pool = WorkerPool(2, name="test-listener")
    exchange = Exchange(here, pool, owner=lambda key: 0, stages=[(0,), (1,), (2,)])
    try:
        exchange.lose(1, "died or cannot be reached", gone=True)
        exchange.lose(2, "died or cannot be reached", gone=True)
        exchange.lose(1, "built a PipelineStage during this call")
        exchange.lose(1, "died or cannot be reached", gone=True)
        # In place: the order of the losses names the first one lost.
        assert list(exchange.lost.items()) == [
            (1, "built a PipelineStage during this call"),
            (2, "died or cannot be reached"),
        ]
        assert exchange.halted
    finally:
        for peer in there:
            peer.close()  # the listeners' receives fail: they end
        pool.close()
        for thread in pool.threads:
            thread.join(timeout=10)
