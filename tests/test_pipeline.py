import contextlib
import copy
import gc
import itertools
import threading
import traceback
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from helpers import (
    BackwardFails,
    Fail,
    Recorder,
    assert_same_grads,
    assert_workers_idle_and_alive,
    indexed_input,
)
from torch import Tensor, nn

from torchgpipe import GPipe, is_checkpointing
from torchgpipe.pipeline import clock_cycles
from torchgpipe.skip import pop, skippable, stash


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


def test_an_exception_that_takes_no_note_reaches_the_caller_as_itself() -> None:
    # Its notes a tuple: adding one raises TypeError, which must not replace it.
    error = KeyError("boom")
    error.__notes__ = ("its own",)  # type: ignore[attr-defined]
    model = GPipe(nn.Sequential(nn.Identity(), Fail(error, on=1)), [1, 1], chunks=2)
    with pytest.raises(KeyError, match="boom") as info:
        model(indexed_input(2))
    assert info.value is error
    assert error.__notes__ == ("its own",)  # type: ignore[attr-defined]
    assert_workers_idle_and_alive(model, 2)


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
def test_backward_exception_reaches_caller(checkpoint: str, backward_by: str) -> None:
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


def test_a_checkpointed_backward_error_names_its_cell(backward_by: str) -> None:
    # In the engine's way, only a checkpointed cell's backward is ours to name.
    model = GPipe(
        nn.Sequential(nn.Linear(3, 3), FailingBackward(), nn.Linear(3, 1)),
        [1, 2],
        chunks=3,
        checkpoint="always",
    )
    with pytest.raises(ArithmeticError, match="in backward") as info:
        model(torch.randn(6, 3)).sum().backward()
    assert any("torchgpipe: raised in 1B" in note for note in info.value.__notes__)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_frozen_model_gives_outputs_that_want_no_gradient(
    checkpoint: str, backward_by: str
) -> None:
    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).requires_grad_(False)
    model = GPipe(plain, [1, 1], chunks=3, checkpoint=checkpoint)
    assert not model(torch.randn(6, 3)).requires_grad  # as plain(x)'s


class SeesRequiresGrad(nn.Module):
    """Records whether each input it is given wants a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return x


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_partition_input_wants_a_gradient_as_the_plain_models_does(
    checkpoint: str, backward_by: str
) -> None:
    # The ordering edge between a partition's cells must not make an input that wants no
    # gradient (after a parameter-free first partition) want one.
    probe = SeesRequiresGrad()
    layers = nn.Sequential(nn.Identity(), probe, nn.Linear(4, 4))
    model = GPipe(layers, [1, 2], chunks=4, checkpoint=checkpoint)
    model(torch.randn(8, 4)).sum().backward()
    assert probe.seen[-4:] == [False] * 4  # the last forward of each micro-batch


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
def test_backward_failure_on_one_micro_batch_then_success(
    checkpoint: str, backward_by: str
) -> None:
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
    model = GPipe(nn.Sequential(*(nn.Linear(2, 2) for _ in range(3))), [1, 1, 1], chunks=2)
    model(torch.randn(4, 2)).sum().backward()
    threads = model.workers.pool.threads  # type: ignore[union-attr]
    assert len(threads) == 3
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


class _WaitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Callable[[int], None]) -> torch.Tensor:
        ctx.hook, ctx.i = hook, int(x[0, 0])
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.hook(ctx.i)
        return grad, None


class WaitInBackward(nn.Module):
    """Calls ``hook(i)`` in the backward of micro-batch ``i`` (read from the input)."""

    def __init__(self, hook: Callable[[int], None]) -> None:
        super().__init__()
        self.hook = hook
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WaitInBackward.apply(x * self.scale, self.hook)  # type: ignore[no-any-return,no-untyped-call]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_cpu_partitions_run_their_backward_at_the_same_time(checkpoint: str) -> None:
    # The backward goes from the last micro-batch to the first: partition 1's backward of
    # micro-batch 1 shares a tick with partition 0's of micro-batch 2. Each waits at a
    # barrier for the other, which passes only if the two run at the same time, as the
    # forward's cells do; the engine alone would run them one after the other.
    barrier = threading.Barrier(2, timeout=10)
    threads: dict[int, str] = {}

    def hook(j: int, i: int) -> None:
        threads[j] = threading.current_thread().name
        if (j, i) in ((0, 2), (1, 1)):
            barrier.wait()

    model = GPipe(
        nn.Sequential(WaitInBackward(partial(hook, 0)), WaitInBackward(partial(hook, 1))),
        [1, 1],
        chunks=3,
        checkpoint=checkpoint,
    )
    model(indexed_input(3)).sum().backward()
    assert not barrier.broken
    # The caller's thread runs the first partition, a worker the other.
    assert threads == {0: threading.current_thread().name, 1: "torchgpipe-worker-1"}
    assert model[0].scale.grad is not None
    assert model[1].scale.grad is not None


def test_a_second_backward_through_cpu_partitions_says_what_to_do() -> None:
    model = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), [1, 1], chunks=2)
    loss = model(torch.randn(4, 3)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"ran twice.*Run the forward again"):
        loss.backward()


def test_autograd_grad_of_the_input_through_cpu_partitions(backward_by: str) -> None:
    layers = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain = copy.deepcopy(layers)
    model = GPipe(layers, [2, 1], chunks=3)
    x = torch.randn(6, 3, requires_grad=True)
    (got,) = torch.autograd.grad(model(x).square().sum(), x)
    (expected,) = torch.autograd.grad(plain(x).square().sum(), x)
    torch.testing.assert_close(got, expected)
    assert all(p.grad is None for p in model.parameters())  # as the plain model leaves them


def test_outputs_that_need_no_grad_stay_so_and_integer_outputs_pass() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x, x.detach() * 2, x.argmax(dim=1)

    # (A checkpointed cell cannot tell: its forward records no graph.)
    model = GPipe(nn.Sequential(nn.Linear(3, 3), Split()), [1, 1], chunks=2, checkpoint="never")
    out, frozen, index = model(torch.randn(4, 3))
    assert out.requires_grad
    assert not frozen.requires_grad
    assert not index.requires_grad
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_inference_mode_reaches_every_partition() -> None:
    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    plain = copy.deepcopy(layers)
    model = GPipe(layers, [1, 2], chunks=2).eval()
    x = torch.randn(4, 4)
    with torch.inference_mode():
        out = model(x)  # partition 1 changes partition 0's output in place
        assert out.is_inference()
        torch.testing.assert_close(out, plain(x))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_inference_mode_with_grad_enabled_records_nothing_as_the_plain_model(
    training: bool, checkpoint: str
) -> None:
    # Regression: enable_grad() inside inference_mode() made the pipeline build a graph
    # per stage, and partition 1 tried to save partition 0's inference tensors for a
    # backward ("Inference tensors cannot be saved for backward"); the plain model runs.
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plain = copy.deepcopy(layers).train(training)
    model = GPipe(layers, [2, 1], chunks=2, checkpoint=checkpoint).train(training)  # type: ignore[arg-type]
    x = torch.randn(4, 4)
    with torch.inference_mode(), torch.enable_grad():
        expected, out = plain(x), model(x)
    assert out.is_inference()
    assert not out.requires_grad
    assert expected.is_inference()
    assert not expected.requires_grad
    torch.testing.assert_close(out, expected)


class WhereAmI(nn.Module):
    def __init__(self, seen: dict[int, str], j: int) -> None:
        super().__init__()
        self.seen, self.j = seen, j

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[self.j] = threading.current_thread().name
        return x


def test_a_caller_with_a_torch_mode_on_runs_every_partition_on_a_worker() -> None:
    # A mode on the caller's thread would reach the first partition alone if the caller
    # ran it: then every partition runs on a worker, alike.
    seen: dict[int, str] = {}
    model = GPipe(nn.Sequential(WhereAmI(seen, 0), WhereAmI(seen, 1)), [1, 1], chunks=2)
    model(torch.randn(4, 2))
    assert seen == {0: threading.current_thread().name, 1: "torchgpipe-worker-1"}
    with torch.device("cpu"):  # a torch function mode
        model(torch.randn(4, 2))
    assert seen == {0: "torchgpipe-worker-0", 1: "torchgpipe-worker-1"}
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks
        model(torch.randn(4, 2))
    assert seen == {0: "torchgpipe-worker-0", 1: "torchgpipe-worker-1"}


def test_a_gradient_of_a_gradient_through_cpu_partitions_says_what_to_do() -> None:
    model = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)), [2, 1], chunks=2)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*gradient penalty"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def test_a_cpu_partition_that_returns_another_device_is_refused() -> None:
    class Away(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to("meta")

    model = GPipe(nn.Sequential(nn.Linear(3, 3), Away()), [1, 1], chunks=2)
    with pytest.raises(RuntimeError, match=r"returned tensors on \['meta'\]"):
        model(torch.randn(4, 3))


def test_a_failed_backward_lets_go_of_the_activations_at_once() -> None:
    # The exception's traceback holds the run; the cells it ran must not wait for the
    # cycle collector to free what they kept.
    kept: list[weakref.ref[torch.Tensor]] = []

    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            kept.append(weakref.ref(y))
            return y

    model = GPipe(
        nn.Sequential(nn.Linear(3, 3), Keep(), FailingBackward(), nn.Linear(3, 1)),
        [2, 2],
        chunks=2,
        checkpoint="never",
    )
    gc.disable()
    try:
        with pytest.raises(ArithmeticError, match="in backward") as info:
            model(torch.randn(4, 3)).sum().backward()
        assert kept
        assert all(ref() is None for ref in kept), "activations outlived the failed step"
        del info
    finally:
        gc.enable()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_gradient_penalty_through_a_checkpointed_cell_is_refused(
    checkpoint: str, backward_by: str
) -> None:
    # Either way: the recomputed graph is not differentiable again, and silently
    # first-order gradients would be wrong ones.
    model = GPipe(
        nn.Sequential(nn.Linear(3, 3), nn.Tanh()), [1, 1], chunks=2, checkpoint=checkpoint
    )
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def _assert_same_grads(model: nn.Module, plain: nn.Module) -> None:
    plain_grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        q = plain_grads[name]
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad)


def test_a_backward_refused_for_create_graph_may_be_tried_again() -> None:
    # The refusal comes before anything changed: the same loss's plain backward, as the
    # message advises, runs the stages and gives the plain model's gradients.
    plain = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    x = torch.randn(4, 3, requires_grad=True)
    loss = model(x).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*gradient penalty"):
        torch.autograd.grad(loss, x, create_graph=True)
    loss.backward()
    plain(x.detach()).sum().backward()
    _assert_same_grads(model, plain)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_batched_gradients_through_cpu_partitions_are_refused_and_may_be_tried_again(
    checkpoint: str,
) -> None:
    # They reached the partitions' threads, out of the vmap's reach, and failed there
    # with "Batching rule not implemented for aten::detach".
    plain = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 3, requires_grad=True)
    output, rows = model(x), torch.eye(2).unsqueeze(1).expand(2, 4, 2)
    with pytest.raises(NotImplementedError, match=r"batched gradients.*Nothing has changed"):
        torch.autograd.grad(output, x, rows, is_grads_batched=True)
    with pytest.raises(NotImplementedError, match="batched gradients"):
        torch.autograd.functional.jacobian(model, x.detach(), vectorize=True)
    (got,) = torch.autograd.grad(output, x, rows[0])  # one gradient: the stages run
    (expected,) = torch.autograd.grad(plain(x), x, rows[0])
    torch.testing.assert_close(got, expected)


class _ToNested(nn.Module):
    """(B, T, D) padded and the lengths -> a nested tensor of the rows, jagged or strided."""

    def __init__(self, jagged: bool) -> None:
        super().__init__()
        self.jagged, self.linear = jagged, nn.Linear(4, 4)

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        x, lengths = value
        rows = [row[: int(n)] for row, n in zip(self.linear(x), lengths, strict=True)]
        layout = torch.jagged if self.jagged else torch.strided
        return torch.nested.as_nested_tensor(rows, layout=layout)


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, nested: Tensor) -> Tensor:
        return torch.stack([row.sum(0) for row in self.linear(nested).unbind()])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("jagged", [True, False])
def test_a_nested_tensor_between_partitions_runs_or_is_refused_saying_why(
    checkpoint: str, jagged: bool, backward_by: str
) -> None:
    # Jagged: a checkpointed cell's backward failed on a shape mismatch of torch's words
    # (its recomputation made a new jagged dimension); strided: "NestedTensorImpl doesn't
    # support sizes. Please file an issue", in every mode.
    plain = nn.Sequential(_ToNested(jagged), _Pool())
    x, lengths = torch.randn(4, 3, 4), torch.tensor([1, 3, 2, 2])
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    with torch.no_grad():  # no graph: nothing aliased nor recomputed, both pass
        torch.testing.assert_close(model((x, lengths)), plain((x, lengths)))
    if not jagged or checkpoint != "never":
        why = "jagged nested tensor reached a checkpointed" if jagged else "strided layout"
        with pytest.raises(TypeError, match=why):
            model((x, lengths))
        return
    model((x, lengths)).sum().backward()
    plain((x, lengths)).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@skippable(stash=["rows"])
class _StashRows(nn.Module):
    def forward(self, value: tuple[Tensor, Tensor]) -> Any:
        x, lengths = value
        rows = [row[: int(n)] for row, n in zip(x, lengths, strict=True)]
        yield stash("rows", torch.nested.as_nested_tensor(rows, layout=torch.jagged))
        return x


@skippable(pop=["rows"])
class _PopRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Any:
        rows = yield pop("rows")
        return self.linear(x).sum(1) + torch.stack([row.sum(0) for row in rows.unbind()])


def test_a_jagged_skip_passes_where_nothing_is_recomputed(backward_by: str) -> None:
    # Its version was read through its storage, which a nested tensor has none of.
    plain = nn.Sequential(_StashRows(), nn.Identity(), _PopRows())
    model = GPipe(copy.deepcopy(plain), [1, 1, 1], chunks=2, checkpoint="never")
    lengths = torch.tensor([1, 3, 2, 2])
    x, y = (torch.randn(4, 3, 4).requires_grad_() for _ in range(2))
    with torch.no_grad():
        y.copy_(x)
    model((x, lengths)).sum().backward()
    plain((y, lengths)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


class _Doubling(torch.Tensor):
    """A subclass whose ``__torch_function__`` doubles what F.linear gives."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.nn.functional.linear else out


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_tensor_subclass_is_seen_alike_by_a_cell_and_its_recomputation(
    checkpoint: str, backward_by: str
) -> None:
    # The subclass's backward runs the engine with subclasses' __torch_function__ off:
    # the first partition, recomputed on the caller's thread, saw a plain tensor there
    # and the gradients were silently wrong.
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    data = torch.randn(6, 4)
    grads = []
    for model in (plain, GPipe(copy.deepcopy(plain), [2, 1], chunks=2, checkpoint=checkpoint)):  # type: ignore[arg-type]
        x = data.clone().as_subclass(_Doubling).requires_grad_()
        model(x).pow(2).sum().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
        with torch._C.DisableTorchFunctionSubclass():  # a caller's own state, as it is
            grads.append([model(data.as_subclass(_Doubling)).detach()])
    for ours, expected in zip(grads[2:], grads[:2], strict=True):
        for a, b in zip(ours, expected, strict=True):
            torch.testing.assert_close(a, b)


def test_a_backward_refused_for_one_copy_of_a_tied_weight_may_be_tried_again() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plain[2].weight = plain[0].weight  # tied across the partitions
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    x = torch.randn(4, 4)
    loss = model(x).sum()
    with pytest.raises(RuntimeError, match="names some copies of a tied weight"):
        loss.backward(inputs=[model[0].weight])
    loss.backward()  # every copy named by naming none, as the message advises
    plain(x).sum().backward()
    for j in (0, 2):  # each copy holds the tied weight's whole gradient
        torch.testing.assert_close(model[j].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(model[0].bias.grad, plain[0].bias.grad)
    torch.testing.assert_close(model[2].bias.grad, plain[2].bias.grad)


class _HiddenAndFirst(nn.Module):
    """Hidden states and a view of them: the first position (a CLS token, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.linear(x)
        return h, h[:, 0]


class _ReadsFirst(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))
        self.in_place = in_place

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        h, first = pair
        if self.in_place:
            h.add_(self.bias)  # changes `first` too, in the plain model and here
        else:
            h = h + self.bias
        return first * 2 + h.sum(1)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_view_passed_with_its_tensor_and_left_alone_keeps_the_plain_gradients(
    checkpoint: str, backward_by: str
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_HiddenAndFirst(), _ReadsFirst(in_place=False))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 3, 4)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_same_grads(model, plain)


def test_a_view_passed_with_its_tensor_may_change_in_place_under_no_grad() -> None:
    # Nothing is cut from a graph there: the tensors go on as they are, as in the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(_HiddenAndFirst(), _ReadsFirst(in_place=True))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2)
    x = torch.randn(4, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))


class _QueryKey(nn.Module):
    """Two slices of one tensor, each skipping the other's elements (attention's q, k)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.linear(x)
        return h[..., :4], h[..., 4:]


class _ScalesQuery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        q, k = pair
        q.mul_(0.5)  # q *= scale: k's elements are not q's
        return self.linear(q) * k


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_slices_that_lie_apart_may_change_in_place(checkpoint: str, backward_by: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_QueryKey(), _ScalesQuery())
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_same_grads(model, plain)


def test_one_micro_batch_on_the_engines_way_leaves_views_to_autograd() -> None:
    # Nothing is cut there (no phony joins a single micro-batch): as the plain model.
    from torchgpipe import pipeline

    torch.manual_seed(0)
    plain = nn.Sequential(_HiddenAndFirst(), _ReadsFirst(in_place=True))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=1, checkpoint="never")
    x = torch.randn(4, 3, 4)
    plain(x).square().sum().backward()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "workers_run_backward", lambda devices: False)
        model(x).square().sum().backward()
    assert_same_grads(model, plain)


class _Fails(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ArithmeticError("layer failed")


@pytest.mark.parametrize("grad", [True, False])
def test_a_failed_forward_still_makes_the_callers_streams_wait(
    grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU the partitions' streams may still run kernels the failed run queued
    # (a batch norm's statistics): the caller, who may load a checkpoint next, must
    # wait for them. The wait (hand_over) was skipped when the forward raised.
    from torchgpipe.executor import StepRun

    handed: list[bool] = []
    original = StepRun.hand_over
    monkeypatch.setattr(StepRun, "hand_over", lambda run: handed.append(True) or original(run))
    model = GPipe(nn.Sequential(nn.Linear(2, 2), _Fails()), [1, 1], chunks=2)
    with torch.set_grad_enabled(grad), pytest.raises(ArithmeticError, match="layer failed"):
        model(torch.randn(4, 2))
    assert handed == [True]


class _Symmetric(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return (w + w.T) / 2


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_parametrize_cached_is_refused_where_graphs_are_recorded(checkpoint: str) -> None:
    # Its cache is every thread's: a checkpointed forward left the weight there without
    # a graph, and the other cells' gradients missed it (None, or off by 4 %); without
    # checkpointing, the second micro-batch's backward met the first's freed graph.
    from torch.nn.utils import parametrize

    layer = nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", _Symmetric())
    plain = nn.Sequential(layer, nn.Tanh(), nn.Linear(3, 3))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 3)
    with parametrize.cached():
        with pytest.raises(RuntimeError, match=r"parametrize.cached\(\) is on"):
            model(x).sum().backward()
        with torch.no_grad():  # inference keeps it
            torch.testing.assert_close(model(x), plain(x))
    model(x).sum().backward()  # outside cached(), as ever
    plain(x).sum().backward()
    assert_same_grads(model, plain)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failed_call_leaves_nothing_for_the_collector(where: str) -> None:
    # The exception's frames held the step, and the step's record of failures the
    # exception: the failed batch and activations stayed until the collector ran (36
    # to 68 MiB per failure in the review's loop that skips batches that fail).
    layers = [nn.Linear(4, 4), _Fails() if where == "forward" else _FailsBackward()]
    model = GPipe(nn.Sequential(*layers), [1, 1], chunks=2)

    def fail() -> None:
        with contextlib.suppress(ArithmeticError):  # the exception dropped at once
            model(torch.randn(4, 4, requires_grad=True)).sum().backward()

    fail()  # the first call makes what is kept from call to call
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            fail()
        assert gc.collect() == 0
    finally:
        gc.enable()


class _FailsBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return BackwardFails.apply(x)  # type: ignore[no-any-return]
