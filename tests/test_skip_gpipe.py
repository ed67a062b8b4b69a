"""Skips inside GPipe: one copy, straight to the popping partition, and nothing left over."""

import copy
import gc
import io
import threading
import weakref
from typing import Any

import pytest
import torch
from helpers import PopAdd, PopAddFailingOnce, ScaleInPlace, StashLinear, assert_same_grads
from torch import Tensor, nn

import torchgpipe.executor
from torchgpipe import GPipe, is_recomputing
from torchgpipe.microbatch import flatten
from torchgpipe.skip import Namespace, SkipError, pop, skippable, stash
from torchgpipe.training import Schedule1F1B, ScheduleGPipe

MARK = 1234.5


@skippable(stash=["skip"])
class StashMark(nn.Module):
    """Stashes a tensor full of MARK, so that the copies of it can be told apart."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", torch.full_like(x, MARK))
        return x + 1


@skippable(pop=["skip"])
class PopMark(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        assert torch.all(skip == MARK)
        return x * 2


class Moves:
    """Records, for every move into a partition, how many skip copies it carried."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (thread, skips, other tensors)
        real = torchgpipe.executor.move

        def spy(value: Any, *args: Any, **kwargs: Any) -> Any:
            tensors = [x for x in flatten(value)[0] if isinstance(x, Tensor)]
            skips = sum(bool(torch.all(x == MARK)) for x in tensors)
            self.calls.append((threading.current_thread().name, skips, len(tensors) - skips))
            return real(value, *args, **kwargs)

        monkeypatch.setattr(torchgpipe.executor, "move", spy)

    def skips_into(self, j: int) -> int:
        # The caller's thread runs partition 0, worker j partition j.
        thread = "MainThread" if j == 0 else f"torchgpipe-worker-{j}"
        return sum(s for name, s, _ in self.calls if name == thread)


def _residual_block() -> nn.Sequential:
    return nn.Sequential(StashLinear(), nn.Tanh(), PopAdd())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("how", ["model(x)", "1f1b"])
def test_a_block_that_stashes_and_pops_one_name_may_be_used_again(
    checkpoint: str, how: str
) -> None:
    # Refused: "'skip' is stashed by layer 0.0 and 1.0"; torchgpipe 0.0.7 ran it.
    torch.manual_seed(0)
    plain = nn.Sequential(_residual_block(), _residual_block(), _residual_block(), nn.Linear(4, 2))
    plain = plain.double()
    model = GPipe(copy.deepcopy(plain), [1, 2, 1], chunks=2, checkpoint=checkpoint)
    assert all(not route.crosses for route in model.skip_layout.routes)
    x = torch.randn(4, 4, dtype=torch.float64)
    if how == "model(x)":
        output = model(x)
        output.square().mean().backward()
        torch.testing.assert_close(output, plain(x))
    else:
        Schedule1F1B(model, lambda y, t: y.square().mean()).step(x, torch.zeros(4, 2))
    plain(x).square().mean().backward()
    assert_same_grads(model, plain)


class _ResidualBlock(nn.Module):
    """The block as a class of its own: the order of its calls is its forward's."""

    def __init__(self) -> None:
        super().__init__()
        self.keep, self.add = StashLinear(), PopAdd()

    def forward(self, x: Tensor) -> Tensor:
        return self.add(torch.tanh(self.keep(x)))  # type: ignore[no-any-return]


def test_a_block_class_that_stashes_and_pops_one_name_may_be_used_again() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_ResidualBlock(), _ResidualBlock(), nn.Linear(4, 2)).double()
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint="always")
    x = torch.randn(4, 4, dtype=torch.float64)
    model(x).square().mean().backward()
    plain(x).square().mean().backward()
    assert_same_grads(model, plain)


class _BodyBlock(nn.Module):
    """The stash inside a Sequential of the block, the pop beside it: their order is the
    block's forward's, which the check cannot see (the pop's place sorted first)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(StashLinear(), nn.Tanh())
        self.add = PopAdd()

    def forward(self, x: Tensor) -> Tensor:
        return self.add(self.body(x))  # type: ignore[no-any-return]


def test_a_block_whose_stash_is_inside_a_sequential_may_be_used_again() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_BodyBlock(), _BodyBlock(), nn.Linear(4, 2)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2)
    x = torch.randn(4, 4, dtype=torch.float64)
    model(x).square().mean().backward()
    plain(x).square().mean().backward()
    assert_same_grads(model, plain)


def test_a_name_stashed_in_one_layer_and_popped_in_the_next_is_still_refused_twice() -> None:
    # The pairs must stay inside their layers: here the skip would cross partitions.
    layers = [StashLinear(), PopAdd(), StashLinear(), PopAdd()]
    twice = r"'skip' is stashed by layer 0 \(StashLinear\) and layer 2"
    with pytest.raises(TypeError, match=twice):
        GPipe(nn.Sequential(*layers), [2, 2])


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_skip_is_copied_once_straight_to_the_popping_partition(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str
) -> None:
    n, m = 5, 4
    layers = [StashMark(), *[nn.Identity() for _ in range(n - 2)], PopMark()]
    model = GPipe(nn.Sequential(*layers), [1] * n, chunks=m, checkpoint=checkpoint)
    moves = Moves(monkeypatch)
    out = model(torch.zeros(m, 3, requires_grad=True))
    torch.testing.assert_close(out, torch.full((m, 3), 2.0))
    out.sum().backward()  # recomputing the stashing cells must not send the skip again
    assert moves.skips_into(n - 1) == m  # one copy per micro-batch, into the last partition
    assert all(moves.skips_into(j) == 0 for j in range(n - 1))  # the others never see it


class Counting(nn.Module):
    """Stashes x times the number of forward calls so far, so a second stash would differ."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        self.calls += 1
        yield stash("skip", x * self.calls)
        return x


class Remember(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.popped: list[tuple[bool, Tensor]] = []

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        self.popped.append((is_recomputing(), skip.detach().clone()))
        return x + skip


CountingStash = skippable(stash=["skip"])(Counting)
RememberPop = skippable(pop=["skip"])(Remember)


@skippable(stash=["skip"])
class StashOutput(nn.Module):
    """A linear map, which it returns and stashes as 'skip' (one tensor, two ways).

    With ``part``, it stashes the first ``part`` features only: a slice of its output.
    """

    def __init__(self, part: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.part = part

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x)
        yield stash("skip", y if self.part is None else y[:, : self.part])
        return y


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("inplace", [True, False])
def test_a_skip_changed_in_place_on_its_way_is_refused(
    inplace: bool, checkpoint: str, backward_by: str
) -> None:
    # The ReLU's partition changes the stashed tensor in place: the pop would get its
    # values without the gradient's way through them (a silently wrong gradient).
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), nn.ReLU(inplace=inplace), nn.Linear(4, 4), PopAdd())
    model = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 4, requires_grad=True)
    if inplace:
        with pytest.raises(RuntimeError, match=r"skip 'skip' of micro-batch 0 was changed in"):
            model(x)
        return
    model(x).square().sum().backward()
    y = x.detach().clone().requires_grad_()
    plain(y).square().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert_same_grads(model, plain)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_skipped_micro_batch_is_not_refused_for_another_changed_in_place(
    checkpoint: str, backward_by: str
) -> None:
    # The stashed inputs are slices of one batch, sharing its version: the in-place
    # ReLU on the next micro-batch moves it, but changes nothing this skip holds.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.ReLU(inplace=True), StashLinear(), nn.Linear(4, 4), PopAdd())
    model = GPipe(copy.deepcopy(plain), [2, 1, 1], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    model(x.clone()).square().sum().backward()
    plain(x.clone()).square().sum().backward()
    assert_same_grads(model, plain)


def test_a_skip_changed_in_place_within_its_own_partition_is_fine() -> None:
    # Stash and pop in one partition: autograd sees the change, as in the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), nn.ReLU(inplace=True), nn.Linear(4, 4), PopAdd())
    model = GPipe(copy.deepcopy(plain), [4], chunks=2)
    x = torch.randn(4, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_same_grads(model, plain)


def test_recomputation_pops_what_the_forward_popped() -> None:
    stasher, popper = CountingStash(), RememberPop()
    model = GPipe(nn.Sequential(stasher, nn.Identity(), popper), [1, 1, 1], chunks=2)
    x = torch.ones(2, 2, requires_grad=True)
    model(x).sum().backward()
    forward = [t for recomputing, t in popper.popped if not recomputing]
    recomputed = [t for recomputing, t in popper.popped if recomputing]
    assert len(forward) == 2
    assert len(recomputed) == 1
    # Micro-batch 0 was stashed with calls == 1. Its recomputation (after micro-batch 1's
    # forward, and after the stashing cell recomputed) must still see calls == 1.
    torch.testing.assert_close(recomputed[0], forward[0])
    torch.testing.assert_close(forward[0], torch.ones(1, 2))
    assert x.grad is not None
    # Micro-batch 1 was not checkpointed: d/dx (x + 2 * x). (Micro-batch 0's gradient
    # comes from the stashing layer's recomputation, where this impure layer's counter
    # has moved on: layers with side effects should check is_recomputing().)
    torch.testing.assert_close(x.grad[1], torch.tensor([3.0, 3.0]))


@skippable(stash=["skip"])
class StashWatched(nn.Module):
    def __init__(self, refs: list[weakref.ref[Tensor]]) -> None:
        super().__init__()
        self.refs = refs
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        h = self.linear(x)
        self.refs.append(weakref.ref(h))
        yield stash("skip", h)
        return torch.relu(h)


@skippable(pop=["skip"])
class PopWatched(nn.Module):
    def __init__(self, refs: list[weakref.ref[Tensor]]) -> None:
        super().__init__()
        self.refs = refs

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        self.refs.append(weakref.ref(skip))
        return x * skip


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_nothing_of_a_skip_is_left_after_backward(checkpoint: str) -> None:
    refs: list[weakref.ref[Tensor]] = []
    layers = [StashWatched(refs), nn.Linear(4, 4), nn.Linear(4, 4), PopWatched(refs)]
    model = GPipe(nn.Sequential(*layers), [1, 1, 1, 1], chunks=4, checkpoint=checkpoint)
    for _ in range(5):
        out = model(torch.randn(8, 4))
        out.sum().backward()
        del out
        gc.collect()
        assert refs, "the layers ran"
        assert [r for r in refs if r() is not None] == []  # nothing piles up
        refs.clear()


@skippable(stash=["maybe"])
class StashNone(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("maybe", None)
        return x


@skippable(pop=["maybe"])
class PopNone(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        value = yield pop("maybe")
        return x if value is None else x * 0


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_none_crosses_partitions(checkpoint: str) -> None:
    model = GPipe(
        nn.Sequential(StashNone(), nn.Linear(2, 2), PopNone()), [1, 1, 1], chunks=2,
        checkpoint=checkpoint,
    )  # fmt: skip
    x = torch.randn(4, 2)
    torch.testing.assert_close(model(x), model[1](x))
    model(x).sum().backward()


@skippable(stash=["skip"])
class StashString(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", "not a tensor")
        return x


def test_misuse_inside_gpipe_reaches_the_caller_and_the_next_call_works() -> None:
    model = GPipe(nn.Sequential(StashString(), PopMark()), [1, 1], chunks=2)
    with pytest.raises(TypeError, match=r"StashString\.forward stashed str as skip 'skip'") as info:
        model(torch.zeros(2, 1))
    assert any("partition 0" in note for note in getattr(info.value, "__notes__", []))
    good = GPipe(nn.Sequential(StashMark(), PopMark()), [1, 1], chunks=2)
    torch.testing.assert_close(good(torch.zeros(2, 1)), torch.full((2, 1), 2.0))


@skippable(stash=["skip"])
class StashUndeclared(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        yield stash("other", x)
        return x


def test_skip_misuse_inside_gpipe_is_caught_as_runtime_error() -> None:
    # torchgpipe 0.0.7 raised RuntimeError here; SkipError is one (and a ValueError).
    model = GPipe(nn.Sequential(StashUndeclared(), PopMark()), [1, 1], chunks=2)
    with pytest.raises(RuntimeError, match=r"yielded stash\('other'\) but") as info:
        model(torch.zeros(2, 1))
    assert isinstance(info.value, SkipError)


@skippable()
class Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


def test_a_skippable_that_returns_directly_runs_in_gpipe() -> None:
    model = GPipe(nn.Sequential(StashMark(), Double(), PopMark()), [1, 1, 1], chunks=2)
    torch.testing.assert_close(model(torch.zeros(2, 1)), torch.full((2, 1), 4.0))


@pytest.mark.cuda
def test_skips_between_cuda_partitions_match_cpu() -> None:
    # The skip is copied on the popping partition's copy stream after waiting for the
    # stashing partition's compute stream; the values and gradients show it arrived.
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", j % count) for j in range(3)]
    layers = [StashWatched([]), nn.Linear(4, 4), PopWatched([])]
    plain = nn.Sequential(*layers)
    model = GPipe(copy.deepcopy(plain), [1, 1, 1], devices=devices, chunks=4)
    x = torch.randn(8, 4)
    out = model(x.to(devices[0]))
    expected = plain(x)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isolated", [False, True])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_a_gpipe_with_skips_work(isolated: bool, how: str) -> None:
    # Skips in the global namespace once broke in a copy: the copied layout had a new
    # global namespace that the copied layers did not use.
    stasher, popper = StashLinear(3), PopAdd()
    if isolated:
        ns = Namespace()
        stasher.isolate(ns)
        popper.isolate(ns)
    model = GPipe(nn.Sequential(stasher, nn.Linear(3, 3), popper), [1, 1, 1], chunks=2)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 3)
    torch.testing.assert_close(copied(x), model(x))
    assert [r.crosses for r in copied.skip_layout.routes] == [True]


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_a_skip_that_is_the_output_itself_in_the_callers_graph_is_not_refused(
    checkpoint: str, engine_backward: None
) -> None:
    # One micro-batch on the engine's way: the cell hands on the very tensor it stashed,
    # and autograd sees the in-place change, as in the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), nn.ReLU(inplace=True), nn.Linear(4, 4), PopAdd())
    model = GPipe(copy.deepcopy(plain), [1, 1, 1, 1], chunks=1, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_same_grads(model, plain)


@skippable(pop=["skip"])
class _PopPadded(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + torch.cat([skip, skip], dim=1)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("inplace", [True, False])
def test_a_skip_that_is_the_input_changed_in_place_before_its_pop_matches_the_plain_model(
    inplace: bool, checkpoint: str, chunks: int, backward_by: str
) -> None:
    # The ReLU in the popping partition, right after the cut, changes its input in place,
    # which is the skip too: one tensor handed on both ways, as in the plain model (at
    # first two, the pop got the new values without the gradient through them; then
    # refused on the workers' way).
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), nn.ReLU(inplace=inplace), PopAdd())
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=chunks, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    assert_same_grads(model, plain)


@skippable(stash=["skip"])
class _FrozenStashOutput(nn.Module):
    """A frozen linear map, which it returns and stashes: no gradient wanted by either."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x)
        yield stash("skip", y)
        return y


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("engine", [False, True])
def test_a_frozen_skip_given_a_gradient_in_place_before_its_pop_does_not_break(
    engine: bool, checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression of the first check at the pop: the change in place made the skip want a
    # gradient between the cell's start and the pop, so the two lists of versions had
    # different lengths and the pop failed with zip()'s ValueError. (Not checkpointed,
    # on the workers, the pop missed that gradient while the input and the skip went on
    # as two tensors.)
    if engine:
        from torchgpipe import pipeline

        monkeypatch.setattr(pipeline, "workers_run_backward", lambda devices: False)
    torch.manual_seed(0)
    plain = nn.Sequential(_FrozenStashOutput(), ScaleInPlace(), PopAdd())
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=1, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model[1].w.grad, plain[1].w.grad)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_frozen_model_changing_a_skip_in_place_before_its_pop_is_not_refused(
    checkpoint: str, backward_by: str
) -> None:
    # Checkpointed, but nothing wants a gradient: no recomputation will pop the skip
    # again, so the change loses nothing (refused at first, wrongly).
    plain = nn.Sequential(
        _FrozenStashOutput(), nn.Identity(), nn.ReLU(inplace=True), PopAdd(), nn.Linear(4, 4)
    ).requires_grad_(False)
    model = GPipe(copy.deepcopy(plain), [1, 1, 3], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    torch.testing.assert_close(model(x), plain(x))


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("balance", [[1, 3], [1, 2, 1]])
@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_a_step_judges_a_pop_only_where_its_cell_is_recomputed(
    schedule: Any, balance: list[int], trained: bool
) -> None:
    # A detached skip shares the memory of the output it came from, changed in place
    # before the pop. A checkpointed cell that is recomputed (for its loss, where its
    # last layer trains) would pop the values from before the change: refused (the loss
    # came out wrong where it was let through). A frozen model's cells, where nothing
    # wants a gradient, are not checkpointed: the values of the plain model's pop, in
    # model(x) (test above); its step is refused, as the plain model's backward is.
    torch.manual_seed(0)
    plain = nn.Sequential(
        _StashSliceOrDetached("detached"), nn.ReLU(inplace=True), PopAdd(), nn.Linear(4, 4)
    ).requires_grad_(False)
    plain[3].requires_grad_(trained)
    model = GPipe(copy.deepcopy(plain), balance, chunks=2, checkpoint="always")
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    step = schedule(model, nn.functional.mse_loss)
    if trained and len(balance) == 2:
        with pytest.raises(RuntimeError, match=r"skip 'skip' was changed in place before its"):
            step.step(x, target)
        return
    if not trained:
        with pytest.raises(RuntimeError, match="nothing in the step wants a gradient"):
            step.step(x, target)
        torch.testing.assert_close(model(x), plain(x))
        return
    result = step.step(x, target)
    torch.testing.assert_close(result.loss, nn.functional.mse_loss(plain(x), target))


class _HoldsWithoutCalling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stash = StashLinear()

    def forward(self, x: Tensor) -> Tensor:
        return x


def test_a_skippable_held_but_not_called_is_named_as_a_cause() -> None:
    # The message blamed only a change of names after GPipe was built.
    model = GPipe(nn.Sequential(_HoldsWithoutCalling(), PopAdd()), [1, 1], chunks=2)
    with pytest.raises(SkipError, match="a skippable module that declares them was not called"):
        model(torch.randn(4, 4))


class _RetriesAfterAnInPlaceChange(PopAddFailingOnce):
    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        try:
            return super().forward(x, fail=True)
        except RuntimeError:
            x.relu_()  # the skip shares this memory
            return super().forward(x)


@skippable(stash=["skip"])
class _StashesASideBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", self.b(x))
        return self.a(x)


@skippable(pop=["skip"])
class _DoublesItsSkipThenFailsOnce(nn.Module):
    def forward(self, x: Tensor, fail: bool = False):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        skip.mul_(2)  # on the popped skip itself: autograd follows it
        if fail:
            raise RuntimeError("once")
        return x + skip


class _Retries(_DoublesItsSkipThenFailsOnce):
    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        try:
            return super().forward(x, fail=True)
        except RuntimeError:
            return super().forward(x)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_retry_pops_what_the_failed_call_left_as_the_plain_model_does(
    checkpoint: str,
) -> None:
    # What the failed call did to the skip it popped is the plain model's too: not a
    # change before the retry's pop (refused at first, wrongly).
    torch.manual_seed(0)
    plain = nn.Sequential(_StashesASideBranch(), _Retries(), nn.Linear(4, 4))
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_same_grads(model, plain)


def test_a_skip_given_back_for_a_retry_is_checked_at_its_second_pop() -> None:
    # The first pop dropped the skip's noted versions, so the retry's pop went unchecked
    # and the gradients came out wrong. (A detached skip, apart from the input whose
    # memory it shares; a checkpointed cell, which would pop it again in recomputation.)
    model = GPipe(
        nn.Sequential(
            _StashSliceOrDetached("detached"), _RetriesAfterAnInPlaceChange(), nn.Linear(4, 4)
        ),
        [1, 2],
        checkpoint="always",
    )
    with pytest.raises(RuntimeError, match=r"skip 'skip' was changed in place before its pop"):
        model(torch.randn(8, 4))


@skippable(stash=["skip"])
class _StashSliceOrDetached(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x)
        yield stash("skip", y[:, :2] if self.how == "slice" else y.detach())
        return y


@pytest.mark.parametrize("how", ["slice", "detached"])
def test_a_skip_changed_in_place_where_the_plain_model_loses_nothing_is_not_refused(
    how: str, engine_backward: None
) -> None:
    # A view of the input (autograd follows a change to its base), or a skip detached by
    # the layer (the plain model's pop gets no gradient either), changed by an in-place
    # ReLU before the pop, one micro-batch, not checkpointed.
    torch.manual_seed(0)
    popping = _PopPadded() if how == "slice" else PopAdd()
    plain = nn.Sequential(_StashSliceOrDetached(how), nn.ReLU(inplace=True), popping)
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=1, checkpoint="never")
    x = torch.randn(8, 4)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert_same_grads(model, plain)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_a_schedule_steps_a_skip_that_is_the_input_changed_by_the_popping_stage(
    schedule: Any, checkpoint: str
) -> None:
    # One tensor handed on as the input and the skip, as in the plain model (refused once).
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), nn.ReLU(inplace=True), PopAdd())
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    result = schedule(model, nn.functional.mse_loss).step(x, target)
    loss = nn.functional.mse_loss(plain(x), target)
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach())
    assert_same_grads(model, plain)


def test_a_skip_changed_in_place_after_its_pop_is_not_refused() -> None:
    # After the pop, the change is the plain model's too: it reaches the layers after it.
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), PopAdd(), nn.ReLU(inplace=True))
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=2)
    x = torch.randn(8, 4)
    torch.testing.assert_close(model(x), plain(x))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_slice_of_a_layers_output_changed_in_place_on_its_way_is_refused(
    checkpoint: str, backward_by: str
) -> None:
    # Only slices of the step's input are left unchecked (their versions move together).
    model = GPipe(
        nn.Sequential(StashOutput(part=2), nn.ReLU(inplace=True), nn.Linear(4, 4), _PopPadded()),
        [1, 1, 1, 1],
        chunks=2,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    with pytest.raises(RuntimeError, match=r"skip 'skip' of micro-batch 0 was changed in"):
        model(torch.randn(4, 4))


def test_a_checkpointed_cell_stashing_its_output_for_one_micro_batch_is_checked(
    engine_backward: None,
) -> None:
    # One micro-batch, but checkpointed: the recomputation rebuilds the graph, which the
    # change in place is not part of, so the very tensor handed on is checked too.
    model = GPipe(
        nn.Sequential(StashOutput(), nn.ReLU(inplace=True), nn.Linear(4, 4), PopAdd()),
        [1, 1, 1, 1],
        chunks=1,
        checkpoint="always",
    )
    with pytest.raises(RuntimeError, match=r"skip 'skip' of micro-batch 0 was changed in"):
        model(torch.randn(4, 4))


@skippable(pop=["skip"])
class _PopPair(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x, skip


class _ReLUFirstThenMix(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        x, skip = pair
        x.relu_()  # the skip too: one tensor
        return x * 2 + skip * 3


@pytest.mark.parametrize("balance", [[1, 2], [1, 1, 1]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_skip_that_is_the_input_changed_in_place_after_its_pop_matches_the_plain_model(
    balance: list[int], checkpoint: str, backward_by: str
) -> None:
    # Its later uses get the new values with the gradient through them, in this stage
    # or the next (silently wrong on the workers' way while the two went on apart).
    torch.manual_seed(0)
    plain = nn.Sequential(StashOutput(), _PopPair(), _ReLUFirstThenMix())
    model = GPipe(copy.deepcopy(plain), balance, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    out = model(x)
    out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    assert_same_grads(model, plain)


@skippable(stash=["skip"])
class _FrozenScaledStash(nn.Module):
    """A frozen linear map scaled by a tensor it closes over; stashes and returns it."""

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.held = [scale]
        self.linear = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        y = self.linear(x) * self.held[0]
        yield stash("skip", y)
        return y


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_one_micro_batch_of_a_cell_that_nothing_trains_hands_its_skip_on_as_it_is(
    checkpoint: str, engine_backward: None
) -> None:
    # In the caller's graph a checkpointed cell where nothing wants a gradient is a plain
    # call, as under 'never': with one micro-batch it hands its output and skip on as one
    # tensor, changed in place by the next partition as in the plain model (refused once,
    # as if the cell had been a checkpoint node).
    scale = torch.tensor([1.5, -2.0, 0.5, 3.0], requires_grad=True)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(_FrozenScaledStash(scale), nn.ReLU(inplace=True), PopAdd())

    model = GPipe(build(), [1, 1, 1], chunks=1, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    model(x).square().sum().backward()
    got, scale.grad = scale.grad, None
    build()(x).square().sum().backward()
    assert got is not None
    torch.testing.assert_close(got, scale.grad)
