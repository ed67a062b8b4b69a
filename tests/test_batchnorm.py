"""Deferred batch norm, and plain batch norm under checkpointing."""

import copy
import math
import pickle
from typing import Any

import pytest
import torch
from helpers import Routed, assert_same_grads, routed_batch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from torchgpipe import GPipe, Schedule1F1B, ScheduleZeroBubble
from torchgpipe.batchnorm import (
    DeferredBatchNorm,
    convert_deferred_batch_norm,
    expect_micro_batches,
)
from torchgpipe.microbatch import scatter


class MyBatchNorm(nn.BatchNorm1d):
    """A user's subclass of PyTorch's batch norm."""


def _convnet(momentum: float | None = 0.1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4, momentum=momentum),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 6),
        MyBatchNorm(6, momentum=momentum),
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=momentum)),
    ).double()


def test_convert_defers_every_batch_norm_in_place() -> None:
    model = nn.Sequential(
        nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(3), MyBatchNorm(3)), nn.BatchNorm3d(3)
    ).eval()
    layers = [model[0], model[1][0], model[1][1], model[2]]
    classes = [type(m) for m in layers]
    before = dict(model.state_dict(keep_vars=True))
    converted = convert_deferred_batch_norm(model)
    assert converted == layers  # the layers themselves, not copies
    for layer, cls in zip(layers, classes, strict=True):
        assert isinstance(layer, DeferredBatchNorm)
        assert isinstance(layer, cls)
        assert type(layer).__name__ == f"Deferred{cls.__name__}"
    assert type(model[0]) is type(
        convert_deferred_batch_norm(nn.BatchNorm1d(2))[0]
    )  # one per class
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)  # the same tensors, not copies
    assert not any(m.training for m in converted)


def _inputs_seen(model: nn.Module) -> dict[str, list[Tensor]]:
    """Records the input of every deferred layer in forward (not in recomputation)."""
    from torchgpipe import is_recomputing

    seen: dict[str, list[Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, DeferredBatchNorm):
            seen[name] = []

            def hook(module: nn.Module, args: tuple[Tensor], name: str = name) -> None:
                if not is_recomputing():
                    seen[name].append(args[0].detach().clone())

            module.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_running_stats_are_those_of_the_whole_mini_batch(
    chunks: int, momentum: float | None, checkpoint: str
) -> None:
    model = GPipe(
        _convnet(momentum), [3, 4], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True
    )
    seen = _inputs_seen(model)
    # Plain batch norms fed what each deferred one saw, as one mini-batch per step.
    references = {
        name: copy.deepcopy(module)
        for name, module in model.named_modules()
        if isinstance(module, DeferredBatchNorm)
    }
    steps = 3
    for _ in range(steps):
        x = torch.randn(11, 3, 3, 3, dtype=torch.float64) * 3 + 5  # 11: uneven micro-batches
        model(x).sum().backward()
        for name, reference in references.items():
            batch = torch.cat(seen[name])
            seen[name].clear()
            plain = nn.BatchNorm1d(reference.num_features, momentum=momentum).double()
            plain.load_state_dict(reference.state_dict())
            plain.train()
            plain(batch if batch.dim() == 2 else batch.transpose(1, -1).reshape(-1, batch.size(1)))
            references[name] = plain  # type: ignore[assignment]
    for name, plain in references.items():
        deferred = model.get_submodule(name)
        assert isinstance(deferred, DeferredBatchNorm)
        torch.testing.assert_close(
            deferred.running_mean, plain.running_mean, rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(deferred.running_var, plain.running_var, rtol=1e-12, atol=1e-12)
        assert int(deferred.num_batches_tracked) == steps  # mini-batches, not micro-batches


@pytest.mark.parametrize("chunks", [1, 3])
def test_each_micro_batch_is_normalized_with_its_own_statistics(chunks: int) -> None:
    bn = nn.BatchNorm1d(4).double()
    model = GPipe(nn.Sequential(copy.deepcopy(bn)), [1], chunks=chunks, deferred_batch_norm=True)
    x = torch.randn(7, 4, dtype=torch.float64)
    expected = torch.cat([copy.deepcopy(bn)(piece) for piece in scatter(x, chunks)])
    torch.testing.assert_close(model(x), expected)


def test_eval_mode_uses_the_running_statistics() -> None:
    plain = _convnet()
    model = GPipe(copy.deepcopy(plain), [3, 4], chunks=3, deferred_batch_norm=True)
    for _ in range(2):
        model(torch.randn(6, 3, 3, 3, dtype=torch.float64) + 1)
    plain.load_state_dict(model.state_dict())  # the keys are the plain model's
    model.eval()
    plain.eval()
    x = torch.randn(5, 3, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_without_deferral_each_micro_batch_updates_once(checkpoint: str) -> None:
    bn = nn.BatchNorm1d(4).double()
    reference = copy.deepcopy(bn)
    model = GPipe(nn.Sequential(nn.Identity(), bn), [1, 1], chunks=3, checkpoint=checkpoint)
    for _ in range(2):
        x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
        model(x).square().sum().backward()  # recomputation must not update a second time
        for piece in scatter(x.detach(), 3):
            reference(piece)
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert int(bn.num_batches_tracked) == 6


def test_a_failed_forward_leaves_no_partial_statistics() -> None:
    class FailOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fail = True

        def forward(self, x: Tensor) -> Tensor:
            if self.fail:
                self.fail = False
                raise ArithmeticError("once")
            return x

    bn = nn.BatchNorm1d(2).double()
    reference = copy.deepcopy(bn)
    model = GPipe(nn.Sequential(bn, FailOnce()), [1, 1], chunks=2, deferred_batch_norm=True)
    with pytest.raises(ArithmeticError):
        model(torch.randn(4, 2, dtype=torch.float64))
    x = torch.randn(4, 2, dtype=torch.float64)
    model(x)
    reference(x)
    deferred = model[0]
    assert isinstance(deferred, DeferredBatchNorm)
    # The failed call's micro-batches updated the statistics (the mini-batch was seen),
    # and nothing of it leaks into the next mini-batch's average.
    assert int(deferred.num_batches_tracked) in (1, 2)
    assert not deferred._deferred_tally.moments


def test_deferred_batch_norm_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="deferred_batch_norm must be a bool, got 'yes'"):
        GPipe(nn.Sequential(nn.BatchNorm1d(2)), [1], deferred_batch_norm="yes")  # type: ignore[arg-type]


@pytest.mark.cuda
def test_deferred_batch_norm_on_cuda() -> None:
    bn = nn.BatchNorm1d(4)
    reference = copy.deepcopy(bn)
    model = GPipe(nn.Sequential(bn), [1], devices=["cuda:0"], chunks=3, deferred_batch_norm=True)
    x = torch.randn(7, 4)
    model(x.cuda())
    reference(x)
    deferred = model[0]
    assert isinstance(deferred, DeferredBatchNorm)
    torch.testing.assert_close(deferred.running_mean.cpu(), reference.running_mean)
    torch.testing.assert_close(deferred.running_var.cpu(), reference.running_var)


@pytest.mark.parametrize("chunks", [2, 8])
def test_float32_statistics_keep_their_precision_with_large_means(chunks: int) -> None:
    # Merging float32 means of data around 1e4 in float32 lost three orders of magnitude
    # of precision in the running variance; the merge is done in float64.
    x = torch.randn(64, 4, 16, generator=torch.Generator().manual_seed(1)) + 1e4
    exact = nn.BatchNorm1d(4, momentum=None).double()
    exact(x.double())
    model = GPipe(
        nn.Sequential(nn.BatchNorm1d(4, momentum=None)), [1], chunks=chunks,
        deferred_batch_norm=True,
    )  # fmt: skip
    model(x)
    deferred = model[0]
    assert isinstance(deferred, DeferredBatchNorm)
    assert exact.running_var is not None
    error = (deferred.running_var.double() - exact.running_var).abs() / exact.running_var
    assert float(error.max()) < 1e-6  # plain float32 BatchNorm itself is off by about 2e-7


def test_lazy_batch_norm_must_be_initialized_first() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d())
    with pytest.raises(ValueError, match=r"1 \(lazy, not initialized yet: run the model once"):
        GPipe(model, [1, 1], deferred_batch_norm=True)
    assert not isinstance(model[1], DeferredBatchNorm)  # nothing was changed
    model(torch.randn(3, 4))  # initialized by a first run, it converts
    GPipe(model, [1, 1], deferred_batch_norm=True)(torch.randn(3, 4))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_alone_updates_once_per_chunks_micro_batches(
    momentum: float | None,
) -> None:
    # torchgpipe 0.0.7 usage: the layer on its own, told how many micro-batches make a
    # mini-batch. It took no chunks and updated after every micro-batch.
    plain = nn.BatchNorm2d(3, momentum=momentum).double()
    deferred = DeferredBatchNorm(3, momentum=momentum, chunks=4).double()
    for step in (1, 2):
        x = torch.rand(16, 3, 4, 4, dtype=torch.float64) * 10 + step
        plain(x)
        pieces = x.chunk(4)
        for piece in pieces[:3]:
            deferred(piece)
        assert int(deferred.num_batches_tracked) == step - 1  # not before the fourth
        deferred(pieces[3])
        assert int(deferred.num_batches_tracked) == int(plain.num_batches_tracked) == step
        torch.testing.assert_close(deferred.running_mean, plain.running_mean)
        torch.testing.assert_close(deferred.running_var, plain.running_var)


def test_deferred_batch_norm_chunks_is_checked() -> None:
    import numpy as np

    deferred = DeferredBatchNorm(3, chunks=np.int64(2))  # type: ignore[arg-type]
    assert deferred.chunks == 2
    assert type(deferred.chunks) is int
    assert "chunks=2" in repr(deferred)
    with pytest.raises(ValueError, match="chunks must be a positive number of micro-batches"):
        DeferredBatchNorm(3, chunks=0)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match=f"chunks must be an int, got {bad!r}"):
            DeferredBatchNorm(3, chunks=bad)  # type: ignore[arg-type]


def test_deferred_batch_norm_refuses_chunks_in_track_running_stats() -> None:
    # 0.0.7's fifth positional argument was chunks; BatchNorm's is track_running_stats,
    # where 4 would silently read as True.
    with pytest.raises(TypeError, match=r"got 4; pass the number of micro-batches by keyword"):
        DeferredBatchNorm(3, 1e-5, 0.1, True, 4)


def test_deferred_batch_norm_classmethod_converts_nested_modules() -> None:
    inner = DeferredBatchNorm(3, chunks=7)
    model = nn.Sequential(
        nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3), MyBatchNorm(3)), inner
    )
    before = dict(model.state_dict(keep_vars=True))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
    assert converted is model  # replaced in place, as 0.0.7 did
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 3
    assert all(isinstance(m, DeferredBatchNorm) for m in layers)
    assert [m.chunks for m in layers] == [4, 4, 4]  # the deferred one already there too
    assert model[2] is inner
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)


def test_deferred_batch_norm_classmethod_converts_a_batch_norm_itself() -> None:
    bn = nn.BatchNorm2d(3).eval()
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(bn, chunks=2)
    assert deferred is bn  # in place: the layer itself, now deferred
    assert isinstance(deferred, DeferredBatchNorm)
    assert isinstance(deferred, nn.BatchNorm2d)
    assert deferred.chunks == 2
    assert not deferred.training
    assert DeferredBatchNorm.convert_deferred_batch_norm(deferred) is deferred


def test_deferred_batch_norm_classmethod_checks_chunks_before_converting() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match="chunks must be a positive number"):
        DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=0)
    assert type(model[0]) is nn.BatchNorm1d  # nothing was replaced


def test_gpipe_sets_the_micro_batches_of_a_deferred_layer() -> None:
    bn = nn.BatchNorm1d(2).double()
    reference = copy.deepcopy(bn)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(bn, chunks=5)
    model = GPipe(nn.Sequential(deferred), [1], chunks=3, deferred_batch_norm=True)
    x = torch.randn(6, 2, dtype=torch.float64)
    model(x)
    reference(x)
    assert deferred.chunks == 3
    assert int(deferred.num_batches_tracked) == 1
    torch.testing.assert_close(deferred.running_mean, reference.running_mean)


def _untracked(bn: nn.Module) -> None:
    bn.track_running_stats = False  # after construction: the buffers are still there


def _no_running_stats(bn: nn.Module) -> None:
    bn.running_mean = bn.running_var = None  # tracking on, nothing to track into


def _no_counter(bn: nn.Module) -> None:
    bn.num_batches_tracked = None
    bn.momentum = None  # BatchNorm then averages with a factor of 0


@pytest.mark.parametrize("prepare", [_untracked, _no_running_stats, _no_counter])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_deferred_batch_norm_follows_batch_norm_rules_as_they_stand(
    prepare: Any, when: str, chunks: int
) -> None:
    # Deferred layers read track_running_stats and the running statistics at each call,
    # as BatchNorm does: turned off after construction, the eval forward raised
    # "running_mean must be defined in evaluation mode"; with the running statistics
    # set to None, training failed a bare assert.
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    if when == "before":
        prepare(plain[1])
    model = GPipe(copy.deepcopy(plain), [1, 2], chunks=chunks, deferred_batch_norm=True)
    if when == "after":
        prepare(plain[1])
        prepare(model[1])
    assert isinstance(model[1], DeferredBatchNorm)
    for _ in range(2):
        x = torch.randn(9, 3, dtype=torch.float64)
        expected = plain(x)
        output = model(x)
        if chunks == 1:
            torch.testing.assert_close(output, expected)
    after, before = model.state_dict(), plain.state_dict()
    assert list(after) == list(before)
    for key in before:
        torch.testing.assert_close(after[key], before[key])
    plain.eval()
    model.eval()
    x = torch.randn(6, 3, dtype=torch.float64)
    # Each micro-batch alone, as the pipeline sees it: with no running statistics,
    # evaluation normalizes with the batch's own.
    expected = torch.cat([plain(piece) for piece in scatter(x, chunks)])
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("training", [True, False])
def test_deferred_batch_norm_refuses_half_running_stats_as_batch_norm(training: bool) -> None:
    plain = nn.BatchNorm1d(2).train(training)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain))
    x = torch.randn(4, 2)
    for bn in (plain, deferred):
        bn.running_var = None
        message = "must either both be None" if training else "running_var must be defined"
        with pytest.raises((ValueError, RuntimeError), match=message):
            bn(x)


@pytest.mark.parametrize(
    ("layer", "shape", "message"),
    [
        (nn.BatchNorm1d(4), (8, 4, 3, 3), r"expected 2D or 3D input \(got 4D input\)"),
        (nn.BatchNorm2d(4), (8, 4), r"expected 4D input \(got 2D input\)"),
        (nn.BatchNorm3d(4), (8, 4, 5), r"expected 5D input \(got 3D input\)"),
    ],
)
def test_deferred_batch_norm_keeps_the_input_check_of_the_layer_it_replaces(
    layer: nn.Module, shape: tuple[int, ...], message: str
) -> None:
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        layer(x)
    model = GPipe(nn.Sequential(nn.Identity(), layer), [1, 1], chunks=2, deferred_batch_norm=True)
    with pytest.raises(ValueError, match=message):
        model(x)
    # A deferred layer of its own has no class to follow: any batch of channels goes.
    DeferredBatchNorm(4)(torch.randn(8, 4, 3, 3))


class _BatchNormXd(_BatchNorm):
    """Built on _BatchNorm directly, with a check of its own (as mmengine's is)."""

    def _check_input_dim(self, input: Tensor) -> None:
        return


def test_deferred_batch_norm_of_a_class_built_on_the_base_takes_any_input_of_2_dims_up() -> None:
    plain = nn.Sequential(_BatchNormXd(2))
    model = GPipe(copy.deepcopy(plain), [1], chunks=1, deferred_batch_norm=True)
    x = torch.randn(4, 2, 5, 5)  # 4-D, as 2-D and 3-D would be: the class says nothing
    torch.testing.assert_close(model(x), plain(x))
    torch.testing.assert_close(model[0].running_mean, plain[0].running_mean)


# In the models below a batch-norm layer's input never depends on another's output, which
# the pipeline normalizes per micro-batch: the plain model's running statistics are then
# what the deferred layers must track.


class _Twice(nn.Module):
    """One batch-norm layer applied twice (a block used at two depths)."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=momentum)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x) + self.bn(x * 10 + 5)


class _TwoNames(nn.Module):
    """One batch-norm layer registered under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_a = self.bn_b = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn_a(x) + self.bn_b(x * 2 + 1)


class _Holder(nn.Module):
    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: Tensor) -> Tensor:
        return x * 3 + 1 + 0 * self.bn(x)


def _assert_same_running_stats(model: nn.Module, plain: nn.Module) -> None:
    for (name, m), (_, p) in zip(model.named_modules(), plain.named_modules(), strict=True):
        if isinstance(p, _BatchNorm):
            assert isinstance(m, DeferredBatchNorm), name
            torch.testing.assert_close(m.running_mean, p.running_mean, msg=name)
            torch.testing.assert_close(m.running_var, p.running_var, msg=name)
            assert int(m.num_batches_tracked) == int(p.num_batches_tracked), name


@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_layer_called_twice_per_micro_batch_tracks_each_call(
    chunks: int, momentum: float | None, checkpoint: str
) -> None:
    # Each call of the plain layer updates from its own input over the whole batch: the
    # deferred layer merged its first and second calls together before the fix.
    plain = nn.Sequential(nn.Identity(), _Twice(momentum)).double()
    model = GPipe(
        copy.deepcopy(plain), [1, 1], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True
    )
    for _ in range(2):
        x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
        model(x).square().sum().backward()
        plain(x)
    _assert_same_running_stats(model, plain)
    assert int(plain[1].bn.num_batches_tracked) == 4  # twice per step


def test_convert_replaces_a_layer_under_every_name() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), _TwoNames()).double()
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=4, deferred_batch_norm=True)
    block = model[1]
    # One deferred layer for the one layer: both names, and the identity, kept.
    assert isinstance(block.bn_a, DeferredBatchNorm)
    assert block.bn_a is block.bn_b
    x = torch.randn(16, 4, dtype=torch.float64)
    model(x)
    plain(x)
    _assert_same_running_stats(model, plain)
    assert list(model.state_dict()) == list(plain.state_dict())


def test_a_layer_in_two_layers_of_one_partition_tracks_each_call() -> None:
    bn = nn.BatchNorm1d(4, momentum=None).double()
    plain = nn.Sequential(_Holder(bn), _Holder(bn))
    model = GPipe(copy.deepcopy(plain), [2], chunks=2, deferred_batch_norm=True)
    assert model[0].bn is model[1].bn
    x = torch.randn(8, 4, dtype=torch.float64)
    model(x)
    plain(x)
    _assert_same_running_stats(model, plain)


@pytest.mark.parametrize("schedule", [Schedule1F1B, ScheduleZeroBubble])
def test_a_schedules_step_tracks_each_call_of_a_layer(schedule: type) -> None:
    plain = nn.Sequential(nn.Linear(4, 4), _Twice(momentum=None), nn.Linear(4, 2)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, deferred_batch_norm=True)
    driver = schedule(model, lambda y, t: (y - t).square().mean())
    for _ in range(2):
        x, t = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
        driver.step(x, t)
        plain(x)
    _assert_same_running_stats(model, plain)


@pytest.mark.parametrize("unrouted", [[3], [0], [1, 3]])
@pytest.mark.parametrize("how", ["model(x)", "1f1b", "zero-bubble"])
def test_a_micro_batch_that_does_not_call_a_layer_still_ends_the_mini_batch(
    unrouted: list[int], how: str
) -> None:
    # The update waited for a chunks-th micro-batch to call the layer: with one that
    # routed nothing, the statistics never changed, silently.
    plain = nn.Sequential(nn.Linear(4, 4), Routed(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        plain[0].weight.copy_(torch.eye(4))
        plain[0].bias.zero_()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, deferred_batch_norm=True)
    for _ in range(2):
        x = routed_batch(unrouted)
        if how == "model(x)":
            model(x)
        else:
            schedule = {"1f1b": Schedule1F1B, "zero-bubble": ScheduleZeroBubble}[how]
            schedule(model, lambda y, t: (y - t).square().mean()).step(x, torch.zeros(16, 2))
        plain(x)
    _assert_same_running_stats(model, plain)
    assert int(plain[1].bn.num_batches_tracked) == 2


def test_a_layer_on_its_own_counts_each_call_as_a_micro_batch() -> None:
    # As in torchgpipe 0.0.7: outside a pipeline no call says where a micro-batch starts.
    layer = DeferredBatchNorm(4, chunks=2, momentum=None).double()
    plain = nn.BatchNorm1d(4, momentum=None).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    for piece in x.chunk(2):
        layer(piece)
    plain(x)
    torch.testing.assert_close(layer.running_mean, plain.running_mean)
    torch.testing.assert_close(layer.running_var, plain.running_var)
    assert int(layer.num_batches_tracked) == 1


# Conversion in place: each layer stays the object it was, an instance of its class,
# with everything it holds. A fresh DeferredBatchNorm took its place before, with its
# weight and running statistics only.


class _ScaledBatchNorm(nn.BatchNorm1d):
    """A subclass with a forward, a parameter and a buffer of its own."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.gain = nn.Parameter(torch.linspace(0.5, 2.0, num_features))
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, num_features))

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * self.gain + self.offset


class _Positive(nn.Module):
    """A parametrization: the weight used is positive."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight.abs() + 0.5


def _mlp_with(layer: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2)).double()


def _check_against_the_plain_model(plain: nn.Module, model: GPipe, chunks: int) -> None:
    """The pipeline's outputs, gradients, running statistics and state dict are the plain
    model's: each micro-batch through a copy of it for the outputs and gradients, the
    whole mini-batch through it for the running statistics."""
    assert list(model.state_dict()) == list(plain.state_dict())
    per_micro_batch = copy.deepcopy(plain)
    x = torch.randn(8, 3, dtype=torch.float64)
    expected = torch.cat([per_micro_batch(piece) for piece in scatter(x, chunks)])
    expected.square().sum().backward()
    output = model(x)
    output.square().sum().backward()
    torch.testing.assert_close(output, expected)
    grads = dict(per_micro_batch.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, msg=name)
    plain(x)
    _assert_same_running_stats(model, plain)
    model.eval()
    plain.eval()
    torch.testing.assert_close(model(x), plain(x))
    model.train()
    plain.train()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_subclass_keeps_its_forward_parameters_and_buffers(checkpoint: str) -> None:
    # Its forward, gain and offset were dropped: the outputs differed, and the plain
    # model's state dict no longer loaded ("Unexpected key(s): 1.gain, 1.offset").
    plain = _mlp_with(_ScaledBatchNorm(4))
    model = GPipe(
        copy.deepcopy(plain), [2, 1], chunks=2, checkpoint=checkpoint, deferred_batch_norm=True
    )
    assert isinstance(model[1], _ScaledBatchNorm)
    assert isinstance(model[1], DeferredBatchNorm)
    _check_against_the_plain_model(plain, model, chunks=2)
    model.load_state_dict(plain.state_dict())  # strict: the keys are the plain model's


def test_a_subclass_keeps_its_own_input_check() -> None:
    class Only3d(nn.BatchNorm1d):
        def _check_input_dim(self, input: Tensor) -> None:
            if input.dim() != 3:
                raise ValueError(f"Only3d takes (N, C, L), got {input.dim()}-D")

    model = GPipe(nn.Sequential(Only3d(4)), [1], chunks=2, deferred_batch_norm=True)
    with pytest.raises(ValueError, match=r"Only3d takes \(N, C, L\), got 2-D"):
        model(torch.randn(8, 4))


def test_hooks_on_a_layer_still_run() -> None:
    # The hooks stayed on the layer replaced: they ran no more under the pipeline.
    calls: list[str] = []

    def before(module: nn.Module, args: tuple[Tensor]) -> None:
        calls.append("pre")

    def after(module: nn.Module, args: tuple[Tensor], output: Tensor) -> Tensor:
        calls.append("hook")
        return output * 0.5 + 1

    plain = _mlp_with(nn.BatchNorm1d(4))
    plain[1].register_forward_pre_hook(before)
    plain[1].register_forward_hook(after)
    model = GPipe(
        copy.deepcopy(plain), [2, 1], chunks=2, checkpoint="never", deferred_batch_norm=True
    )
    _check_against_the_plain_model(plain, model, chunks=2)  # the hook halves the output
    calls.clear()
    model(torch.randn(8, 3, dtype=torch.float64))
    assert calls == ["pre", "hook"] * 2  # once per micro-batch, as any layer's


def test_a_parametrized_weight_is_kept() -> None:
    # Refused before, with torch's "cannot assign 'torch.DoubleTensor' as parameter".
    plain = _mlp_with(nn.BatchNorm1d(4))
    parametrize.register_parametrization(plain[1], "weight", _Positive())
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, deferred_batch_norm=True)
    assert isinstance(model[1], DeferredBatchNorm)
    assert parametrize.is_parametrized(model[1], "weight")
    assert type(plain[1]).__name__ == "ParametrizedBatchNorm1d"  # the plain one untouched
    _check_against_the_plain_model(plain, model, chunks=2)
    # Removing the parametrization puts back the class beneath it: the deferred one.
    parametrize.remove_parametrizations(model[1], "weight")
    assert type(model[1]).__name__ == "DeferredBatchNorm1d"
    model(torch.randn(8, 3, dtype=torch.float64))
    assert int(model[1].num_batches_tracked) == 2


def test_deferred_layers_are_still_instances_of_their_class() -> None:
    # isinstance(layer, nn.BatchNorm2d) was False after conversion: freezing batch norm
    # layers by their class, a common idiom, silently left them training.
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, deferred_batch_norm=True)
    for m in (plain, model):
        for layer in m.modules():
            if isinstance(layer, nn.BatchNorm2d):
                layer.eval()
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x))
    _assert_same_running_stats(model, plain)
    assert int(model[1].num_batches_tracked) == 0


def test_gpipe_defers_the_users_own_layers() -> None:
    # GPipe takes the user's layers; the user's references to them stay the model's.
    bn = nn.BatchNorm1d(4).double()
    layers = nn.Sequential(nn.Linear(3, 4).double(), bn)
    plain = copy.deepcopy(layers)
    model = GPipe(layers, [1, 1], chunks=2, deferred_batch_norm=True)
    assert model[1] is bn
    assert layers[1] is bn
    assert isinstance(bn, DeferredBatchNorm)
    x = torch.randn(8, 3, dtype=torch.float64)
    model(x)
    plain(x)
    torch.testing.assert_close(bn.running_mean, plain[1].running_mean)
    assert int(bn.num_batches_tracked) == 1


def test_a_converted_layer_survives_pickle_and_deepcopy() -> None:
    # Its class is made at run time; pickle names the class it was made from instead.
    model = DeferredBatchNorm.convert_deferred_batch_norm(_mlp_with(_ScaledBatchNorm(4)), chunks=3)
    for again in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(again[1]) is type(model[1])
        assert again[1].chunks == 3
        assert list(again.state_dict()) == list(model.state_dict())
        x = torch.randn(6, 3, dtype=torch.float64)
        torch.testing.assert_close(again.eval()(x), model.eval()(x))


def test_sync_batch_norm_in_one_process_is_deferred() -> None:
    plain = _mlp_with(nn.SyncBatchNorm(4))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, deferred_batch_norm=True)
    assert isinstance(model[1], nn.SyncBatchNorm)
    assert isinstance(model[1], DeferredBatchNorm)
    _check_against_the_plain_model(plain, model, chunks=2)


def test_sync_batch_norm_that_would_synchronize_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deferred batch norm does not synchronize: that silently normalized and tracked
    # one process's statistics where SyncBatchNorm would have used the group's.
    model = GPipe(_mlp_with(nn.SyncBatchNorm(4)), [2, 1], chunks=2, deferred_batch_norm=True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    x = torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="across the 2 processes of its group"):
        model(x)
    model.eval()
    model(x)  # evaluation synchronizes nothing


class _OwnSyncForward(nn.SyncBatchNorm):
    """A forward of its own over SyncBatchNorm's, beneath which nothing can be put."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * 2


def test_convert_refuses_every_layer_whose_forward_it_cannot_take_over() -> None:
    model = nn.Sequential(
        nn.Linear(3, 4), _OwnSyncForward(4), nn.BatchNorm1d(4), nn.Sequential(_OwnSyncForward(4))
    )
    message = (
        r"cannot be deferred: 1 \(_OwnSyncForward's forward runs SyncBatchNorm's, not "
        r"BatchNorm's\); 3\.0 \(.*\); use torch's BatchNorm1d/2d/3d there"
    )
    with pytest.raises(ValueError, match=message):
        GPipe(model, [2, 2], deferred_batch_norm=True)
    assert type(model[2]) is nn.BatchNorm1d  # nothing was converted
    assert type(model[1]) is _OwnSyncForward


# Found by review of the conversion in place.


class _BatchNormAct(nn.BatchNorm1d):
    """Batch norm done by its own forward, with F.batch_norm (timm's BatchNormAct2d)."""

    def forward(self, input: Tensor) -> Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        output = F.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.training, self.momentum, self.eps,
        )  # fmt: skip
        return F.relu(output)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_subclass_forward_that_does_batch_norm_itself_is_refused(checkpoint: str) -> None:
    # Converted but never deferred: its statistics were updated per micro-batch, and
    # under checkpointing its recomputation updated them again (8 where 4).
    plain = _mlp_with(_BatchNormAct(4))
    model = GPipe(
        copy.deepcopy(plain), [2, 1], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
    )
    x = torch.randn(16, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"_BatchNormAct\.forward changed its running statis"):
        model(x)
    with pytest.raises(ValueError, match=r"super\(\)\.forward\(input\); or build the model anew"):
        model[1](torch.randn(8, 4, dtype=torch.float64))  # on its own too
    # Without deferral: once per micro-batch, as the plain layer fed each in turn.
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, checkpoint=checkpoint)
    model(x).square().sum().backward()
    for piece in scatter(x, 4):
        plain(piece)
    _assert_same_statistics(model[1], plain[1])
    assert int(model[1].num_batches_tracked) == 4


class _FrozenInTraining(nn.BatchNorm1d):
    """A forward that normalizes with the running statistics, and leaves them be."""

    def forward(self, input: Tensor) -> Tensor:
        return F.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


def test_a_subclass_forward_that_keeps_the_statistics_as_they_are_runs() -> None:
    plain = _mlp_with(_FrozenInTraining(4))
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, deferred_batch_norm=True)
    x = torch.randn(16, 3, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x))
    _assert_same_statistics(model[1], plain[1])


class _CountingBatchNorm(nn.BatchNorm1d):
    """BatchNorm's forward, and a count of its own calls in ``num_batches_tracked``."""

    def forward(self, input: Tensor) -> Tensor:
        output = super().forward(input)
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return output


def test_a_recomputation_puts_back_what_a_deferred_subclass_forward_changes() -> None:
    # Deferred layers were left out of freeze_running_stats: what a subclass's forward
    # changed besides the deferred statistics, its recomputation changed again.
    plain = _mlp_with(_CountingBatchNorm(4))
    x = torch.randn(16, 3, dtype=torch.float64)
    counts = []
    for checkpoint in ("always", "never"):
        model = GPipe(
            copy.deepcopy(plain), [2, 1], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
        )
        model(x).square().sum().backward()
        counts.append(int(model[1].num_batches_tracked))
    assert counts == [5, 5]  # one mini-batch, and four calls of its own


class _Decaying(nn.BatchNorm1d):
    """A buffer of its own that its forward changes: a scale halved at each call."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.register_buffer("scale", torch.ones(num_features))

    def forward(self, input: Tensor) -> Tensor:
        output = super().forward(input) * self.scale
        if self.training:
            self.scale = self.scale * 0.5
        return output


@pytest.mark.parametrize("deferred", [False, True])
def test_a_batch_norm_subclass_buffer_is_restored_for_the_recomputation(deferred: bool) -> None:
    # A batch-norm layer's buffers were all left to freeze_running_stats, which knows
    # the running statistics only: the recomputation read the scale the later
    # micro-batches had left, and the gradients differed from the plain model's.
    plain = nn.Sequential(nn.Linear(3, 4), _Decaying(4), nn.Linear(4, 2)).double()
    model = GPipe(
        copy.deepcopy(plain), [1, 2], chunks=4, checkpoint="always", deferred_batch_norm=deferred
    )
    x = torch.randn(16, 3, dtype=torch.float64)
    model(x).square().sum().backward()
    torch.cat([plain(piece) for piece in scatter(x, 4)]).square().sum().backward()
    for (name, ours), (_, theirs) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    torch.testing.assert_close(model[1].scale, plain[1].scale)


class _Renorm(nn.BatchNorm1d):
    """Batch renormalization's correction: reads the running variance in training."""

    def forward(self, input: Tensor) -> Tensor:
        assert self.running_var is not None
        batch = input.var(0, unbiased=False).add(self.eps).sqrt().detach()
        correction = batch / self.running_var.add(self.eps).sqrt()  # read before updating
        return super().forward(input) * correction


def _renorm_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), _Renorm(4, momentum=0.9), nn.Linear(4, 1)).double()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_layer_reading_the_running_statistics_in_training_recomputes_what_it_read(
    checkpoint: str,
) -> None:
    # The bug: the running statistics were left out of the buffers restored for a
    # recomputation (torch's batch norm updates them without a new version, so they
    # seem unchanged), on the belief that training-mode batch norm does not read them:
    # a batch renormalization (or quantization-aware training's fused convolution and
    # batch norm) read, in micro-batch i's recomputation, what the later ones had left,
    # and the first layer's gradient was off by 100 % and more.
    plain = _renorm_mlp()
    model = GPipe(_renorm_mlp(), [2, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 4, dtype=torch.float64) * 3 + 1
    model(x).square().sum().backward()
    for piece in scatter(x, 4):  # without deferral, each micro-batch updates in turn
        plain(piece).square().sum().backward()
    assert_same_grads(model, plain)
    torch.testing.assert_close(model[1].running_var, plain[1].running_var)
    assert int(model[1].num_batches_tracked) == 4


def test_a_deferred_layer_reading_the_running_statistics_recomputes_what_it_read() -> None:
    # Deferred: the statistics change at the last micro-batch's deferred forward, after
    # every micro-batch read them; the recomputations read the values before the step.
    x = torch.randn(8, 4, dtype=torch.float64) * 3 + 1
    grads, stats = [], []
    for checkpoint in ("always", "except_last", "never"):
        model = GPipe(
            _renorm_mlp(), [2, 1], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
        )
        model(x).square().sum().backward()
        grads.append(model[0].weight.grad)
        assert grads[-1] is not None
        assert grads[-1].abs().max() > 1e-3
        stats.append(model[1].running_var)
    for grad, stat in zip(grads[:2], stats[:2], strict=True):
        torch.testing.assert_close(grad, grads[2])
        torch.testing.assert_close(stat, stats[2])


def _two_steps_beside_the_plain_one(model: GPipe, plain: nn.Module) -> None:
    """Two backward steps of ``model`` (4 micro-batches), and of ``plain`` one at a time."""
    for step in range(2):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        for piece in scatter(x, 4):
            plain(piece).square().sum().backward()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_lazy_batch_norm_in_a_checkpointed_partition_trains_as_the_plain_one(
    checkpoint: str,
) -> None:
    # Regression: the running statistics of a layer not yet initialized were copied
    # before its first forward (ValueError: uninitialized parameter).
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 1)).double()

    plain = build()
    model = GPipe(build(), [2, 1], chunks=4, checkpoint=checkpoint)
    _two_steps_beside_the_plain_one(model, plain)
    assert_same_grads(model, plain)
    torch.testing.assert_close(model[1].running_var, plain[1].running_var)
    assert int(model[1].num_batches_tracked) == 8


class _LazyScale(nn.Module):
    """A lazy buffer: filled at the first call, halved at each training call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", nn.parameter.UninitializedBuffer())

    def forward(self, x: Tensor) -> Tensor:
        if nn.parameter.is_lazy(self.scale):
            self.scale.materialize(x.shape[1:], dtype=x.dtype)
            self.scale.fill_(1.0)
        out = x * self.scale.clone()
        if self.training:
            self.scale.mul_(0.5)
        return out


def test_a_lazy_buffer_other_than_batch_norms_is_refused_in_a_checkpointed_partition() -> None:
    # Its value before the forward is unknown (no copy can be kept): the recomputation
    # would read, and change again, what the later micro-batches left.
    model = GPipe(nn.Sequential(nn.Linear(4, 4), _LazyScale()), [2], chunks=2)
    with pytest.raises(ValueError, match=r"'scale' of a _LazyScale has no value yet"):
        model(torch.randn(4, 4))
    model = GPipe(nn.Sequential(nn.Linear(4, 4), _LazyScale()), [2], chunks=2, checkpoint="never")
    model(torch.randn(4, 4)).sum().backward()  # initialized: any mode from now on
    model.checkpoint = "always"
    model(torch.randn(4, 4)).sum().backward()


class _QuietScale(nn.Module):
    """A buffer changed in place with no new version (as a fused observer does), and read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.scale
        if self.training:
            self.scale.data.mul_(0.5)  # .data: the buffer's version stays
        return out


def test_a_buffer_holding_nan_that_is_only_read_is_not_copied_per_cell() -> None:
    # NaN equals nothing: a read-only buffer holding one was taken for a changing one
    # and copied at every checkpointed cell (a 100 MB table: 180 times slower).
    table = torch.zeros(4, dtype=torch.float64)
    table[0] = math.nan
    layer = nn.Linear(4, 4).double()
    layer.register_buffer("table", table)
    model = GPipe(nn.Sequential(layer, nn.Linear(4, 1).double()), [1, 1], chunks=4)
    model(torch.randn(8, 4, dtype=torch.float64)).sum().backward()
    guard = model._guards[0]
    assert guard.changing == set()


def test_a_buffer_changed_without_a_new_version_is_restored_for_the_recomputation() -> None:
    # Quantization-aware training's default observer updates its scale in a kernel that
    # leaves the version as it was: the recomputation read what the later micro-batches
    # had left, and the gradients differed from the plain model's.
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), _QuietScale(), nn.Linear(4, 1)).double()

    plain = build()
    model = GPipe(build(), [2, 1], chunks=4, checkpoint="always")
    _two_steps_beside_the_plain_one(model, plain)
    assert_same_grads(model, plain)
    torch.testing.assert_close(model[1].scale, plain[1].scale)


def test_other_holders_of_a_converted_layer_see_it_deferred() -> None:
    # Documented, not refused: a DeferredBatchNorm of one's own inside a GPipe without
    # the flag is torchgpipe 0.0.7's usage. Give GPipe a copy to keep the layer plain.
    bn = nn.BatchNorm1d(4).double()
    other = nn.Sequential(nn.Identity(), bn)  # another model holding the same layer
    model = GPipe(nn.Sequential(nn.Identity(), bn), [1, 1], chunks=2, deferred_batch_norm=True)
    x = torch.randn(8, 4, dtype=torch.float64)
    model(x)
    assert isinstance(other[1], DeferredBatchNorm)
    assert int(bn.num_batches_tracked) == 1
    other(x)
    assert int(bn.num_batches_tracked) == 1  # the first of 2 micro-batches, as GPipe's
    other(x)
    assert int(bn.num_batches_tracked) == 2


class _GhostBatchNorm(nn.BatchNorm1d):
    """Normalizes ``chunks`` virtual batches apart: an attribute ``chunks`` of its own."""

    def __init__(self, num_features: int, chunks: int) -> None:
        super().__init__(num_features)
        self.chunks = chunks

    def forward(self, input: Tensor) -> Tensor:
        normalize = super().forward  # outside the comprehension, its own scope on 3.11
        return torch.cat([normalize(piece) for piece in input.chunk(self.chunks)])


class _WithExpect(nn.BatchNorm1d):
    """A method ``expect`` of its own."""

    def expect(self, shape: tuple[int, ...]) -> None:
        raise AssertionError("the user's expect, called by the library")


@pytest.mark.parametrize("layer", [_GhostBatchNorm(4, chunks=2), _WithExpect(4)])
def test_a_subclass_keeps_its_own_chunks_and_expect(layer: nn.Module) -> None:
    # The deferred layer's chunks overwrote the ghost batch norm's at each mini-batch
    # (4 virtual batches where 2); a class's own expect was called in its place.
    plain = _mlp_with(layer)
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=4, deferred_batch_norm=True)
    x = torch.randn(16, 3, dtype=torch.float64)
    expected = torch.cat([copy.deepcopy(plain)(piece) for piece in scatter(x, 4)])
    torch.testing.assert_close(model(x), expected)
    if isinstance(layer, _GhostBatchNorm):
        assert model[1].chunks == 2
        return
    plain(x)
    _assert_same_statistics(model[1], plain[1])


def test_chunks_of_a_layer_on_its_own_is_set_through_the_tally() -> None:
    layer = DeferredBatchNorm(4, chunks=2).double()
    layer.chunks = 3
    for _ in range(2):
        layer(torch.randn(4, 4, dtype=torch.float64))
    assert int(layer.num_batches_tracked) == 0  # 3 micro-batches now
    expect_micro_batches(layer, 2)
    assert layer.chunks == 2
    with pytest.raises(ValueError, match="chunks must be a positive number"):
        layer.chunks = 0


def test_float16_running_variance_stays_finite() -> None:
    # The variance, over float16's largest value, was cast before the blend: inf.
    x = (torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * 300).half()
    plain = nn.BatchNorm1d(4).half()
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=2)
    plain(x)
    for piece in x.chunk(2):
        deferred(piece)
    torch.testing.assert_close(deferred.running_var, plain.running_var, rtol=2e-3, atol=0)
    torch.testing.assert_close(deferred.running_mean, plain.running_mean, rtol=2e-3, atol=0.1)


class _Positives(nn.Module):
    """The rows whose first value is positive: none in some micro-batches."""

    def forward(self, x: Tensor) -> Tensor:
        return x[x[:, 0] > 0]


def test_an_empty_micro_batch_leaves_the_statistics_as_batch_norm_does() -> None:
    # Its mean, 0 / 0, made the running statistics NaN.
    plain = nn.Sequential(_Positives(), nn.BatchNorm1d(2)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=4, deferred_batch_norm=True)
    x = torch.randn(16, 2, dtype=torch.float64).abs()
    x[4:8, 0] = -1  # the second micro-batch has none
    model(x)
    plain(x)
    _assert_same_statistics(model[1], plain[1])
    nothing = -x.abs()
    model(nothing)  # every micro-batch empty: counted, the statistics as they are
    plain(nothing)
    _assert_same_statistics(model[1], plain[1])
    assert int(model[1].num_batches_tracked) == 2


class _Registered(nn.BatchNorm1d):
    """Subclasses must name a key (a registry of classes)."""

    def __init_subclass__(cls, key: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)


class _Mine(_Registered, key="mine"):
    pass


def test_a_class_that_refuses_a_subclass_is_named_and_nothing_converted() -> None:
    # The layers before it were converted, and the class's TypeError came out bare.
    model = nn.Sequential(nn.BatchNorm1d(4), _Mine(4))
    with pytest.raises(ValueError, match=r"1 \(_Mine refused a subclass: TypeError\(.*'key'"):
        GPipe(model, [1, 1], deferred_batch_norm=True)
    assert type(model[0]) is nn.BatchNorm1d
    assert type(model[1]) is _Mine


def test_a_shallow_copy_has_a_tally_of_its_own() -> None:
    layer = DeferredBatchNorm(4, chunks=2, momentum=None).double()
    first, second = torch.randn(2, 8, 4, dtype=torch.float64)
    layer(first)
    twin = copy.copy(layer)  # shares the running statistics, as a shallow copy does
    twin(second)
    layer(second)  # its own second micro-batch: it updates too
    assert int(layer.num_batches_tracked) == 2


def _assert_same_statistics(ours: nn.Module, theirs: nn.Module) -> None:
    assert isinstance(ours, _BatchNorm)
    assert isinstance(theirs, _BatchNorm)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked)
