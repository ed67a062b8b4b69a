"""PipelineStage and the schedules over it, with threads on a LocalTransport mesh.

Each thread plays one rank: it builds its PipelineStage on its own transport and runs
the same steps as a process would. The models are built here, before the threads
start, one per rank from the same seed: ``torch.manual_seed`` is global to the
process, so threads building them at once would draw each other's numbers.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import lose_in_tie_sum, mlp, run_threads, skip_net, spawn
from helpers import Routed, routed_batch
from nccl_rules import NCCLRules
from torch import Tensor, nn

from torchgpipe import BalanceError
from torchgpipe.distributed import (
    LocalTransport,
    PipelineSchedule,
    PipelineStage,
    RemoteError,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
    StepResult,
    Transport,
    TransportError,
)
from torchgpipe.rng import draw_seed
from torchgpipe.schedules import Schedule, one_f_one_b, simulate
from torchgpipe.trace import Trace

Body = Callable[[PipelineStage], Any]


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def _mse_sum(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target, reduction="sum")


def _batch(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _merged(grads: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    merged: dict[str, Tensor] = {}
    for part in grads:
        assert not set(merged) & set(part), "two ranks hold the same parameter"
        merged.update(part)
    return merged


def _reference(
    model: nn.Sequential, x: Tensor, y: Tensor, loss_fn: Callable[..., Tensor] = _mse
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    model = copy.deepcopy(model)
    output = model(x)
    loss = loss_fn(output, y)
    loss.backward()
    return loss.detach(), _grads(model), output.detach()


def _assert_grads(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _step(schedule: PipelineSchedule, x: Any, y: Any) -> StepResult:
    stage = schedule.pipe
    return schedule.step(x if stage.is_first else None, y if stage.is_last else None)


def _outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returned, or the exception it raised."""
    try:
        return call()
    except BaseException as error:
        return error


def _on_ranks(
    world: int,
    balance: list[int],
    body: Body,
    *,
    models: list[nn.Sequential] | None = None,
    timeout: float = 10.0,
    **options: Any,
) -> list[Any]:
    """``body(stage)`` on ``world`` threads, each with its stage of ``mlp()`` (or of
    ``models[rank]``); each rank's value, or what it raised."""
    models = models if models is not None else [mlp() for _ in range(world)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], balance, transport=transport, **options)
        return body(stage)

    return run_threads(rank, world, timeout=timeout)


def _stages(world: int, balance: list[int], **options: Any) -> list[PipelineStage]:
    stages = _on_ranks(world, balance, lambda stage: stage, **options)
    assert all(isinstance(stage, PipelineStage) for stage in stages), stages
    return stages


# Arguments


class _Residual(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"module": nn.Linear(4, 4)}, TypeError, "takes an nn.Sequential, got Linear"),
        ({"module": _Residual(*mlp())}, TypeError, "has a forward of its own"),
        ({"balance": [4, 3]}, BalanceError, "balance sums to 7"),
        ({"device": "meta"}, ValueError, "device 'meta' is the meta device"),
        ({"chunks": 0}, ValueError, "chunks must be a positive number"),
        ({"chunks": 2.5}, TypeError, "chunks must be an int"),
        ({"checkpoint": "sometimes"}, ValueError, "unknown checkpoint mode 'sometimes'"),
        ({"deferred_batch_norm": "yes"}, TypeError, "deferred_batch_norm must be a bool"),
        ({"static_shapes": "yes"}, TypeError, "static_shapes must be a bool"),
    ],
)
def test_stage_rejects_bad_arguments_before_talking_to_peers(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    # Rank 0 of two, alone: a stage that got past its own checks would wait for rank 1.
    transport = LocalTransport.mesh(2, timeout=0.5)[0]
    arguments: dict[str, Any] = {"module": mlp(), "balance": [4, 4], "chunks": 2}
    arguments.update(change)
    with pytest.raises(error, match=match):
        PipelineStage(
            arguments.pop("module"), arguments.pop("balance"), transport=transport, **arguments
        )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ([{}, {"balance": [8]}], r"the balance has 1 partitions for 2 processes; give every "),
        ([{}, {"rank": 0}], r"rank=0 was given, but this process is rank 1 of the pipeline's 2"),
        ([{"balance": [3, 3, 2]}] * 2, r"the balance has 3 partitions for 2 processes"),
    ],
)
def test_stage_refuses_a_balance_or_rank_it_cannot_take_and_tells_the_others(
    options: list[dict[str, Any]], match: str
) -> None:
    # Regression: these were refused before the start's exchange. A rank given them
    # alone raised at once, while the others waited for its fingerprint until their
    # transports timed out, then said it had died. Now it tells them as it fails.
    models = [mlp() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        r = transport.rank
        arguments: dict[str, Any] = {"balance": [4, 4], "chunks": 2, **options[r]}
        start = time.monotonic()
        failed = _outcome(lambda: PipelineStage(models[r], transport=transport, **arguments))
        return failed, time.monotonic() - start

    (zero, seconds0), (one, seconds1) = run_threads(rank, 2, timeout=20.0)  # 10 s each
    assert type(one) is ValueError, repr(one)
    assert re.match(match, str(one)), str(one)
    if options[0]:  # refused by rank 0 too, alike
        assert type(zero) is ValueError, repr(zero)
        assert str(zero) == str(one)
    else:
        assert isinstance(zero, RemoteError), repr(zero)
        assert zero.rank == 1
        assert str(zero).startswith(f"rank 1 (stages {list(zero.stages)}) raised ValueError: ")
        assert str(one) in str(zero)
    assert max(seconds0, seconds1) < 5.0  # told by rank 1, not found by a timeout


def test_stage_reports_a_peer_that_never_starts_as_a_remote_error() -> None:
    def rank(transport: Transport) -> Any:
        if transport.rank == 1:
            assert isinstance(transport, LocalTransport)
            transport.close()  # as a process that dies before building its stage
            return None
        return _outcome(lambda: PipelineStage(mlp(), [4, 4], transport=transport))

    out = run_threads(rank, 2, timeout=10.0)
    assert isinstance(out[0], RemoteError), repr(out[0])
    assert out[0].rank == 1


# What a rank holds


@pytest.mark.parametrize(
    ("balance", "held"),
    [([4, 4], [(0,), (1,)]), ([2, 2, 2, 2], [(0, 2), (1, 3)])],
)
def test_stage_holds_its_partitions_under_the_models_names(
    balance: list[int], held: list[tuple[int, ...]]
) -> None:
    models = [mlp() for _ in range(2)]
    stages = _stages(2, balance, models=models, chunks=2)
    plain = mlp().state_dict()
    starts = [sum(balance[:s]) for s in range(len(balance) + 1)]
    for r, stage in enumerate(stages):
        assert stage.rank == r
        assert stage.world_size == 2
        assert stage.stages == held[r]
        assert stage.virtual_stages == len(balance) // 2
        assert stage.is_first == (r == 0)
        assert stage.is_last == (r == 1)
        layers = [k for s in held[r] for k in range(starts[s], starts[s + 1])]
        assert list(stage.partitions) == list(held[r])
        assert [name for name, _ in stage.named_children()] == [str(k) for k in layers]
        mine = {key for key in plain if int(key.split(".")[0]) in layers}
        assert set(stage.state_dict()) == mine
        for key, value in stage.state_dict().items():
            assert torch.equal(value, plain[key]), key
        # The stage holds the caller's own layers, not copies.
        assert all(stage.get_submodule(str(k)) is models[r][k] for k in layers)


def test_stage_moves_its_layers_to_the_transports_device_and_no_others() -> None:
    models = [mlp() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        transport.device = torch.device("meta")  # where this rank receives, so computes
        return PipelineStage(models[transport.rank], [2, 2, 2, 2], transport=transport)

    stages = run_threads(rank, 2, timeout=10.0)
    for r, stage in enumerate(stages):
        assert isinstance(stage, PipelineStage), stage
        assert stage.device == torch.device("meta")
        assert all(p.is_meta for p in stage.parameters())
        mine = {name for name, _ in stage.named_children()}
        for name, layer in models[r].named_children():
            for p in layer.parameters():
                assert p.is_meta == (name in mine), name


def test_stage_is_not_called_nor_copied() -> None:
    (stage,) = _stages(1, [8])
    with pytest.raises(TypeError, match="runs in steps that span every process"):
        stage(torch.randn(2, 4))
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(stage)


def test_stage_is_not_moved_but_may_change_dtype() -> None:
    (stage,) = _stages(1, [8])
    for move in (
        lambda: stage.to("cpu"),
        lambda: stage.to(torch.zeros(1)),
        lambda: stage.cpu(),
        lambda: stage.cuda(),
        lambda: stage.to_empty(device="cpu"),
    ):
        with pytest.raises(TypeError, match=r"PipelineStage cannot be moved.*device="):
            move()
    assert stage.to(torch.float64) is stage
    assert all(p.dtype == torch.float64 for p in stage.parameters())


@pytest.mark.parametrize(
    ("balance", "factory"),
    [
        ([8], Schedule1F1B),
        ([8], ScheduleGPipe),
        ([8], ScheduleZeroBubble),
        ([4, 4], ScheduleInterleaved1F1B),
    ],
)
def test_stage_of_a_single_rank_matches_the_plain_model(
    balance: list[int], factory: Callable[..., PipelineSchedule]
) -> None:
    (transport,) = LocalTransport.mesh(1, timeout=5.0)
    stage = PipelineStage(mlp(), balance, chunks=4, transport=transport)
    assert stage.stages == tuple(range(len(balance)))
    assert stage.is_first
    assert stage.is_last
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    result = factory(stage, _mse).step(x, y)
    loss, grads, output = _reference(mlp(), x, y)
    _assert_grads(_grads(stage), grads)
    torch.testing.assert_close(result.loss, loss)
    torch.testing.assert_close(result.output, output)


def test_stage_checks_chunks_and_checkpoint_assigned_later() -> None:
    (transport,) = LocalTransport.mesh(1, timeout=5.0)
    stage = PipelineStage(mlp(), [8], chunks=4, transport=transport)
    with pytest.raises(ValueError, match=r"chunks must be a positive number.*got -1"):
        stage.chunks = -1
    with pytest.raises(ValueError, match="unknown checkpoint mode 'no'"):
        stage.checkpoint = "no"  # type: ignore[assignment]
    stage.chunks, stage.checkpoint = 2, "never"
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    result = ScheduleGPipe(stage, _mse).step(x, y)
    assert len(result.losses) == 2
    torch.testing.assert_close(result.loss, _reference(mlp(), x, y)[0])


# Schedules: arguments


def test_schedules_are_torchgpipes_own_and_reject_what_holds_no_stages() -> None:
    # One set of schedule classes for one process and for several.
    import torchgpipe

    assert ScheduleGPipe is torchgpipe.ScheduleGPipe
    assert Schedule1F1B is torchgpipe.Schedule1F1B
    assert PipelineSchedule is torchgpipe.PipelineSchedule
    match = "a schedule steps a torchgpipe.GPipe .* or a torchgpipe.distributed.PipelineStage"
    for factory in (Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble, ScheduleInterleaved1F1B):
        with pytest.raises(TypeError, match=match):
            factory(mlp(), _mse)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match):
        PipelineSchedule(mlp(), _mse, one_f_one_b(2, 2))  # type: ignore[arg-type]


def test_schedules_reject_a_bad_loss_or_reduction() -> None:
    stage = _stages(2, [4, 4], chunks=2)[0]
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        Schedule1F1B(stage, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'avg'"):
        Schedule1F1B(stage, _mse, reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        PipelineSchedule(stage, _mse, one_f_one_b(2, 2), reduction="none")  # type: ignore[arg-type]


def test_interleaved_schedule_needs_chunks_a_multiple_of_the_ranks() -> None:
    stage = _stages(2, [2, 2, 2, 2], chunks=3)[0]
    with pytest.raises(ValueError, match="use chunks a multiple of 2, got 3"):
        ScheduleInterleaved1F1B(stage, _mse)


def test_interleaving_with_one_virtual_stage_says_to_leave_it_out() -> None:
    stage = _stages(2, [2, 2, 2, 2], chunks=2)[0]
    with pytest.raises(ValueError, match="processes 2 stages, not 1; leave virtual_stages out"):
        ScheduleInterleaved1F1B(stage, _mse, virtual_stages=1)


def test_schedule_table_must_fit_the_stages() -> None:
    stage = _stages(2, [2, 2, 2, 2], chunks=1)[0]
    # Rank 0 runs stages 0 and 1, rank 1 stages 2 and 3: a valid table, but stage s
    # runs on rank s % 2.
    blocks = Schedule.parse("0F0 1F0 1B0 0B0\n2F0 3F0 3B0 2B0")
    blocks = Schedule(blocks.stages, blocks.micro_batches, blocks.ranks, placement=(0, 0, 1, 1))
    blocks.validate()
    with pytest.raises(ValueError, match=r"puts stages \[1, 2\] on ranks \[0, 1\]"):
        PipelineSchedule(stage, _mse, blocks)
    with pytest.raises(
        ValueError,
        match="runs on 4 ranks but the pipeline has 2 processes; with 2 stages per process "
        "use ScheduleInterleaved1F1B",
    ):
        PipelineSchedule(stage, _mse, one_f_one_b(4, 1))
    with pytest.raises(ValueError, match="the schedule has 2 stages but the balance 4"):
        PipelineSchedule(stage, _mse, one_f_one_b(2, 1))


@pytest.mark.parametrize("factory", [Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble])
def test_one_stage_per_rank_schedules_point_to_interleaving(
    factory: Callable[..., PipelineSchedule],
) -> None:
    x, y = _batch(1, 4, 4), _batch(2, 4, 4)
    out = _on_ranks(2, [2, 2, 2, 2], lambda stage: _step(factory(stage, _mse), x, y), chunks=4)
    assert isinstance(out[0], ValueError), repr(out[0])
    assert "ScheduleInterleaved1F1B" in str(out[0])


# Failures


class _Faulty(nn.Module):
    """The identity, which calls ``fault`` (if set) on its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: Callable[[], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        fault, self.fault = self.fault, None
        if fault is not None:
            fault()
        return x


def _faulty_models(world: int, index: int) -> list[nn.Sequential]:
    models = [mlp() for _ in range(world)]
    for model in models:  # in every rank's model: the ranks compare their layers' types
        model[index] = _Faulty()
    return models


def _boom() -> None:
    raise ZeroDivisionError("boom")


def test_a_layer_failing_on_one_rank_fails_every_rank_and_the_next_step_works() -> None:
    models = _faulty_models(3, 3)  # layer 3: the first of stage 1, on rank 1
    models[1][3].fault = _boom
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        failed = _outcome(lambda: _step(schedule, x, y))
        stage.zero_grad()
        result = _step(schedule, x, y)
        return failed, result, _grads(stage)

    out = _on_ranks(3, [3, 3, 2], body, models=models, chunks=4)
    assert all(isinstance(o, tuple) for o in out), out
    raised = out[1][0]
    assert isinstance(raised, ZeroDivisionError)
    assert str(raised) == "boom"
    notes = getattr(raised, "__notes__", [])
    assert any("raised in 1F0 (stage 1 on rank 1" in note for note in notes), notes
    for r in (0, 2):
        remote = out[r][0]
        assert isinstance(remote, RemoteError), repr(remote)
        assert (remote.rank, remote.stages, remote.action) == (1, (1,), "1F0")
        assert "rank 1 (stages [1]) raised ZeroDivisionError: boom" in str(remote)
        assert remote.remote_traceback is not None
        assert "ZeroDivisionError: boom" in remote.remote_traceback
    # The same stages step again, as if nothing had happened.
    loss, grads, _ = _reference(_faulty_models(1, 3)[0], x, y)
    _assert_grads(_merged([o[2] for o in out]), grads)
    for o in out:
        torch.testing.assert_close(o[1].loss, loss)


def test_deferred_batch_norm_ends_the_mini_batch_where_a_micro_batch_skips_the_layer() -> None:
    # The update waited for a fourth micro-batch to call the layer: never, here.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Identity(), Routed(), nn.Linear(4, 2)).double()
    x = routed_batch([3])

    def body(stage: PipelineStage) -> Any:
        _step(Schedule1F1B(stage, _mse), x, torch.zeros(16, 2, dtype=torch.float64))
        return stage.state_dict()

    models = [copy.deepcopy(plain) for _ in range(2)]
    out = _on_ranks(2, [2, 1], body, models=models, chunks=4, deferred_batch_norm=True)
    plain(x)
    for key in ("1.bn.running_mean", "1.bn.running_var", "1.bn.num_batches_tracked"):
        torch.testing.assert_close(out[0][key], plain.state_dict()[key], msg=key)


def test_a_failure_names_the_global_rank_where_the_pipelines_group_is_not_all() -> None:
    # A pipeline of global ranks 2 and 3 (data parallel beside it): the messages named
    # group rank 1, which is another pipeline's healthy process.
    models = _faulty_models(2, 4)  # layer 4: the first of stage 1, on rank 1
    models[1][4].fault = _boom
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def rank(transport: Transport) -> Any:
        transport.global_ranks = (2, 3)
        stage = PipelineStage(models[transport.rank], [4, 4], transport=transport, chunks=2)
        return _outcome(lambda: _step(Schedule1F1B(stage, _mse), x, y))

    remote, raised = run_threads(rank, 2)
    assert isinstance(raised, ZeroDivisionError)
    notes = getattr(raised, "__notes__", [])
    assert any("stage 1 on rank 1 (global rank 3), cpu" in note for note in notes), notes
    assert isinstance(remote, RemoteError), repr(remote)
    assert str(remote).startswith("rank 1 (global rank 3) (stages [1]) raised ZeroDivisionError")
    assert remote.rank == 1


@pytest.mark.parametrize("stepped_first", [False, True])
def test_two_pipelines_on_one_group_called_crosswise_are_refused(stepped_first: bool) -> None:
    # A teacher and a student of one shape: rank 0 stepped the student while rank 1
    # stepped the teacher, and the step trained half of each, silently (or, where the
    # student had stepped first, failed on layouts the teacher did not know, and the
    # channels stayed out of step).
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    models = [(mlp(1), mlp(0)) for _ in range(2)]  # here: mlp() seeds the generator

    def rank(transport: Transport) -> Any:
        teacher_model, student_model = models[transport.rank]
        teacher = PipelineStage(teacher_model, [4, 4], transport=transport, chunks=2)
        student = PipelineStage(student_model, [4, 4], transport=transport, chunks=2)
        if stepped_first:
            _step(Schedule1F1B(student, _mse), x, y)
            _step(Schedule1F1B(teacher, _mse), x, y)
        called = student if transport.rank == 0 else teacher
        crossed = _outcome(lambda: _step(Schedule1F1B(called, _mse), x, y))
        student.zero_grad()
        # Both pipelines work on, their remembered layouts as every rank saw the step.
        return crossed, _step(Schedule1F1B(student, _mse), x, y), _grads(student)

    out = run_threads(rank, 2, timeout=20.0)
    assert all(isinstance(o, tuple) for o in out), out
    (remote, result, grads_0), (refused, _, grads_1) = out
    assert isinstance(refused, ValueError)
    said = "rank 0 started a call of another pipeline's stages than the ones rank 1 called"
    assert said in str(refused)
    assert isinstance(remote, RemoteError)
    assert said in str(remote)
    loss, grads, _ = _reference(mlp(0), x, y)
    torch.testing.assert_close(result.loss, loss)
    _assert_grads(_merged([grads_0, grads_1]), grads)


def test_a_call_of_a_pipeline_another_process_no_longer_holds_gives_the_group_up() -> None:
    # Rank 1 let its student go: it cannot know the sizes of the transfers rank 0's
    # student issues, so the channels are out of step, and every later call says so.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    models = [(mlp(1), mlp(0)) for _ in range(2)]

    def rank(transport: Transport) -> Any:
        teacher_model, student_model = models[transport.rank]
        teacher = PipelineStage(teacher_model, [4, 4], transport=transport, chunks=2)
        student = PipelineStage(student_model, [4, 4], transport=transport, chunks=2)
        called = student if transport.rank == 0 else teacher
        del student
        crossed = _outcome(lambda: _step(Schedule1F1B(called, _mse), x, y))
        start = time.monotonic()
        after = _outcome(lambda: _step(Schedule1F1B(called, _mse), x, y))
        return crossed, after, time.monotonic() - start

    out = run_threads(rank, 2, timeout=20.0)
    assert all(isinstance(o, tuple) for o in out), out
    (remote, after_0, seconds), (refused, after_1, _) = out
    said = "rank 0 started a call of another pipeline's stages than the ones rank 1 called"
    assert isinstance(refused, ValueError)
    assert "which this process does not hold" in str(refused)
    assert isinstance(remote, RemoteError)
    for after in (after_0, after_1):
        assert isinstance(after, RuntimeError), after
        assert said in str(after)
        assert "Start every process anew" in str(after)
    assert seconds < 1.0  # rank 0 was told as the step ended


def test_a_rank_that_closes_its_transport_mid_step_is_named_by_the_others() -> None:
    models = _faulty_models(3, 3)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    timeout = 2.0

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        _step(schedule, x, y)  # warm: the first step of a process pays for lazy imports
        if stage.rank == 1:
            transport = stage.transport
            assert isinstance(transport, LocalTransport)

            def die() -> None:
                transport.close()
                raise RuntimeError("gone")

            models[1][3].fault = die
        start = time.monotonic()
        return _outcome(lambda: _step(schedule, x, y)), time.monotonic() - start

    out = _on_ranks(3, [3, 3, 2], body, models=models, chunks=4, timeout=2 * timeout)
    assert isinstance(out[1][0], RuntimeError)
    assert str(out[1][0]) == "gone"
    for r in (0, 2):
        remote, seconds = out[r]
        assert isinstance(remote, RemoteError), repr(remote)
        assert remote.rank == 1
        assert remote.stages == (1,)
        assert "rank 1 (stages [1]) died or cannot be reached" in str(remote)
        assert "rank 1 closed its transport" in str(remote)
        assert seconds < timeout / 4  # seen by the transport, not by a timeout


@pytest.mark.parametrize("input", ["the same", "a new layout"])
def test_a_rank_gone_between_steps_fails_the_next_step_at_once_on_every_rank(
    input: str,
) -> None:
    # Rank 0's start must reach ranks 2 and 3 although rank 1 is gone: with the same
    # input the frames are known, and rank 0 issues transfers with rank 3 that only a
    # rank 3 following the plan matches (interleaved: stage 7 on rank 3 sends to 0).
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    if input == "a new layout":
        x, y = _batch(3, 16, 4), _batch(4, 16, 4)
    timeout = 2.0
    gone = threading.Barrier(4)

    def body(stage: PipelineStage) -> Any:
        schedule = ScheduleInterleaved1F1B(stage, _mse)
        first = _batch(1, 8, 4), _batch(2, 8, 4)
        for _ in range(2):  # the second step on frames known from the first
            _step(schedule, *first)
        if stage.rank == 1:
            transport = stage.transport
            assert isinstance(transport, LocalTransport)
            transport.close()  # as a process that dies between steps
            gone.wait()
            return None
        gone.wait()
        start = time.monotonic()
        return _outcome(lambda: _step(schedule, x, y)), time.monotonic() - start

    out = _on_ranks(4, [1] * 8, body, chunks=4, timeout=2 * timeout)
    for r in (0, 2, 3):
        remote, seconds = out[r]
        assert isinstance(remote, RemoteError), repr(remote)
        assert remote.rank == 1
        assert "rank 1 (stages [1, 5]) died or cannot be reached" in str(remote)
        assert seconds < timeout / 4  # seen by the transport, not by a timeout


class _Mute(LocalTransport):
    """A rank whose side channel stalls once a peer is gone, as gloo's did here once: its
    event loop spun after a peer's death between steps, the other connections starved."""

    def send(self, peer: int, header: Any, tensors: Any) -> None:
        if not self._mesh.closed:
            super().send(peer, header, tensors)
        elif peer in self._mesh.closed:
            self._check_open(peer)  # a gone peer's send fails; the others' vanish

    def recv(self, peer: int) -> Any:
        if not self._mesh.closed:
            return super().recv(peer)
        self._check_open(peer)
        threading.Event().wait(self.timeout)  # nothing comes, until the timeout
        raise TransportError(f"rank {peer} sent nothing in {self.timeout} s", peer)


def test_a_rank_gone_between_steps_is_named_in_bounded_time_where_another_went_mute(
    monkeypatch: Any,
) -> None:
    # Rank 1 dies between steps; rank 0 stays alive but mute. Without a bound, ranks 2
    # and 3 wait for rank 0's end, and rank 0 for theirs, until the transport's timeout.
    from torchgpipe.distributed import exchange

    monkeypatch.setattr(exchange, "LOST_GRACE", 0.5)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    timeout = 20.0  # the transport's: 10 s
    gone = threading.Barrier(4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        _step(schedule, x, y)
        gone.wait()  # every rank ended the first step
        transport = stage.transport
        assert isinstance(transport, LocalTransport)
        if stage.rank == 1:
            transport.close()  # as a process that dies between steps
            gone.wait()
            return None
        if stage.rank == 0:
            transport.__class__ = _Mute
        gone.wait()
        start = time.monotonic()
        failure = _outcome(lambda: _step(schedule, x, y))
        seconds = time.monotonic() - start
        after = _outcome(lambda: _step(schedule, x, y))
        anew = _outcome(lambda: PipelineStage(mlp(), [2] * 4, transport=transport, chunks=4))
        return failure, seconds, after, anew

    out = _on_ranks(4, [2] * 4, body, chunks=4, timeout=timeout)
    for r in (0, 2, 3):
        remote, seconds, after, anew = out[r]
        # A new stage on the same transport is refused too, before it changes the model.
        assert isinstance(anew, RuntimeError), repr(anew)
        assert "Start every process anew" in str(anew), str(anew)
        assert isinstance(remote, RemoteError), repr(remote)
        assert remote.rank == 1, str(remote)
        assert "rank 1 (stages [1]) died or cannot be reached" in str(remote)
        assert seconds < 5.0  # half the transport's timeout
        assert isinstance(after, RuntimeError), repr(after)
        assert "Start every process anew" in str(after), str(after)
        assert "stopped answering" in str(after)


def test_a_target_of_another_batch_size_fails_on_the_last_rank() -> None:
    x, y = _batch(1, 8, 4), _batch(2, 6, 4)
    out = _on_ranks(2, [4, 4], lambda stage: _step(Schedule1F1B(stage, _mse), x, y), chunks=4)
    assert isinstance(out[1], ValueError), repr(out[1])
    expected = "the target splits into micro-batches of [2, 2, 1, 1] samples but the input into"
    assert f"{expected} [2, 2, 2, 2]; give them the same batch size" == str(out[1])
    assert isinstance(out[0], RemoteError), repr(out[0])
    assert out[0].rank == 1
    assert out[0].action is None
    assert "raised ValueError: the target splits" in str(out[0])


def test_ranks_that_follow_different_schedules_refuse_the_step() -> None:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        factory = ScheduleGPipe if stage.rank == 0 else Schedule1F1B
        return _step(factory(stage, _mse), x, y)

    out = _on_ranks(2, [4, 4], body, chunks=4)
    assert isinstance(out[1], ValueError), repr(out[1])
    assert "rank 1 follows a different schedule from rank 0 (for 4 micro-batches)" in (str(out[1]))
    assert isinstance(out[0], RemoteError), repr(out[0])
    assert out[0].rank == 1
    assert "different schedule" in str(out[0])


def test_ranks_whose_schedules_reduce_differently_refuse_the_step() -> None:
    # Before, rank 0 reported the sum of the micro-batches' losses and rank 1 their
    # mean: the start now carries rank 0's reduction, and the others compare it.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        reduction: Literal["mean", "sum"] = "sum" if stage.rank == 0 else "mean"
        refused = _outcome(lambda: _step(Schedule1F1B(stage, _mse, reduction=reduction), x, y))
        # A forward only has no loss to reduce; a step of the same reductions runs.
        schedule = Schedule1F1B(stage, _mse, reduction=reduction)
        output = schedule.forward_only(x if stage.is_first else None)
        return refused, output, _step(Schedule1F1B(stage, _mse), x, y).loss

    out = _on_ranks(2, [4, 4], body, chunks=4)
    assert all(isinstance(o, tuple) for o in out), out
    expected = (
        "rank 0's schedule was built with reduction='sum' but rank 1's with "
        "reduction='mean', and the ranks would report different losses; build every "
        "process's schedule with the same reduction"
    )
    assert isinstance(out[1][0], ValueError), repr(out[1][0])
    assert str(out[1][0]) == expected
    assert isinstance(out[0][0], RemoteError), repr(out[0][0])
    assert out[0][0].rank == 1
    assert expected in str(out[0][0])
    loss, _, output = _reference(mlp(), x, y)
    torch.testing.assert_close(out[1][1], output)
    for o in out:
        torch.testing.assert_close(o[2], loss)


@pytest.mark.parametrize("where", [0, 1])
def test_a_step_under_inference_mode_on_one_rank_fails_every_rank(where: int) -> None:
    # Inference mode is not left by the step's grad mode: rank 0 sent tensors that want
    # no gradient, and its stage trained nothing, silently.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        with torch.inference_mode(stage.rank == where):
            refused = _outcome(lambda: _step(schedule, x, y))
        return refused, _step(schedule, x, y).loss  # the next step runs

    # No timeout is under test: 15 s per receive, where a loaded 16-core host once
    # starved a rank of 5 s in the next step.
    out = _on_ranks(2, [4, 4], body, chunks=4, timeout=30.0)
    assert all(isinstance(o, tuple) for o in out), out
    said = f"rank {where}'s schedule.step() runs under torch.inference_mode()"
    assert isinstance(out[where][0], RuntimeError), repr(out[where][0])
    assert said in str(out[where][0])
    other = out[1 - where][0]
    assert isinstance(other, RemoteError), repr(other)
    assert other.rank == where
    assert said in str(other)
    loss, _, _ = _reference(mlp(), x, y)
    for o in out:
        torch.testing.assert_close(o[1], loss)


def test_a_drain_that_cannot_make_its_buffers_leaves_its_transport_refusing_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its OutOfMemoryError escaped the drain: the rounds after it went unissued while
    # the peer issued its own, and the next steps ran on mismatched pairs.
    from torchgpipe.distributed import transfers

    real = transfers.torch.empty
    short = threading.local()  # this thread's allocations fail from the third on

    def empty(*args: Any, **kwargs: Any) -> Tensor:
        made = getattr(short, "made", None)
        if made is not None:
            short.made = made + 1
            if made >= 2:
                raise torch.OutOfMemoryError("out of memory (a test's)")
        return real(*args, **kwargs)

    monkeypatch.setattr(transfers.torch, "empty", empty)
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        _step(schedule, x, y)
        if stage.rank == 1:
            short.made = 0
        failed = _outcome(lambda: _step(schedule, x, y))
        short.made = None
        if stage.rank == 0:  # waits on rank 1's share of the drain until the transport's timeout
            return failed, None
        return failed, _outcome(lambda: _step(schedule, x, y))

    (_, _), (failed, after) = _on_ranks(2, [4, 4], body, chunks=4, timeout=8.0)
    assert isinstance(failed, torch.OutOfMemoryError), repr(failed)
    assert isinstance(after, RuntimeError), repr(after)
    assert "rank 1 could not issue its share of a step's transfers" in str(after)
    assert "Start every process anew" in str(after)


def test_a_missing_input_or_target_fails_where_it_is_missing() -> None:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        no_input = _outcome(lambda: schedule.step(None, y))
        no_target = _outcome(lambda: schedule.step(x, None))
        no_forward_input = _outcome(lambda: schedule.forward_only(None))
        return no_input, no_target, no_forward_input

    out = _on_ranks(2, [4, 4], body, chunks=4)
    (no_input, _, no_forward_input), (remote_input, _, _) = out
    assert isinstance(no_input, ValueError), repr(no_input)
    assert (
        "rank 0 runs stage 0 and needs the input: pass it as schedule.step(input, target)"
        in str(no_input)
    )
    assert "pass it as schedule.forward_only(input)" in str(no_forward_input)
    assert isinstance(remote_input, RemoteError)
    assert remote_input.rank == 0
    (_, remote_target, _), (_, no_target, _) = out
    assert isinstance(no_target, ValueError), repr(no_target)
    assert "rank 1 runs the last stage and needs the target" in str(no_target)
    assert isinstance(remote_target, RemoteError)
    assert remote_target.rank == 1


# Steps


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_uneven_micro_batches_match_the_plain_model(reduction: str) -> None:
    loss_fn = _mse_sum if reduction == "sum" else _mse
    x, y = _batch(1, 5, 4), _batch(2, 5, 4)  # micro-batches of 3 and 2

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, loss_fn, reduction=reduction)  # type: ignore[arg-type]
        result = _step(schedule, x, y)
        return result, _grads(stage)

    out = _on_ranks(2, [4, 4], body, chunks=2)
    loss, grads, output = _reference(mlp(), x, y, loss_fn)
    _assert_grads(_merged([grads for _, grads in out]), grads)
    for result, _ in out:
        assert [tuple(loss.shape) for loss in result.losses] == [(), ()]
        torch.testing.assert_close(result.loss, loss)
    torch.testing.assert_close(out[1][0].output, output)


def test_a_tensor_a_layer_closes_over_gets_its_gradient_across_processes() -> None:
    # Rank 0's stage has no parameter and an input that wants no gradient: its
    # checkpointed cells run in grad mode, so the tensor its layer closes over gets one.
    from test_transparency import closed_over_net

    x, y = _batch(1, 6, 4), _batch(2, 6, 3).double()
    scales = [torch.tensor([1.5, -2.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)]
    scales += [scales[0].detach().clone().requires_grad_() for _ in range(2)]

    def body(stage: PipelineStage) -> Any:
        return _step(Schedule1F1B(stage, _mse), x.double(), y).loss

    models = [closed_over_net(scales[r]) for r in range(2)]
    out = _on_ranks(2, [2, 1], body, models=models, chunks=3, checkpoint="always")
    loss = _mse(closed_over_net(scales[2])(x.double()), y)
    loss.backward()
    torch.testing.assert_close(out[0], loss.detach())
    assert scales[0].grad is not None
    assert scales[1].grad is None  # rank 1's stage holds no ClosedOver
    torch.testing.assert_close(scales[0].grad, scales[2].grad)


def test_steps_may_change_the_batch_size() -> None:
    def body(stage: PipelineStage) -> Any:
        schedule = ScheduleZeroBubble(stage, _mse)
        grads = []
        for size in (8, 5, 2):
            stage.zero_grad()
            _step(schedule, _batch(size, size, 4), _batch(size + 1, size, 4))
            grads.append(_grads(stage))
        return grads

    out = _on_ranks(2, [4, 4], body, chunks=4)
    for k, size in enumerate((8, 5, 2)):
        _, grads, _ = _reference(mlp(), _batch(size, size, 4), _batch(size + 1, size, 4))
        _assert_grads(_merged([o[k] for o in out]), grads)


def test_a_skip_between_ranks_matches_the_plain_model() -> None:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        _step(Schedule1F1B(stage, _mse), x, y)
        return _grads(stage)

    out = _on_ranks(4, [2, 2, 2, 2], body, models=[skip_net() for _ in range(4)], chunks=4)
    _, grads, _ = _reference(skip_net(), x, y)
    _assert_grads(_merged(out), grads)


@pytest.mark.parametrize(
    ("factory", "balance"),
    [
        (ScheduleGPipe, [4, 4]),
        (Schedule1F1B, [4, 4]),
        (ScheduleZeroBubble, [4, 4]),
        (ScheduleInterleaved1F1B, [2, 2, 2, 2]),
    ],
)
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_step_result_is_the_same_on_every_rank_but_the_output(
    factory: Callable[..., PipelineSchedule], balance: list[int], checkpoint: str
) -> None:
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = factory(stage, _mse)
        return _step(schedule, x, y), _grads(stage), schedule.table(4)

    out = _on_ranks(2, balance, body, chunks=4, checkpoint=checkpoint)
    results: list[StepResult] = [result for result, _, _ in out]
    loss, grads, output = _reference(mlp(), x, y)
    _assert_grads(_merged([grads for _, grads, _ in out]), grads)
    for result in results:
        assert torch.equal(result.loss, results[-1].loss)
        assert len(result.losses) == 4
        assert all(
            torch.equal(a, b) for a, b in zip(result.losses, results[-1].losses, strict=True)
        )
        assert result.peak_held == results[-1].peak_held
    torch.testing.assert_close(results[-1].loss, loss)
    assert results[0].output is None
    torch.testing.assert_close(results[-1].output, output)
    table = out[0][2]
    assert table.text() == out[1][2].text()
    expected = simulate(table, {"F": 1, "B": 1, "W": 1}).holding
    assert results[0].peak_held == expected
    if factory is ScheduleGPipe:
        assert expected == (4, 4)
    if factory is Schedule1F1B:
        assert expected == (2, 1)


# A forward-only step: validation and serving across processes.


@pytest.mark.parametrize(
    ("balance", "factory"),
    [([4, 4], Schedule1F1B), ([2, 2, 2, 2], ScheduleInterleaved1F1B), ([4, 4], ScheduleGPipe)],
)
def test_forward_only_gives_the_output_on_the_last_rank_and_keeps_nothing(
    balance: list[int], factory: Any
) -> None:
    x = _batch(3, 8, 4)
    plain = mlp().eval()

    def body(stage: PipelineStage) -> Any:
        stage.eval()
        schedule = factory(stage, _mse)
        out = schedule.forward_only(x if stage.is_first else None)
        grads = [p.grad for p in stage.parameters()]
        return out, grads

    results = _on_ranks(2, balance, body, chunks=4)
    (first, grads0), (last, grads1) = results
    assert first is None
    assert not last.requires_grad
    torch.testing.assert_close(last, plain(x))
    assert all(g is None for g in [*grads0, *grads1])


def test_interleaved_forward_only_takes_a_batch_of_micro_batches_not_in_groups() -> None:
    # The short last batch of a validation set (3 micro-batches where interleaving takes
    # groups of 2) was refused across processes, and taken in one (model(x)); a step
    # still refuses it (its table needs the groups).
    rules = NCCLRules(2)
    x, y = _batch(3, 3, 4), _batch(4, 3, 4)
    plain = mlp().eval()

    models = [mlp() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 2, 2, 2], transport=transport, chunks=4)
        stage.eval()
        schedule = ScheduleInterleaved1F1B(stage, _mse)
        out = schedule.forward_only(x if stage.is_first else None)
        stage.train()
        with pytest.raises((ValueError, RemoteError), match="groups of n = 2"):
            schedule.step(x if stage.is_first else None, y if stage.is_last else None)
        return out

    first, last = run_threads(rank, 2, timeout=30.0, observe=rules.group)
    assert first is None
    torch.testing.assert_close(last, plain(x))
    rules.check()


def test_forward_only_in_one_process_is_the_models_forward_without_grad() -> None:
    from torchgpipe import GPipe

    model = GPipe(mlp(), [4, 4], chunks=3).eval()
    x = _batch(4, 6, 4)
    out = Schedule1F1B(model, _mse).forward_only(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, mlp()(x))


def test_a_failing_forward_only_step_fails_every_rank_and_the_next_one_works() -> None:
    models = _faulty_models(2, 5)  # layer 5: in stage 1, on rank 1
    models[1][5].fault = _boom
    x = _batch(5, 4, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        failed = _outcome(lambda: schedule.forward_only(x if stage.is_first else None))
        return failed, schedule.forward_only(x if stage.is_first else None)

    (failed0, again0), (failed1, again1) = _on_ranks(2, [4, 4], body, models=models, chunks=2)
    assert isinstance(failed1, ZeroDivisionError)
    assert isinstance(failed0, RemoteError)
    assert again0 is None
    torch.testing.assert_close(again1, _faulty_models(1, 5)[0](x))


# One trace across processes.


def test_traces_of_every_rank_merge_into_one_on_a_common_clock(tmp_path: Any) -> None:
    x, y = _batch(6, 8, 4), _batch(7, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        with stage.trace() as trace:
            _step(schedule, x, y)
        mine = {e.j for e in trace.events}
        return mine, stage.gather_trace(trace)

    (mine0, merged), (mine1, nothing) = _on_ranks(2, [4, 4], body, chunks=4)
    assert (mine0, mine1) == ({0}, {1})  # each rank records its own stages
    assert nothing is None
    assert merged is not None
    assert merged.n == 2
    assert merged.m == 4
    forward = {(e.i, e.j): e for e in merged.events if e.kind == "forward"}
    assert set(forward) == {(i, j) for i in range(4) for j in range(2)}
    for i in range(4):  # stage 1's forward of i starts after stage 0's has ended
        assert forward[(i, 1)].start >= forward[(i, 0)].end
    assert {e.thread.split(":")[0] for e in merged.events} == {"rank 0", "rank 1"}
    assert {e.kind for e in merged.events} >= {"forward", "backward"}
    merged.save_chrome(tmp_path / "pipeline.json")
    assert (tmp_path / "pipeline.json").stat().st_size > 0


def test_a_rank_given_as_a_numpy_integer_gathers_the_trace_there() -> None:
    np = pytest.importorskip("numpy")
    x, y = _batch(6, 8, 4), _batch(7, 8, 4)

    def body(stage: PipelineStage) -> Any:
        with stage.trace() as trace:
            _step(Schedule1F1B(stage, _mse), x, y)
        return stage.gather_trace(trace, dst=np.int64(1))

    nothing, merged = _on_ranks(2, [4, 4], body, chunks=4)
    assert nothing is None
    assert merged is not None
    assert merged.n == 2


@pytest.mark.parametrize("case", ["no input", "an empty batch", "a batch the table refuses"])
def test_a_call_refused_at_rank_0s_start_draws_no_seed_anywhere(case: str) -> None:
    # Rank 0 drew the step's seed before it looked at the input; the others never drew
    # theirs, and data shuffled on each rank under one seed went out of step for good.
    inputs = {"no input": None, "an empty batch": torch.zeros(0, 4), "a batch the table "
              "refuses": torch.zeros(3, 4)}  # fmt: skip
    interleaved = case.startswith("a batch the table")  # 3 micro-batches on 2 ranks
    balance = [2, 2, 2, 2] if interleaved else [4, 4]
    models = [mlp(), mlp()]
    torch.manual_seed(7)  # the ranks share this process's default generator here
    before = torch.get_rng_state()

    def body(stage: PipelineStage) -> Any:
        schedule = (ScheduleInterleaved1F1B if interleaved else Schedule1F1B)(stage, _mse)
        x = inputs[case] if stage.is_first else None
        if interleaved:  # a step: forward_only takes any number of micro-batches
            return _outcome(lambda: schedule.step(x, torch.zeros(3, 4) if stage.is_last else None))
        return _outcome(lambda: schedule.forward_only(x))

    refused = _on_ranks(2, balance, body, models=models, chunks=4)
    assert isinstance(refused[0], ValueError), refused
    assert isinstance(refused[1], RemoteError), refused
    assert torch.equal(torch.get_rng_state(), before)


# Start-up checks that a step would otherwise find too late.


def test_ranks_whose_models_tie_different_tensors_refuse_to_start() -> None:
    # Same layers and shapes: only the tie differs, which changes the step's transfers
    # (rank 0 would send a tied weight's gradient that rank 1 never receives).
    models = [mlp() for _ in range(2)]
    models[0][4].weight = models[0][2].weight
    errors = _on_ranks(2, [4, 4], lambda stage: stage, models=models)
    for error in errors:
        assert isinstance(error, ValueError)
        assert str(error) == str(errors[0])
        assert "tied tensors differ, on rank 0 but not on rank 1: 4.weight is 2.weight" in str(
            error
        )


def test_ranks_whose_layers_hold_other_modules_refuse_to_start() -> None:
    # Same layer classes and tensors: only a module inside a layer differs, which holds
    # no tensor (each rank would compute its own function, silently).
    models = [mlp() for _ in range(2)]
    models[0][3] = nn.Sequential(nn.Tanh())
    models[1][3] = nn.Sequential(nn.ReLU())
    errors = _on_ranks(2, [4, 4], lambda stage: stage, models=models)
    for error in errors:
        assert isinstance(error, ValueError)
        assert "layer 3 is 3: Sequential [0: Tanh]() on rank 0 but 3: Sequential [0: ReLU]()" in (
            str(error)
        )


def _meta_mlp_and_states(world: int) -> tuple[list[nn.Sequential], list[dict[str, Tensor]]]:
    """Meta models of ``mlp()``, and its state dict, without ``4.weight`` on rank 1."""
    with torch.device("meta"):
        models = [mlp() for _ in range(world)]
    states = [mlp().state_dict() for _ in range(world)]
    del states[1]["4.weight"]  # layer 4: rank 1's with balance [4, 4] or [3, 3, 2]
    return models, states


def test_a_rank_that_fails_to_build_its_stage_fails_every_rank_at_once() -> None:
    # Regression: a failure of rank 1's own start (after the ranks have built their
    # transports) was not told to the others: they waited for its fingerprint until it
    # exited, or until the timeout. Now every rank fails at once and the ranks are left
    # able to start again, with no listener thread of the failed start behind.
    models, states = _meta_mlp_and_states(3)
    plain = [mlp() for _ in range(3)]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    before = set(threading.enumerate())
    everyone = threading.Barrier(3)
    left: list[str] = []

    def rank(transport: Transport) -> Any:
        r = transport.rank
        start = time.monotonic()
        failed = _outcome(
            lambda: PipelineStage(models[r], [3, 3, 2], transport=transport, state_dict=states[r])
        )
        seconds = time.monotonic() - start
        if everyone.wait() == 0:  # one rank, once every start is over: what still runs
            listeners = [t for t in threading.enumerate() if "listener" in t.name]
            deadline = time.monotonic() + 5.0
            for thread in set(listeners) - before:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
                left.extend([thread.name] if thread.is_alive() else [])
        everyone.wait()
        stage = PipelineStage(plain[r], [3, 3, 2], transport=transport, chunks=2)
        return failed, seconds, _step(Schedule1F1B(stage, _mse), x, y).loss

    out = run_threads(rank, 3, timeout=30.0)  # the transports time out after 15 s
    assert not left
    assert all(isinstance(o, tuple) for o in out), out
    own = out[1][0]
    assert isinstance(own, ValueError), repr(own)
    assert "the state dict has no 4.weight" in str(own)
    for r in (0, 2):
        remote, seconds, _ = out[r]
        assert isinstance(remote, RemoteError), repr(remote)
        assert (remote.rank, remote.stages, remote.action) == (1, (1,), None)
        assert str(remote).startswith(
            "rank 1 (stages [1]) raised ValueError: the state dict has no 4.weight"
        )
        assert "while building its PipelineStage" in str(remote)
        assert remote.remote_traceback is not None
        assert "ValueError: the state dict has no 4.weight" in remote.remote_traceback
        assert seconds < 5.0  # told by rank 1, not found by a timeout
    loss, _, _ = _reference(mlp(), x, y)
    for o in out:  # and the ranks start again, and step
        torch.testing.assert_close(o[2], loss)


def _failing_start_rank(rank: int, world: int) -> dict[str, Any]:
    models, states = _meta_mlp_and_states(world)
    start = time.monotonic()
    failed = _outcome(lambda: PipelineStage(models[rank], [4, 4], state_dict=states[rank]))
    seconds = time.monotonic() - start
    # Rank 1 lives on until every rank has failed: they must hear of its failure from
    # it, not from its exit (the others would still fail, but naming no cause).
    dist.barrier()
    return {
        "type": type(failed).__name__,
        "text": str(failed),
        "rank": getattr(failed, "rank", None),
        "seconds": seconds,
    }


@pytest.mark.distributed
def test_a_rank_that_fails_to_build_its_stage_is_named_by_every_process() -> None:
    timeout = 60.0
    other, own = spawn(_failing_start_rank, 2, timeout=timeout)  # ranks 0 and 1
    assert own["type"] == "ValueError", own
    assert "the state dict has no 4.weight" in own["text"]
    assert other["type"] == "RemoteError", other
    assert other["rank"] == 1
    assert other["text"].startswith(
        "rank 1 (stages [1]) raised ValueError: the state dict has no 4.weight"
    )
    assert other["seconds"] < timeout / 4  # told by rank 1, not found by a timeout


@pytest.mark.parametrize(
    ("dst", "trace", "error", "match"),
    [
        (2, None, ValueError, r"dst=2 is not a rank of the pipeline's 2 processes; pass a "),
        (-1, None, ValueError, r"dst=-1 is not a rank .* from 0 to 1"),
        ("0", None, TypeError, "dst must be a rank"),
        (0, "a trace", TypeError, "gather_trace takes the Trace that stage.trace"),
        # Another pipeline's: its events were merged as this one's, and its summary failed.
        (0, Trace(3), ValueError, r"own trace \(of stages \(\d,\) of 2\), got one of 3"),
    ],
)
def test_gather_trace_refuses_bad_arguments_and_the_next_step_runs(
    dst: Any, trace: Any, error: type[Exception], match: str
) -> None:
    x, y = _batch(6, 8, 4), _batch(7, 8, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        with stage.trace() as recorded:
            _step(schedule, x, y)
        with pytest.raises(error, match=match):
            stage.gather_trace(recorded if trace is None else trace, dst=dst)
        return _step(schedule, x, y).loss

    losses = _on_ranks(2, [4, 4], body, chunks=2)
    for loss in losses:
        torch.testing.assert_close(loss, _reference(mlp(), x, y)[0])


# Randomness: every rank's cells follow the seed rank 0 draws at the step's start.


def _dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))


def test_dropout_on_every_rank_follows_the_seed_rank_0_draws() -> None:
    import torchgpipe

    x, y = _batch(6, 8, 4), _batch(7, 8, 16)
    one = torchgpipe.GPipe(_dropout_model(), [2, 2], chunks=2)
    torch.manual_seed(5)
    result = torchgpipe.Schedule1F1B(one, _mse).step(x, y)
    expected = _grads(one)
    draw_seed()  # rank 1's draw of the step, from the generator the threads share
    output = torchgpipe.Schedule1F1B(one, _mse).forward_only(x)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        step = _step(schedule, x, y)
        return step.loss, _grads(stage), schedule.forward_only(x if stage.is_first else None)

    models = [_dropout_model() for _ in range(2)]
    # Rank 0's draw is the step's seed, as in one process; rank 1 draws one after it and
    # drops it, as every rank does so that processes' generators move on alike. (Before,
    # each rank's draw was its seed: the second got another.)
    torch.manual_seed(5)
    (loss0, grads0, _), (loss1, grads1, output1) = _on_ranks(
        2, [2, 2], body, models=models, chunks=2
    )
    torch.testing.assert_close(loss0, result.loss)
    torch.testing.assert_close(loss1, result.loss)
    _assert_grads(_merged([grads0, grads1]), expected)
    torch.testing.assert_close(output1, output)


# Promise 4: every rank of a failed step fails.


class _WithStatistic(nn.Module):
    """A head whose output holds a number that differs between micro-batches.

    Not a tensor with a batch dimension: the micro-batches' outputs cannot be gathered.
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, float]:
        h = self.linear(x)
        return h, float(h.detach().norm())


def test_an_output_the_last_rank_cannot_gather_fails_every_rank() -> None:
    def models() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _WithStatistic())

    x, y = _batch(6, 6, 4), _batch(7, 6, 4)

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, lambda out, t: _mse(out[0], t))
        step = _outcome(lambda: _step(schedule, x, y))
        forward = _outcome(lambda: schedule.forward_only(x if stage.is_first else None))
        return step, forward

    (step0, forward0), (step1, forward1) = _on_ranks(
        2, [2, 1], body, models=[models(), models()], chunks=2
    )
    for failed in (step1, forward1):
        assert isinstance(failed, ValueError)
        assert "output[1] is " in str(failed)
        assert "in micro-batch 0 but" in str(failed)
    for failed in (step0, forward0):
        assert isinstance(failed, RemoteError)
        assert "rank 1 (stages [1]) raised ValueError" in str(failed)


def test_a_step_ends_twice_only_where_a_rank_has_work_after_its_end() -> None:
    # The work after a step's end (ties, the caller's graph, hooks) may fail on one rank:
    # a second end then tells the others. A step without any costs nothing more.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def rank(transport: Transport) -> list[int]:
        ends = [0]
        send = transport.send

        def counted(peer: int, header: Any, tensors: Any) -> None:
            ends[0] += header[0] == "end"
            send(peer, header, tensors)

        transport.send = counted  # type: ignore[method-assign]
        stage = PipelineStage(mlp(), [4, 4], transport=transport, chunks=2)
        schedule = Schedule1F1B(stage, _mse)
        counts = []
        for hooked in (False, True):
            if hooked and stage.is_last:
                stage.get_parameter("6.weight").register_hook(lambda grad: grad)
            start = ends[0]
            _step(schedule, x, y)
            counts.append(ends[0] - start)
        return counts

    assert run_threads(rank, 2) == [[1, 2], [1, 2]]


@pytest.mark.parametrize("global_ranks", [None, (3, 4, 5)])
def test_a_tie_holder_lost_in_a_step_that_settles_is_named_by_every_rank(
    global_ranks: tuple[int, ...] | None,
) -> None:
    # A hook on rank 1, which holds no copy of the tie, makes the step settle: rank 2,
    # lost while the ties were summed, is then named there too, not just by its peer;
    # by its global rank too where the group is not every process (the owner did not).
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        head.weight = embedding.weight
        return nn.Sequential(embedding, nn.Linear(4, 4), head)

    models = [tied() for _ in range(3)]
    ids = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))

    def rank(transport: Transport) -> Any:
        transport.global_ranks = global_ranks
        stage = PipelineStage(models[transport.rank], [1, 1, 1], transport=transport, chunks=2)
        if stage.rank == 1:
            stage.get_parameter("1.weight").register_hook(lambda grad: grad)
        if stage.rank == 2:
            lose_in_tie_sum(stage, transport)
        return _outcome(lambda: _step(Schedule1F1B(stage, nn.functional.cross_entropy), ids, ids))

    owner, between, holder = run_threads(rank, 3, timeout=20.0)
    assert isinstance(holder, RuntimeError)
    assert str(holder) == "gone"
    for told in (owner, between):
        assert isinstance(told, RemoteError), repr(told)
        assert (told.rank, told.stages) == (2, (2,))
        who = "rank 2" if global_ranks is None else "rank 2 (global rank 5)"
        assert str(told).startswith(f"{who} (stages [2]) died or cannot be reached")


class _ToComplex(nn.Module):
    """A complex value from a real one, as a conjugate view (``is_conj()``), or sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = False

    def forward(self, h: Tensor) -> Tensor:
        if self.sparse:
            return h.to_sparse()
        return torch.complex(h, 2 * h).conj()


class _FromComplex(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        return z.real + z.imag


def _complex_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), _ToComplex(), _FromComplex(), nn.Linear(4, 4))


def test_a_conjugate_view_between_stages_matches_the_plain_model() -> None:
    # Regression: its byte view raised in the sender's put, and the step failed.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)

    def body(stage: PipelineStage) -> Any:
        return _step(Schedule1F1B(stage, _mse), x, y).loss, _grads(stage)

    out = _on_ranks(2, [2, 2], body, models=[_complex_net(), _complex_net()], chunks=2)
    loss, grads, _ = _reference(_complex_net(), x, y)
    for got, _ in out:
        torch.testing.assert_close(got, loss)
    _assert_grads(_merged([g for _, g in out]), grads)


def test_a_sparse_tensor_between_stages_is_refused_on_every_rank() -> None:
    # Regression: torch's own "unsupported memory format option Contiguous".
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    models = [_complex_net(), _complex_net()]
    models[0][1].sparse = True

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        failed = _outcome(lambda: _step(schedule, x, y))
        if stage.is_first:
            models[0][1].sparse = False
        stage.zero_grad()
        return failed, _step(schedule, x, y).loss

    (own, loss0), (told, loss1) = _on_ranks(2, [2, 2], body, models=models, chunks=2)
    assert isinstance(own, TypeError)
    assert str(own).startswith(
        "a tensor of layout torch.sparse_coo (shape [4, 4]) cannot pass between stages "
        "on different processes, only dense ones: return it dense from its stage"
    )
    assert any("0F0 (stage 0 on rank 0" in note for note in getattr(own, "__notes__", []))
    assert isinstance(told, RemoteError)
    assert (told.rank, told.action) == (0, "0F0")
    loss, _, _ = _reference(_complex_net(), x, y)
    torch.testing.assert_close(loss0, loss)
    torch.testing.assert_close(loss1, loss)


# Calls made in every process at once: one that makes another call fails them all, at
# once, naming it (before, the step and the collect waited for each other's messages
# until the transport's timeout, then each claimed the other had died).

_CALL_NAMES = {
    "step": "schedule.step()",
    "forward_only": "schedule.forward_only()",
    "clip": "stage.clip_grad_norm_()",
    "trace": "stage.gather_trace()",
}


@pytest.mark.parametrize(
    ("calls", "static_shapes"),
    [
        (("step", "clip"), False),
        (("step", "clip"), True),
        (("clip", "step"), False),
        (("step", "trace"), True),
        (("trace", "step"), False),
        (("forward_only", "clip"), False),
        (("trace", "clip"), False),
        (("step", "step", "clip"), False),
        (("step", "trace", "step"), True),
        (("clip", "step", "step"), False),
        # Rank 0 collecting while another steps, with layouts remembered.
        (("clip", "step"), True),
        (("trace", "step"), True),
        (("clip", "forward_only"), True),
        (("clip", "step", "step"), True),
        (("clip", "clip", "step"), True),
    ],
)
def test_a_rank_that_makes_another_call_fails_every_rank_at_once_and_the_next_step_runs(
    calls: tuple[str, ...], static_shapes: bool
) -> None:
    world = len(calls)
    balance = [[4, 4], [3, 3, 2]][world - 2]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    timeout = 20.0  # the transports give up on a silent peer after half of it

    def body(stage: PipelineStage) -> Any:
        schedule = Schedule1F1B(stage, _mse)
        with stage.trace() as trace:
            _step(schedule, x, y)  # static shapes: the next step reuses its layouts
        call: Callable[[], Any] = {
            "step": lambda: _step(schedule, x, y),
            "forward_only": lambda: schedule.forward_only(x if stage.is_first else None),
            "clip": lambda: stage.clip_grad_norm_(1.0),
            "trace": lambda: stage.gather_trace(trace, dst=0),
        }[calls[stage.rank]]
        start = time.monotonic()
        failed = _outcome(call)
        seconds = time.monotonic() - start
        stage.zero_grad()
        results = [_step(schedule, x, y) for _ in range(2)]  # anew, then static again
        return failed, seconds, results, _grads(stage)

    models = [mlp() for _ in range(world)]
    rules = NCCLRules(world)

    def run(transport: Transport) -> Any:
        model = models[transport.rank]
        return body(
            PipelineStage(
                model, balance, transport=transport, chunks=4, static_shapes=static_shapes
            )
        )

    out = run_threads(run, world, timeout=timeout, observe=rules.group)
    assert all(isinstance(o, tuple) for o in out), out
    rules.check()  # the failed call's transfers matched, as NCCL needs them to
    for rank, (failed, seconds, _, _) in enumerate(out):
        assert type(failed) is RuntimeError, repr(failed)
        others = [
            f"rank {peer} called {_CALL_NAMES[call]}"
            for peer, call in enumerate(calls)
            if call != calls[rank]
        ]
        said = f"{', '.join(others)} while this process called {_CALL_NAMES[calls[rank]]}"
        assert said in str(failed), (rank, str(failed))
        assert "every process must make the same call at once" in str(failed)
        assert seconds < timeout / 8, (rank, seconds)  # told, not timed out
    # The stages and the transports serve the next step as if nothing had happened.
    loss, grads, _ = _reference(mlp(), x, y)
    _assert_grads(_merged([o[3] for o in out]), {n: 2 * g for n, g in grads.items()})
    for o in out:
        for result in o[2]:
            torch.testing.assert_close(result.loss, loss)


@pytest.mark.parametrize(
    "calls",
    [
        ("clip:1.0", "clip:0.01"),
        ("clip:1.0:2", "clip:1.0:inf"),
        ("trace:1", "trace:0"),
        ("trace:0", "trace:0", "trace:1"),
    ],
)
def test_a_collect_made_with_other_arguments_fails_every_rank(calls: tuple[str, ...]) -> None:
    # Each process would clip by another scale, or the trace would go nowhere.
    world = len(calls)
    balance = [[4, 4], [3, 3, 2]][world - 2]
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    models = [mlp() for _ in range(world)]

    def run(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], balance, transport=transport, chunks=4)
        schedule = Schedule1F1B(stage, _mse)
        with stage.trace() as trace:
            _step(schedule, x, y)
        kind, *args = calls[stage.rank].split(":")
        if kind == "clip":
            failed = _outcome(lambda: stage.clip_grad_norm_(float(args[0]), *map(float, args[1:])))
        else:
            failed = _outcome(lambda: stage.gather_trace(trace, dst=int(args[0])))
        return failed, _step(schedule, x, y)

    out = run_threads(run, world, timeout=20.0)
    for failed, result in out:
        assert type(failed) is RuntimeError, repr(failed)
        assert "was called with other arguments on other processes" in str(failed)
        assert "call it with the same arguments in every process" in str(failed)
        assert result.loss is not None  # the next step runs


@pytest.mark.parametrize("call", ["clip", "clip:str", "trace"])
def test_a_rank_that_refuses_its_arguments_still_tells_the_others(call: str) -> None:
    # Rank 0 refuses its own arguments (a negative max_norm, a dst out of range); the
    # other learns of it at once instead of waiting, and the next step runs.
    x, y = _batch(1, 8, 4), _batch(2, 8, 4)
    models = [mlp() for _ in range(2)]

    def run(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [4, 4], transport=transport, chunks=4)
        schedule = Schedule1F1B(stage, _mse)
        with stage.trace() as trace:
            _step(schedule, x, y)
        bad = stage.rank == 0
        if call.startswith("clip"):
            # A string that reads as 1.0: refused there, and never taken for 1.0 here.
            wrong: Any = "1.0" if call == "clip:str" else -1.0
            failed = _outcome(lambda: stage.clip_grad_norm_(wrong if bad else 1.0))
        else:
            failed = _outcome(lambda: stage.gather_trace(trace, dst=5 if bad else 0))
        return failed, _step(schedule, x, y)

    (zero, after0), (one, after1) = run_threads(run, 2, timeout=20.0)
    assert type(zero) is (TypeError if call == "clip:str" else ValueError), repr(zero)
    assert any("the other processes were told" in note for note in zero.__notes__)
    assert type(one) is RuntimeError, repr(one)
    assert "was called with other arguments on other processes: rank 0 with" in str(one)
    torch.testing.assert_close(after0.loss, after1.loss)


def test_a_dropped_stage_goes_without_the_collector() -> None:
    # The step's exchange, in a cycle with its transfers, held the stage through the
    # functions it was given: dropped stages (parameters, listener threads) piled up
    # until a collection, 18 of them in the review's loop of rebuilds.
    import gc
    import weakref

    models = [mlp() for _ in range(2)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [4, 4], transport=transport, chunks=2)
        Schedule1F1B(stage, _mse).step(x if stage.is_first else None, y if stage.is_last else None)
        return weakref.ref(stage)

    gc.collect()
    gc.disable()
    try:
        refs = run_threads(rank, 2)
        assert all(isinstance(ref, weakref.ref) for ref in refs), refs
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


class _CastingHead(nn.Module):
    """A head that takes its input in its own weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 10, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(h.to(self.linear.weight.dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_tied_weight_converted_on_one_rank_alone_is_refused_on_every_rank(
    dtype: torch.dtype,
) -> None:
    # Regression: the gradients travel as bytes: of another size, gloo ended a process;
    # of the same size (float16 against bfloat16), each read the other's as its own.
    def tied() -> nn.Sequential:
        torch.manual_seed(0)
        embedding, head = nn.Embedding(10, 4), _CastingHead()
        head.linear.weight = embedding.weight
        return nn.Sequential(embedding, nn.Linear(4, 4), head)

    models = [tied() for _ in range(3)]
    ids = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))

    def loss(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.float(), target)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [1, 1, 1], transport=transport, chunks=2)
        if dtype == torch.bfloat16:
            stage.half()
        if stage.rank == 2:
            stage.to(dtype)
        return _outcome(lambda: _step(Schedule1F1B(stage, loss), ids, ids))

    for out in run_threads(rank, 3, timeout=20.0):
        assert isinstance(out, TypeError), repr(out)
        assert "tied weight 0.weight have other dtypes" in str(out)
        assert f"rank 2: {dtype}" in str(out)


def test_a_layer_assigned_to_a_stage_under_its_name_is_the_one_its_step_runs() -> None:
    # Regression: the stage's partition kept the old layer, which the step ran while
    # parameters() held the new one.
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    torch.manual_seed(1)
    head = nn.Linear(4, 4)
    plain = model()
    plain[2] = copy.deepcopy(head)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    _mse(plain(x), y).backward()
    models = [model() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(models[transport.rank], [2, 1], transport=transport, chunks=2)
        if stage.is_last:
            setattr(stage, "2", copy.deepcopy(head))
        _step(Schedule1F1B(stage, _mse), x, y)
        return {name: p.grad for name, p in stage.named_parameters()}

    grads = {k: v for out in run_threads(rank, 2) for k, v in out.items()}
    torch.testing.assert_close(grads, {k: p.grad for k, p in plain.named_parameters()})


def test_a_deferred_batch_norm_assigned_to_a_stage_updates_once_per_mini_batch() -> None:
    # Regression: the step started the deferred batch norms before following the swap,
    # so the new one updated once per micro-batch, from each one's statistics.
    from torchgpipe.batchnorm import DeferredBatchNorm

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))

    torch.manual_seed(1)
    x, y = torch.randn(8, 3) * 3 + 1, torch.randn(8, 3)
    models = [model() for _ in range(2)]

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank], [2, 1], transport=transport, chunks=4, deferred_batch_norm=True
        )
        norm = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(3))
        if stage.is_first:
            setattr(stage, "1", norm)
        _step(Schedule1F1B(stage, _mse), x, y)
        return norm.running_mean.clone()

    mean, _ = run_threads(rank, 2)
    plain = nn.BatchNorm1d(3)
    plain(models[0][0](x))
    torch.testing.assert_close(mean, plain.running_mean)
