import copy
import gc
import itertools
import threading
import traceback

import pytest
import torch
from helpers import Fail, Recorder, assert_workers_idle_and_alive, indexed_input
from torch import nn

from torchgpipe import GPipe, is_checkpointing
from torchgpipe.pipeline import clock_cycles


def test_clock_cycles_match_the_diagram() -> None:
    # The table drawn in pipeline.py's docstring, m = 3, n = 3.
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 4), (4, 1), (3, 5), (8, 3)])
def test_clock_cycles_cover_every_cell_once(m: int, n: int) -> None:
    cells = [cell for tick in clock_cycles(m, n) for cell in tick]
    assert sorted(cells) == [(i, j) for i in range(m) for j in range(n)]
    ticks = {cell: k for k, tick in enumerate(clock_cycles(m, n)) for cell in tick}
    assert all(ticks[(i, j)] == i + j for i, j in cells)


def _pipeline_of_recorders(n: int, log: list[tuple[int, str, int, int]]) -> GPipe:
    clock = itertools.count()
    layers = [Recorder(j, log, clock) for j in range(n)]
    return GPipe(nn.Sequential(*layers), [1] * n, devices=["cpu"] * n, chunks=8)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cells_respect_the_schedule_dependencies(n: int) -> None:
    log: list[tuple[int, str, int, int]] = []
    model = _pipeline_of_recorders(n, log)
    m = 6
    model(indexed_input(m))
    start = {(i, j): t for t, kind, j, i in log if kind == "forward-start"}
    end = {(i, j): t for t, kind, j, i in log if kind == "forward-end"}
    assert sorted(start) == [(i, j) for i in range(m) for j in range(n)]
    for i, j in start:
        if i > 0:
            assert start[i, j] > end[i - 1, j]
        if j > 0:
            assert start[i, j] > end[i, j - 1]


def test_partitions_on_one_device_run_concurrently() -> None:
    # Cells (1, 0) and (0, 1) share tick 1: each waits at a barrier for the other, which
    # only passes if the two partitions run at the same time.
    barrier = threading.Barrier(2, timeout=10)
    log: list[tuple[int, str, int, int]] = []
    model = _pipeline_of_recorders(2, log)
    model[0].hook = lambda i: barrier.wait() if i == 1 else None
    model[1].hook = lambda i: barrier.wait() if i == 0 else None
    model(indexed_input(2))
    assert not barrier.broken


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize(("j", "i"), [(0, 0), (1, 2), (2, 3)])
def test_forward_exception_reaches_caller(checkpoint: str, j: int, i: int) -> None:
    layers: list[nn.Module] = [nn.Identity() for _ in range(3)]
    layers[j] = Fail(KeyError("boom"), on=i)
    model = GPipe(nn.Sequential(*layers), [1, 1, 1], chunks=4, checkpoint=checkpoint)
    x = indexed_input(4).requires_grad_()
    with pytest.raises(KeyError, match="boom") as info:
        model(x)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"partition {j}" in notes
    assert f"micro-batch {i} of 4" in notes
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "forward" in frames  # the raising layer's frame is kept
    layers[j].on = -1  # type: ignore[assignment]
    assert torch.equal(model(x), x)  # the next call works
    assert_workers_idle_and_alive(model, 3)


def test_first_failure_by_micro_batch_is_raised() -> None:
    class FailAll(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError(f"micro-batch {int(x[0, 0])}")

    model = GPipe(nn.Sequential(nn.Identity(), FailAll()), [1, 1], chunks=4)
    with pytest.raises(RuntimeError, match="micro-batch 0"):
        model(indexed_input(4))


def test_base_exception_from_a_layer_is_not_swallowed() -> None:
    class Exit(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise SystemExit(3)

    model = GPipe(nn.Sequential(nn.Identity(), Exit()), [1, 1], chunks=2)
    with pytest.raises(SystemExit):
        model(indexed_input(2))
    assert_workers_idle_and_alive(model, 2)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("in backward")


class FailingBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_backward_exception_reaches_caller(checkpoint: str) -> None:
    model = GPipe(
        nn.Sequential(nn.Linear(3, 3), FailingBackward(), nn.Linear(3, 1)),
        [1, 2],
        chunks=3,
        checkpoint=checkpoint,
    )
    out = model(torch.randn(6, 3))
    with pytest.raises(ArithmeticError, match="in backward"):
        out.sum().backward()
    model(torch.randn(6, 3))  # the next call works
    assert_workers_idle_and_alive(model, 2)


class FailOnce(nn.Module):
    """Fails in backward on the micro-batch whose first sample is ``target``, once."""

    def __init__(self, target: float) -> None:
        super().__init__()
        self.target = target
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and x[0, 0].item() == self.target:
            if not is_checkpointing():  # the checkpointed forward records no graph
                self.armed = False
            return _FailingBackward.apply(x)
        return x


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_backward_failure_on_one_micro_batch_then_success(checkpoint: str) -> None:
    # Only micro-batch 1 of 3 fails in backward; the next forward and backward work and
    # give the plain model's gradients.
    linear = nn.Linear(3, 3)
    plain = copy.deepcopy(linear)
    model = GPipe(nn.Sequential(linear, FailOnce(2.0)), [1, 1], chunks=3, checkpoint=checkpoint)
    x = torch.arange(18.0).reshape(6, 3)
    model[1].target = linear(x[2:4])[0, 0].item()  # micro-batch 1's first sample
    with pytest.raises(ArithmeticError, match="in backward"):
        model(x).sum().backward()
    linear.zero_grad()
    model(x).sum().backward()
    plain(x).sum().backward()
    assert linear.weight.grad is not None
    assert torch.allclose(linear.weight.grad, plain.weight.grad)  # type: ignore[arg-type]
    assert_workers_idle_and_alive(model, 2)


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")  # a new exception each time: no layer holds a traceback


def test_no_worker_thread_outlives_a_model_that_failed() -> None:
    model = GPipe(nn.Sequential(nn.Identity(), Boom()), [1, 1], chunks=2)
    with pytest.raises(ValueError, match="boom") as info:
        model(indexed_input(2))
    del info  # it holds the traceback, and so the pipeline's frames
    threads = model.workers.pool.threads  # type: ignore[union-attr]
    del model
    gc.collect()  # the exception's traceback and the pipeline's frames form a cycle
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_no_worker_thread_outlives_the_model() -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)
    model(torch.randn(4, 2)).sum().backward()
    threads = model.workers.pool.threads  # type: ignore[union-attr]
    assert len(threads) == 2
    del model
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_workers_start_once_and_serve_every_call() -> None:
    model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)
    model(torch.randn(4, 2))
    pool = model.workers.pool
    for _ in range(3):
        model(torch.randn(4, 2)).sum().backward()
    assert model.workers.pool is pool
