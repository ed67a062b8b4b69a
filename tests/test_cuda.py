"""The CUDA paths: streams, copies, random-number replay, memory, on a real GPU.

Every test here is marked ``cuda`` and skips without a GPU (``conftest.py``). One GPU
is enough: partitions that share it still get a compute and a copy stream each, and
mixed CPU/GPU layouts copy both ways. The stream tests slow one stream down with
``torch.cuda._sleep`` (a kernel that spins for a number of clock cycles), so that a
missing wait or a block of memory reused too early shows in the values.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from helpers import PopAdd, StashLinear
from torch import Tensor, nn

from torchgpipe import GPipe, is_recomputing
from torchgpipe.balance import balance_by_size
from torchgpipe.balance.profile import layerwise_size
from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.training import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
# About 10 ms of spinning at the clocks of current data-centre GPUs.
SLOW = 20_000_000

LAYOUTS = {
    "one-gpu": [CUDA] * 4,
    # Interleaving runs partitions r and r + 2 on rank r: they share a device here too.
    "mixed": [CUDA, CPU, CUDA, CPU],
}
SCHEDULES: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zero-bubble": ScheduleZeroBubble,
    "interleaved": partial(ScheduleInterleaved1F1B, virtual_stages=2),
}
CHECKPOINTS = ["always", "except_last", "never"]


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


# Transparency with the fused CUDA dropout: the masks each cell drew are read off the
# dropout's output, and the plain model is run again with the very same masks.


class Replay(nn.Module):
    """Dropout with given masks, in the plain model."""

    def __init__(self, mask: Tensor, p: float) -> None:
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x: Tensor) -> Tensor:
        return x * self.mask.to(x.device, x.dtype) / (1 - self.p)


class Masks:
    """Watches every nn.Dropout of a model: the masks of forwards and of recomputations."""

    def __init__(self, model: nn.Module) -> None:
        self.forward: dict[int, list[Tensor]] = {}
        self.recomputed: dict[int, list[Tensor]] = {}
        self.dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        for k, layer in enumerate(self.dropouts):
            layer.register_forward_hook(partial(self._seen, k))

    def _seen(self, k: int, module: nn.Module, args: Any, output: Tensor) -> None:
        (x,) = args
        assert bool((x != 0).all()), "the test needs a dropout input without zeros"
        book = self.recomputed if is_recomputing() else self.forward
        book.setdefault(k, []).append((output != 0).cpu())

    def check_recomputed(self, cells: int) -> None:
        """Each recomputation drew the mask its forward drew."""
        count = 0
        for k, masks in self.recomputed.items():
            for mask in masks:
                assert any(torch.equal(mask, m) for m in self.forward[k]), f"dropout {k}"
                count += 1
        assert count == cells

    def plain(self, plain: nn.Sequential) -> nn.Sequential:
        """``plain`` with each dropout replaced by the masks drawn, micro-batches joined."""
        layers = list(plain)
        theirs = [j for j, layer in enumerate(layers) if isinstance(layer, nn.Dropout)]
        for k, j in enumerate(theirs):
            layers[j] = Replay(torch.cat(self.forward[k]), self.dropouts[k].p)
        return nn.Sequential(*layers)


def dropout_net() -> nn.Sequential:
    """Two fused dropouts (on the GPU partitions of both layouts) and a skip."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Dropout(0.3),
        StashLinear(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Dropout(0.5),
        PopAdd(),
        nn.Linear(8, 3),
    )


def _assert_grads(model: nn.Module, plain: nn.Module) -> None:
    pairs = zip(model.named_parameters(), plain.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        assert p.grad is not None, name
        assert q.grad is not None, name
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-9, atol=1e-11, msg=name)


def _checkpointed_cells(checkpoint: str, m: int, dropouts_per_cell: int = 1) -> int:
    stop = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]
    return 2 * stop * dropouts_per_cell  # two partitions hold a dropout each


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_gpipe_matches_the_plain_model_with_dropout(layout: str, checkpoint: str) -> None:
    plain = dropout_net().double()
    model = GPipe(copy.deepcopy(plain), [2, 2, 2, 2], devices=LAYOUTS[layout], chunks=4,
                  checkpoint=checkpoint)  # fmt: skip
    masks = Masks(model)
    x = torch.randn(10, 6, dtype=torch.float64)
    out = model(x)  # from CPU memory onto the first partition's copy stream
    assert out.device == LAYOUTS[layout][-1]
    grad = torch.randn(out.shape, dtype=torch.float64)
    out.backward(grad.to(out.device))
    masks.check_recomputed(_checkpointed_cells(checkpoint, 4))

    reference = masks.plain(plain)
    expected = reference(x)
    expected.backward(grad)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-9, atol=1e-11)
    _assert_grads(model, reference)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_cuda_schedules_match_the_plain_model_with_dropout(
    schedule: str, layout: str, checkpoint: str
) -> None:
    plain = dropout_net().double()
    devices = LAYOUTS[layout]
    model = GPipe(copy.deepcopy(plain), [2, 2, 2, 2], devices=devices, chunks=4,
                  checkpoint=checkpoint)  # fmt: skip
    masks = Masks(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 3, dtype=torch.float64)
    result = SCHEDULES[schedule](model, _mse).step(x, target.to(devices[-1]))
    masks.check_recomputed(_checkpointed_cells(checkpoint, 4))

    reference = masks.plain(plain)
    expected = reference(x)
    loss = _mse(expected, target)
    loss.backward()
    torch.testing.assert_close(result.loss.cpu(), loss.detach(), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(result.output.cpu(), expected.detach(), rtol=1e-9, atol=1e-11)
    _assert_grads(model, reference)


def test_cuda_runs_repeat_under_one_seed() -> None:
    # Partitions sharing the GPU draw from per-cell streams: the same seed, the same masks.
    def run() -> tuple[Tensor, list[Tensor]]:
        torch.manual_seed(5)
        model = GPipe(dropout_net(), [2, 2, 2, 2], devices=[CUDA] * 4, chunks=4,
                      checkpoint="always")  # fmt: skip
        torch.manual_seed(6)
        out = model(torch.ones(8, 6, device=CUDA))
        out.sum().backward()
        return out.detach().cpu(), [p.grad.cpu() for p in model.parameters() if p.grad is not None]

    (out1, grads1), (out2, grads2) = run(), run()
    assert torch.equal(out1, out2)
    for g1, g2 in zip(grads1, grads2, strict=True):
        assert torch.equal(g1, g2)


# Streams. Each test slows one stream down so that a missing synchronization would show.


class HostSlow(nn.Module):
    """Spends host time before its work, so its launches interleave with the next worker's."""

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.004)
        return x * 2


class DeviceSlow(nn.Module):
    """Holds its stream back before it reads its input."""

    def forward(self, x: Tensor) -> Tensor:
        torch.cuda._sleep(SLOW)
        return x + 1


class SlowProducer(nn.Module):
    """Writes its output only after holding its stream back."""

    def forward(self, x: Tensor) -> Tensor:
        torch.cuda._sleep(SLOW)
        return x * 3


def _counting(m: int, width: int = 4096) -> Tensor:
    """m rows of ``width``, row i all equal to i: a wrong row shows which one it came from."""
    return torch.arange(m, dtype=torch.float32, device=CUDA)[:, None].expand(m, width).clone()


@pytest.mark.parametrize("grad", [False, True])
def test_cuda_input_memory_is_not_reused_while_the_next_partition_reads_it(grad: bool) -> None:
    # Partition 0 hands each output to partition 1 on the same GPU and drops it. Without
    # recording it on partition 1's stream, the caching allocator would give its block
    # to partition 0's next output while partition 1 still waits to read it.
    model = GPipe(nn.Sequential(HostSlow(), DeviceSlow()), [1, 1], devices=[CUDA] * 2,
                  chunks=8, checkpoint="always")  # fmt: skip
    x = _counting(8)
    with torch.set_grad_enabled(grad):
        out = model(x.requires_grad_(grad))
    torch.testing.assert_close(out.detach(), x.detach() * 2 + 1)


def test_cuda_schedule_input_memory_is_not_reused_while_the_next_stage_reads_it() -> None:
    model = GPipe(nn.Sequential(HostSlow(), DeviceSlow(), nn.Linear(4096, 1)), [1, 2],
                  devices=[CUDA] * 2, chunks=8, checkpoint="always")  # fmt: skip
    x = _counting(8)
    result = ScheduleGPipe(model, _mse).step(x, torch.zeros(8, 1, device=CUDA))
    expected = model[2](x * 2 + 1)
    torch.testing.assert_close(result.output, expected.detach(), rtol=1e-4, atol=1e-3)


def test_cuda_next_partition_waits_for_the_producing_stream() -> None:
    model = GPipe(nn.Sequential(SlowProducer(), nn.Identity()), [1, 1],
                  devices=[CUDA] * 2, chunks=4)  # fmt: skip
    x = _counting(8)
    torch.testing.assert_close(model(x), x * 3)


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward holds its stream back before passing the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        torch.cuda._sleep(SLOW)
        return grad * 1


class SlowGrad(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return SlowBackward.apply(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cuda_step_gradients_are_ready_on_the_callers_stream(schedule: str) -> None:
    # The step's backward runs on the stages' streams; the caller reads the gradients on
    # its own stream right after step() returns, and must see them complete.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), SlowGrad(), nn.Linear(64, 64), SlowGrad())
    model = GPipe(copy.deepcopy(plain).to(CUDA), [2, 2], devices=[CUDA] * 2, chunks=4)
    x, target = torch.randn(8, 64, device=CUDA), torch.randn(8, 64, device=CUDA)
    result = SCHEDULES[schedule](model, _mse).step(x, target)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    loss = result.loss.clone()

    plain = plain.to(CUDA)
    expected = _mse(plain(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-6)
    for g, p in zip(grads, plain.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def _update_slowly(model: nn.Module) -> None:
    """An update queued on the current stream behind a slow kernel (an optimizer's step)."""
    torch.cuda._sleep(SLOW)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize("path", ["gpipe", "schedule"])
@pytest.mark.parametrize("caller", ["default", "side"])
def test_cuda_a_run_waits_for_what_the_caller_queued_before_it(path: str, caller: str) -> None:
    # The pipeline's streams never wait for another by themselves: a forward started
    # right after an update on the caller's stream read the weights before it.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(CUDA)
    model = GPipe(copy.deepcopy(plain), [2, 1], devices=[CUDA] * 2, chunks=4)
    x, target = torch.randn(8, 64, device=CUDA), torch.randn(8, 64, device=CUDA)
    stream = torch.cuda.current_stream() if caller == "default" else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _update_slowly(model)  # then the run, at once
        if path == "gpipe":
            got = model(x).detach()
        else:
            got = ScheduleGPipe(model, _mse).step(x, target).output
        torch.cuda.current_stream().synchronize()
    _update_slowly(plain)
    torch.testing.assert_close(got, plain(x).detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ["gpipe", "schedule"])
def test_cuda_memory_is_reused_from_step_to_step(path: str) -> None:
    # A pipeline keeps its streams: the caching allocator's blocks, kept per stream, serve
    # every later step, and the memory reserved stops growing after the first steps.
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    model = GPipe(layers, [1, 1, 1, 1], devices=[CUDA] * 4, chunks=4, checkpoint="never")
    x, target = torch.randn(64, 512, device=CUDA), torch.randn(64, 512, device=CUDA)
    schedule = Schedule1F1B(model, _mse)

    def step() -> None:
        if path == "gpipe":
            _mse(model(x), target).backward()
        else:
            schedule.step(x, target)
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()  # what a step leaves for later streams is free again

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved(CUDA)
    for _ in range(40):  # more steps than the 32 streams torch deals out in turn
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved(CUDA) == reserved


def test_cuda_pinned_input_and_output_on_the_cpu() -> None:
    # CPU -> GPU on the copy stream, non-blocking from pinned memory; GPU -> CPU at the end.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    model = GPipe(copy.deepcopy(plain), [2, 2], devices=[CUDA, CPU], chunks=4)
    x = torch.randn(16, 8).pin_memory()
    out = model(x)
    assert out.device == CPU
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


# Thread state, failures, batch norm, balancing and tracing on the GPU.


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_cuda_autocast_reaches_the_workers_and_the_recomputation(checkpoint: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    plain = plain.to(CUDA)
    model = GPipe(copy.deepcopy(plain), [2, 2], devices=[CUDA] * 2, chunks=2,
                  checkpoint=checkpoint)  # fmt: skip
    x = torch.randn(8, 16, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        expected = plain(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    expected.float().sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


class FailOn(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.calls, self.i = 0, i

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.i + 1:
            raise ValueError("boom on the GPU")
        return x


def test_cuda_failure_reaches_the_caller_and_the_next_call_works() -> None:
    layer = FailOn(2)
    model = GPipe(nn.Sequential(nn.Linear(4, 4), layer), [1, 1], devices=[CUDA] * 2, chunks=4)
    x = torch.randn(8, 4, device=CUDA)
    with pytest.raises(ValueError, match="boom on the GPU") as info:
        model(x)
    assert any("partition 1" in note for note in info.value.__notes__)
    assert model(x).shape == (8, 4)


class CountsOnDevice(nn.Module):
    """Counts its calls on the host and, behind a slow kernel, on its stream."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        torch.cuda._sleep(SLOW)
        with torch.no_grad():
            self.seen.add_(1)
        return x * 1


def test_cuda_failed_forward_leaves_the_callers_stream_behind_what_was_queued() -> None:
    # model(x) raises on partition 1 while partition 0's kernels may still be queued on
    # its stream. The caller's stream must wait for them all the same: a state dict
    # loaded right after the failure would otherwise be overwritten by them.
    counter = CountsOnDevice()
    model = GPipe(nn.Sequential(counter, FailOn(0)), [1, 1], devices=[CUDA] * 2,
                  chunks=4, checkpoint="never")  # fmt: skip
    with pytest.raises(ValueError, match="boom on the GPU"):
        model(torch.randn(8, 4, device=CUDA))
    seen = int(counter.seen.item())  # read on the caller's stream
    assert counter.calls >= 1
    assert seen == counter.calls


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_cuda_deferred_batch_norm_does_not_wait_for_the_gpu() -> None:
    # Merging each micro-batch's moments and updating the running statistics only queue
    # kernels: a host sync there would stall the partition's worker once per micro-batch.
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(8).to(CUDA)
    layer = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=4)
    x = torch.randn(16, 8, 5, 5, device=CUDA)
    torch.cuda.synchronize()
    try:  # the mode is set before torch warns of it: reset it whatever happens
        torch.cuda.set_sync_debug_mode("error")
        for piece in x.chunk(4):
            layer(piece)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    plain(x)
    torch.testing.assert_close(layer.running_mean, plain.running_mean)
    torch.testing.assert_close(layer.running_var, plain.running_var)
    assert int(layer.num_batches_tracked) == 1


def test_cuda_deferred_batch_norm_across_partitions_of_one_gpu() -> None:
    # The same pipeline on CPU partitions is the reference: its statistics are checked
    # against the plain model's in test_batchnorm.py.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4),
                          nn.BatchNorm1d(4))  # fmt: skip
    models = [
        GPipe(copy.deepcopy(plain), [2, 3], devices=devices, chunks=4, deferred_batch_norm=True)
        for devices in ([CUDA, CUDA], [CPU, CPU])
    ]
    x = torch.randn(16, 4)
    for model in models:
        model(x).sum().backward()
    for j in (1, 4):
        ours, theirs = models[0][j], models[1][j]
        assert isinstance(ours, DeferredBatchNorm)
        assert isinstance(theirs, DeferredBatchNorm)
        torch.testing.assert_close(ours.running_mean.cpu(), theirs.running_mean)
        torch.testing.assert_close(ours.running_var.cpu(), theirs.running_var)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


def test_cuda_layer_sizes_agree_with_the_cuda_allocator() -> None:
    # balance_by_size counts the bytes each layer keeps for backward; on a GPU the
    # allocator's own count of what a forward keeps must say the same.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 512), nn.Tanh())
    x = torch.randn(64, 256)
    sizes = layerwise_size(layers, x, chunks=1, param_scale=0.0, device=CUDA)
    on_device = copy.deepcopy(layers).to(CUDA)
    value = x.to(CUDA).requires_grad_()
    on_device(value).sum().backward()  # first calls allocate the libraries' workspaces
    kept = []
    for layer, size in zip(on_device, sizes, strict=True):
        before = torch.cuda.memory_allocated(CUDA)
        value = layer(value)
        kept.append(value)
        assert torch.cuda.memory_allocated(CUDA) - before == size, layer
    assert sizes == layerwise_size(layers, x, chunks=1, param_scale=0.0, device=CPU)
    assert sum(balance_by_size(2, layers, x, device=CUDA)) == len(layers)


def test_cuda_trace_records_every_cell() -> None:
    model = GPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), [1, 1], devices=[CUDA] * 2,
                  chunks=4, checkpoint="always")  # fmt: skip
    with model.trace() as trace:
        model(torch.randn(8, 8, device=CUDA)).sum().backward()
    kinds = {(e.j, e.i, e.kind) for e in trace.events}
    for j in range(2):
        for i in range(4):
            assert {(j, i, "forward"), (j, i, "recompute"), (j, i, "backward")} <= kinds


# Two processes on gloo, each with its stage on the one GPU: the stages' CUDA paths.


def _cuda_stage_rank(rank: int, world: int, checkpoint: str) -> tuple[Tensor, dict[str, Tensor]]:
    from torchgpipe.distributed import PipelineStage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Identity())  # fmt: skip
    stage = PipelineStage(model, [4, 4], rank=rank, device=CUDA, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    from torchgpipe.distributed import Schedule1F1B as Distributed1F1B

    result = Distributed1F1B(stage, _mse).step(
        x.to(CUDA) if stage.is_first else None, y.to(CUDA) if stage.is_last else None
    )
    grads = {n: p.grad.cpu() for n, p in stage.named_parameters() if p.grad is not None}
    return result.loss.cpu(), grads


@pytest.mark.distributed
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_cuda_stages_in_two_processes_match_the_plain_model(checkpoint: str) -> None:
    from distributed_helpers import spawn

    results = spawn(_cuda_stage_rank, 2, checkpoint)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Identity())  # fmt: skip
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    loss = _mse(plain(x), y)
    loss.backward()
    merged: dict[str, Tensor] = {}
    for rank_loss, grads in results:
        torch.testing.assert_close(rank_loss, loss.detach())
        merged.update(grads)
    expected = {n: p.grad for n, p in plain.named_parameters()}
    assert merged.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(merged[name], grad, msg=name)


def test_cuda_checkpoint_modes_and_schedules_draw_the_same_masks() -> None:
    # Cells draw from generators of their own on the GPU too: every mode and schedule
    # gives the masks model(x) draws under one seed.
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    runs = []
    for checkpoint in CHECKPOINTS:
        for schedule in [None, *SCHEDULES]:
            model = GPipe(dropout_net().double(), [2, 2, 2, 2], devices=LAYOUTS["mixed"],
                          chunks=4, checkpoint=checkpoint)  # fmt: skip
            torch.manual_seed(21)
            if schedule is None:
                output = model(x)
                _mse(output, target.to(output.device)).backward()
            else:
                output = SCHEDULES[schedule](model, _mse).step(x, target).output
            grads = [p.grad.cpu() for p in model.parameters() if p.grad is not None]
            runs.append((output.detach().cpu(), grads))
    first_out, first_grads = runs[0]
    for out, grads in runs[1:]:
        torch.testing.assert_close(out, first_out, rtol=0, atol=0)
        for g, h in zip(grads, first_grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-11)


def test_cuda_half_precision_dropout_scales_as_the_fused_kernel() -> None:
    # A scale rounded to bfloat16 before the multiply biased every kept value; CUDA's
    # fused dropout multiplies in float and rounds once.
    p = 0.1
    model = GPipe(nn.Sequential(nn.Dropout(p), nn.Identity()), [1, 1], devices=[CUDA] * 2)
    x = (torch.rand(4096, 64, device=CUDA) + 0.5).to(torch.bfloat16)
    out = model(x)
    kept = out != 0
    expected = (x.float() * (1.0 / (1.0 - p))).to(torch.bfloat16)
    assert torch.equal(out[kept], expected[kept])
