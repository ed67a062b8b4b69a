"""Automatic balancing: the exact split, and the profilers by time and by size."""

import copy
import itertools
import math
from typing import Any

import pytest
import torch
from helpers import Count, Counted, PopAdd, StashLinear
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchgpipe.balance
from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size, balance_by_time, profile
from torchgpipe.balance.blockpartition import solve
from torchgpipe.skip import Namespace, pop, skippable, stash


def _largest(costs: list[float], balance: list[int]) -> float:
    bounds = [0, *itertools.accumulate(balance)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def _brute_force(costs: list[float], k: int) -> float:
    n = len(costs)
    return min(
        _largest(costs, [b - a for a, b in itertools.pairwise([0, *cuts, n])])
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


def _check_split(costs: list[float], k: int, balance: list[int]) -> None:
    assert len(balance) == k
    assert all(isinstance(b, int) and b > 0 for b in balance)
    assert sum(balance) == len(costs)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_solve_is_optimal_for_integer_costs(data: st.DataObject) -> None:
    costs = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=9))
    k = data.draw(st.integers(1, len(costs)))
    balance = solve(costs, k)
    _check_split(costs, k, balance)
    assert _largest(costs, balance) == _brute_force(costs, k)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_solve_is_optimal_for_float_costs(data: st.DataObject) -> None:
    costs = data.draw(
        st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=9),
    )
    k = data.draw(st.integers(1, len(costs)))
    balance = solve(costs, k)
    _check_split(costs, k, balance)
    # Exact in the costs' own values; the sums below round, hence the tolerance.
    expected = _brute_force(costs, k)
    assert _largest(costs, balance) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_solve_is_optimal_for_runs_of_zero_costs(data: st.DataObject) -> None:
    costs = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 7]), min_size=1, max_size=9))
    k = data.draw(st.integers(1, len(costs)))
    balance = solve(costs, k)
    _check_split(costs, k, balance)
    assert _largest(costs, balance) == _brute_force(costs, k)


def _integer_optimum(costs: list[int], k: int) -> int:
    """For integer costs, the least cap the greedy fill meets, by bisection: exact."""

    def groups(cap: int) -> int:
        count, total = 1, 0
        for c in costs:
            if total + c > cap:
                count, total = count + 1, 0
            total += c
        return count

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if groups(mid) <= k else (mid + 1, hi)
    return lo


@pytest.mark.parametrize("k", [2, 16, 200])
def test_solve_is_optimal_for_thousands_of_layers(k: int) -> None:
    costs = [(i * 7919) % 101 for i in range(3000)]
    balance = solve(costs, k)
    _check_split(costs, k, balance)
    assert _largest(costs, balance) == _integer_optimum(costs, k)


def test_solve_on_zeros_and_equal_costs() -> None:
    assert solve([0.0] * 5, 3) == [1, 1, 3]  # one group, split at its first even point
    assert solve([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert solve([1, 1, 1, 1], 2) == [2, 2]


class _Budget(list[int]):
    """Prefix sums that count their reads, and refuse any read past a budget."""

    def __init__(self, items: list[int], budget: int) -> None:
        super().__init__(items)
        self.left = budget

    def __getitem__(self, index: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise AssertionError("over budget: the split reads the costs too often")
        return super().__getitem__(index)


@pytest.mark.parametrize(
    ("costs", "k"),
    [
        ([0] * 20_000, 10_000),
        ([0] * 4_000, 4_000),
        ([1 if i % 1000 == 0 else 0 for i in range(20_000)], 5_000),
        ([(i * 7919) % 101 + 1 for i in range(4_000)], 4_000),
    ],
)
def test_solve_splits_into_many_groups_in_k_log_n_reads(costs: list[int], k: int) -> None:
    # Filling up to k groups scanned every group and every point of the group split,
    # for each split: 20,000 zero costs into 10,000 groups took half a minute. Counted
    # in reads of the prefix sums (not timed): O(k log n), which the old fill exceeds
    # within a fraction of a second.
    from torchgpipe.balance.blockpartition import _least_cap, _split

    prefix = list(itertools.accumulate(costs, initial=0))
    cap = _least_cap(prefix, k)
    budget = 4 * (k + 1) * math.ceil(math.log2(len(prefix)))
    balance = _split(_Budget(prefix, budget), k, cap)
    _check_split(costs, k, balance)
    assert _largest(costs, balance) == cap == _integer_optimum(costs, k)


def test_solve_takes_numpy_and_tensor_scalars() -> None:
    import numpy as np

    costs = [np.float32(1.0), torch.tensor(2.0), np.int64(1), 3]
    assert solve(costs, 2) == [3, 1]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("costs", "k", "match"),
    [
        ([1.0, 2.0], 3, "cannot split 2 layers into 3 partitions"),
        ([1.0, -2.0], 1, r"non-negative, got \[\(1, -2.0\)\]"),
        ([1.0, float("nan")], 1, "finite"),
        ([1.0], 0, "partitions must be a positive int"),
        ([1, 10**400], 1, "cost 1 is too large for a float .*401 digits"),  # was OverflowError
        ([1, "x"], 1, "costs must be numbers, got 'x' at index 1"),
        ([], 1, "no layers to split"),  # was "use at most 0 partitions"
    ],
)
def test_solve_rejects_bad_input(costs: list[float], k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        solve(costs, k)


class Clock:
    """A clock that moves only when a layer says it spent time: timings without noise."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = Clock()  # module-wide: the profiler's copies of the layers move this one


class Costly(nn.Module):
    """Takes a known time in forward and again in backward, on CLOCK."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        CLOCK.now += self.seconds
        return _CostlyBackward.apply(x * self.scale, self.seconds)


class _CostlyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        CLOCK.now += ctx.seconds  # type: ignore[attr-defined]
        return grad, None


def test_balance_by_time_finds_the_optimal_split(monkeypatch: pytest.MonkeyPatch) -> None:
    # Known costs (forward and backward each take this long on the profiler's clock);
    # the best split into 3 has bottleneck 24 ms. The clock is the layers' own, so the
    # machine's load cannot change what the profiler measures.
    monkeypatch.setattr(profile, "time", CLOCK)
    ms = [4, 4, 12, 8, 16, 4, 4, 8, 4]
    model = nn.Sequential(*[Costly(t / 1e3) for t in ms])
    balance = balance_by_time(3, model, torch.ones(2, 2), timeout=0.01, device="cpu")
    assert _largest(ms, balance) == _brute_force(ms, 3) == 24


class Sized(nn.Module):
    """A layer of known size: `params` float32 parameters, an output of `width` columns."""

    def __init__(self, params: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(params))
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        # sum, expand and add save nothing for backward; the sum is a new (batch, width).
        return x.sum(dim=1, keepdim=True).expand(-1, self.width) + self.weight.sum()


@pytest.mark.parametrize(("chunks", "param_scale"), [(1, 2.0), (4, 3.0)])
def test_balance_by_size_finds_the_optimal_split(chunks: int, param_scale: float) -> None:
    shapes = [(100, 10), (10, 400), (300, 10), (10, 10), (50, 200), (500, 10), (10, 300)]
    model = nn.Sequential(*[Sized(p, w) for p, w in shapes])
    batch = 8
    micro = batch // chunks
    sizes = [4 * (micro * w + p * param_scale) for p, w in shapes]
    balance = balance_by_size(
        3, model, torch.ones(batch, 5), chunks=chunks, param_scale=param_scale, device="cpu"
    )
    assert _largest(sizes, balance) == _brute_force(sizes, 3)
    # And the profile itself is what the layers are known to hold.
    from torchgpipe.balance.profile import layerwise_size

    measured = layerwise_size(
        model, torch.ones(batch, 5), chunks=chunks, param_scale=param_scale,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert measured == sizes


def _mixed_model() -> nn.Sequential:
    ns = Namespace()  # each layer is copied on its own: the namespace must survive that
    return nn.Sequential(
        StashLinear().isolate(ns),
        nn.ReLU(inplace=True),  # modifies its input in place
        nn.BatchNorm1d(4),
        nn.Dropout(0.5),
        PopAdd().isolate(ns),
        nn.Linear(4, 2),
    )


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("by", ["time", "size"])
def test_balancing_leaves_the_model_as_it_was(by: str, training: bool) -> None:
    model = _mixed_model().train(training)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(6, 4)
    if by == "time":
        balance = balance_by_time(3, model, x, timeout=0.01, device="cpu")
    else:
        balance = balance_by_size(3, model, x, chunks=2, device="cpu")
    assert sum(balance) == len(model)
    assert len(balance) == 3
    assert model.training == training  # the mode
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and buffers
    assert all(p.grad is None for p in model.parameters())
    GPipe(model, balance, chunks=2)(x)  # and the split is usable as it is


def test_frozen_parameters_count_once() -> None:
    from torchgpipe.balance.profile import layerwise_size

    frozen, trained = nn.Linear(4, 4), nn.Linear(4, 4)
    frozen.requires_grad_(False)
    x = torch.ones(1, 4)
    sizes = layerwise_size(
        nn.Sequential(frozen, trained), x, chunks=1, param_scale=3.0, device=torch.device("cpu")
    )
    parameters = 4 * (16 + 4)
    assert sizes == [16 + parameters, 16 + 3 * parameters]  # output (1, 4) float32 + params


def test_balancing_takes_nested_inputs() -> None:
    class Pair(nn.Module):
        def forward(self, pair: dict[str, Tensor]) -> Tensor:
            return pair["a"] * pair["b"]

    model = nn.Sequential(Pair(), nn.Linear(3, 3), nn.Linear(3, 3))
    sample = {"a": torch.randn(4, 3), "b": torch.randn(4, 3)}
    assert sum(balance_by_time(2, model, sample, timeout=0.01, device="cpu")) == 3
    assert sum(balance_by_size(2, model, sample, device="cpu")) == 3


def test_balancing_rejects_bad_arguments() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(2, 2)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 partitions"):
        balance_by_time(3, model, x, device="cpu")
    with pytest.raises(ValueError, match="timeout must be a finite positive number"):
        balance_by_time(2, model, x, timeout=0, device="cpu")
    with pytest.raises(ValueError, match="chunks must be a positive number of micro-batches"):
        balance_by_size(2, model, x, chunks=0, device="cpu")
    with pytest.raises(ValueError, match="param_scale must be a finite non-negative number"):
        balance_by_size(2, model, x, param_scale=-1.0, device="cpu")
    with pytest.raises(TypeError, match=r"balancing takes an nn\.Sequential"):
        balance_by_size(1, nn.Linear(2, 2), x, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is the meta device"):
        balance_by_size(2, model, x, device="meta")
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for balance in (balance_by_time, balance_by_size):
        with pytest.raises(ValueError, match=r"on the meta device.*balance by hand"):
            balance(2, meta, x)
        # By time, zero-row layers were timed and a balance returned.
        with pytest.raises(ValueError, match="is an empty batch"):
            balance(2, model, torch.randn(0, 2), device="cpu")
        # The sample on meta failed in the first layer with torch's bare message.
        with pytest.raises(ValueError, match="sample, which is on the meta device"):
            balance(2, model, torch.empty(4, 2, device="meta"), device="cpu")
        # What GPipe refuses, balancing refuses alike (it profiled a chain of layers that
        # the subclass's forward does not run).
        with pytest.raises(TypeError, match="has a forward of its own"):
            balance(2, _Residual(nn.Linear(2, 2), nn.Linear(2, 2)), x, device="cpu")
        twice = nn.Linear(2, 2)
        with pytest.raises(ValueError, match="layer 1 is the same module as layer 0"):
            balance(2, nn.Sequential(twice, twice), x, device="cpu")


class _Residual(nn.Sequential):
    def forward(self, x: Tensor) -> Tensor:
        return x + super().forward(x)


def test_balancing_takes_numpy_integers() -> None:
    # GPipe takes NumPy integers for chunks, and so did torchgpipe 0.0.7's balancing;
    # ours refused them ("partitions must be a positive int, got np.int64(2)").
    import numpy as np

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(4, 2)
    balance = balance_by_time(np.int64(2), model, x, timeout=0.01, device="cpu")  # type: ignore[arg-type]
    assert sum(balance) == 3
    assert len(balance) == 2
    balance = balance_by_size(
        np.int32(3), model, x, chunks=np.int64(2), device="cpu",  # type: ignore[arg-type]
    )  # fmt: skip
    assert balance == [1, 1, 1]
    assert all(type(n) is int for n in balance)
    assert solve([1.0, 2.0, 3.0], np.int8(2)) == [2, 1]  # type: ignore[arg-type]


@pytest.mark.parametrize("by", ["time", "size"])
def test_balancing_draws_nothing_from_the_process_wide_generators(by: str) -> None:
    # Dropout in the profiled layers drew from the default generator, balance_by_time
    # as many times as its timing passes: what a program drew after balancing depended
    # on the machine's speed. Profiling draws from generators of its own.
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    if by == "time":
        balance_by_time(2, model, x, timeout=0.01, device="cpu")
    else:
        balance_by_size(2, model, x, device="cpu")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("bad", [True, 2.0, "2", None])
def test_balancing_refuses_partitions_that_are_not_integers(bad: object) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=f"partitions must be an int, got {bad!r}"):
        balance_by_time(bad, model, torch.randn(2, 2), device="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, 2.5, "2", None])
def test_balancing_refuses_chunks_that_are_not_integers(bad: object) -> None:
    # chunks is checked as GPipe checks it (GPipe also takes a whole float, as 0.0.7 did).
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=f"chunks must be an int, got {bad!r}"):
        balance_by_size(2, model, torch.randn(2, 2), chunks=bad, device="cpu")  # type: ignore[arg-type]


def test_balancing_refuses_partitions_that_are_not_positive() -> None:
    import numpy as np

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(2, 2)
    for bad in (0, -1, np.int64(0)):
        with pytest.raises(ValueError, match=f"partitions must be a positive int, got {bad}"):
            balance_by_size(bad, model, x, device="cpu")  # type: ignore[arg-type]


def test_balance_public_names() -> None:
    assert sorted(torchgpipe.balance.__all__) == ["balance_by_size", "balance_by_time"]


@pytest.mark.cuda
def test_balancing_on_cuda_leaves_the_model_on_its_device() -> None:
    model = _mixed_model()
    x = torch.randn(6, 4)
    assert sum(balance_by_time(2, model, x, timeout=0.01, device="cuda")) == len(model)
    assert sum(balance_by_size(2, model, x, device="cuda")) == len(model)
    assert all(p.device.type == "cpu" for p in model.parameters())


class _Shift(nn.Module):
    """Embeds ids after adding one to them in place (as some tokenizer layers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 4)

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids.add_(1))


@pytest.mark.parametrize("by", ["time", "size"])
def test_balancing_leaves_an_integer_sample_as_it_was(by: str) -> None:
    model = nn.Sequential(_Shift(), nn.Linear(4, 4), nn.Tanh())
    ids = torch.zeros(8, dtype=torch.long)
    if by == "time":
        balance_by_time(2, model, ids, timeout=0.05)
    else:
        balance_by_size(2, model, ids, chunks=2)
    assert torch.equal(ids, torch.zeros(8, dtype=torch.long))


def test_balance_by_size_takes_lazy_layers() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(4))
    assert sum(balance_by_size(2, model, torch.randn(8, 3), chunks=2)) == 3


class _CountedLazy(nn.LazyLinear):
    """A lazy layer that counts how often it makes its parameters."""

    made = 0

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        _CountedLazy.made += 1  # not type(self): made, it becomes an nn.Linear
        super().initialize_parameters(input)


class _CountedCalls(nn.Module):
    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        _CountedCalls.calls += 1
        return x


def test_balance_by_time_times_a_lazy_layer_made_once() -> None:
    # Each pass copied the lazy model's layer anew, which made (and initialized) its
    # weights inside the timed region at every pass: a lazy layer timed 3.7 times its
    # eager twin. Its copy from the warm-up, weights made, is the one timed now.
    _CountedLazy.made = _CountedCalls.calls = 0
    model = nn.Sequential(_CountedLazy(8), _CountedCalls())
    balance_by_time(2, model, torch.randn(4, 3), timeout=0.05, device="cpu")
    assert _CountedCalls.calls >= 3  # the warm-up and timed passes
    assert _CountedLazy.made == 1
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)  # left alone


class _ToSparse(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to_sparse()


class _ToDense(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to_dense()


def test_balancing_takes_sparse_tensors_between_layers() -> None:
    # GPipe passes them; balancing failed on them (ones_like of a sparse tensor; the
    # storage of one, which it has not).
    model = nn.Sequential(nn.Linear(4, 4), _ToSparse(), _ToDense(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    assert sum(balance_by_time(2, model, x, timeout=0.01, device="cpu")) == 4
    assert sum(balance_by_size(2, model, x, device="cpu")) == 4
    sizes = profile.layerwise_size(model, x, chunks=1, param_scale=0, device=torch.device("cpu"))
    sparse = torch.randn(3, 4).to_sparse()  # the sparse layer's output: its two storages
    assert sizes[1] == sum(
        t.untyped_storage().nbytes() for t in (sparse._indices(), sparse._values())
    )


@skippable(pop=["skip"])
class _PopDoubleInPlace(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip.mul_(2)


@pytest.mark.parametrize("by", ["time", "size"])
def test_balancing_takes_a_layer_that_changes_its_popped_skip_in_place(by: str) -> None:
    model = nn.Sequential(StashLinear(), nn.Linear(4, 4), _PopDoubleInPlace())
    x = torch.randn(8, 4)
    if by == "time":
        assert sum(balance_by_time(2, model, x, timeout=0.05)) == 3
    else:
        assert sum(balance_by_size(2, model, x, chunks=2)) == 3


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, "1", None, True])
def test_balance_by_time_refuses_a_timeout_not_finite_positive(timeout: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite positive number"):
        balance_by_time(1, nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2), timeout=timeout)


@pytest.mark.parametrize("scale", [-1.0, math.inf, math.nan, "2", None])
def test_balance_by_size_refuses_a_param_scale_not_finite_non_negative(scale: Any) -> None:
    with pytest.raises(ValueError, match="param_scale must be a finite non-negative number"):
        balance_by_size(1, nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2), param_scale=scale)


@skippable(stash=["skip"])
class _StashBig(nn.Module):
    """Stashes a large tensor made from its input, and passes the input on."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x.repeat(1, 1000))
        return x


@skippable(pop=["skip"])
class _PopSum(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip.sum()


def test_balance_by_size_counts_the_skips_a_layer_stashes() -> None:
    model = nn.Sequential(_StashBig(), nn.Linear(4, 4), _PopSum())
    sizes = profile.layerwise_size(
        model, torch.randn(8, 4), chunks=1, param_scale=0.0, device=torch.device("cpu")
    )
    assert sizes[0] >= 8 * 4000 * 4  # the stashed (8, 4000) float tensor


def _frozen_then_trained() -> nn.Sequential:
    frozen = [nn.Linear(64, 64), Counted(), nn.Linear(64, 64), Counted()]
    for layer in frozen:
        layer.requires_grad_(False)
    return nn.Sequential(*frozen, nn.Linear(64, 64), nn.Linear(64, 64))


def test_profiling_runs_no_backward_that_training_would_not() -> None:
    # The bug: every layer's input was made to want a gradient, so frozen layers were
    # timed with a backward (and counted with the tensors it saves) that training never
    # runs, and the balances were off for models with a frozen part.
    model, sample = _frozen_then_trained(), torch.randn(32, 64)
    Count.calls = 0
    profile.layerwise_time(model, sample, timeout=0.01, device=torch.device("cpu"))
    assert Count.calls == 0
    model(sample).sum().backward()  # the plain model's training step: none either
    assert Count.calls == 0
    wanting = torch.randn(32, 64, requires_grad=True)  # an input wanting one: there
    profile.layerwise_time(model, wanting, timeout=0.01, device=torch.device("cpu"))
    assert Count.calls > 0


def test_a_frozen_layer_fed_no_gradient_saves_nothing_in_its_size() -> None:
    model, sample = _frozen_then_trained(), torch.randn(32, 64)
    sizes = profile.layerwise_size(
        model, sample, chunks=1, param_scale=2.0, device=torch.device("cpu")
    )
    output, params = 32 * 64 * 4, (64 * 64 + 64) * 4
    assert sizes[0] == output + params  # its output, and its frozen parameters once
    # A trained layer: the input it saves is the previous layer's output, counted there.
    assert sizes[4] == output + 2 * params


def test_timing_keeps_no_skip_from_pass_to_pass() -> None:
    # The bug: every pass's stashed skips stayed in the profiler until it returned.
    kept: list[int] = []
    original = profile._DetachingTracker.stash

    def stash(self: Any, key: Any, tensor: Tensor | None) -> None:
        original(self, key, tensor)
        kept.append(len(self.stashed))

    model = nn.Sequential(StashLinear(), nn.Linear(4, 4), PopAdd())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile._DetachingTracker, "stash", stash)
        profile.layerwise_time(model, torch.randn(2, 4), timeout=0.05, device=torch.device("cpu"))
    assert len(kept) > 2
    assert max(kept) == 1


@skippable(stash=["skip"])
class _StashesAComputedSkip(nn.Module):
    """Returns its input; stashes a linear map of it, whose backward only the pop starts."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", Count.apply(self.linear(x)))
        return x


def test_timing_runs_the_backward_of_what_a_layer_stashes() -> None:
    # The bug: only the layer's outputs started its backward, so the work on the way to
    # its skips, which training runs every step, was never timed.
    model = nn.Sequential(_StashesAComputedSkip(), nn.Linear(4, 4), PopAdd())
    Count.calls = 0
    profile.layerwise_time(model, torch.randn(2, 4), timeout=0.01, device=torch.device("cpu"))
    assert Count.calls > 0


class _SavesForBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        for _ in range(4):
            x = x.exp().neg()  # each exp saves its result for the backward
        return x


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_profiling_does_not_depend_on_the_callers_grad_mode(mode: str) -> None:
    # Training records a graph whatever mode balancing is called in.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _SavesForBackward(), nn.Linear(16, 16))
    cpu = torch.device("cpu")
    expected = profile.layerwise_size(
        model, torch.randn(32, 16), chunks=1, param_scale=2.0, device=cpu
    )
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        sample = torch.randn(32, 16)
        sizes = profile.layerwise_size(model, sample, chunks=1, param_scale=2.0, device=cpu)
        assert balance_by_time(2, model, sample, timeout=0.05) in ([1, 2], [2, 1])
    assert sizes == expected


@pytest.mark.parametrize("by", ["time", "size"])
def test_a_layer_that_fails_while_profiled_is_named(by: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(5, 4))
    balance = balance_by_time if by == "time" else balance_by_size
    with pytest.raises(RuntimeError) as info:
        balance(2, model, torch.randn(8, 4))
    assert f"raised in layer 2 (Linear) of the module, run on its own by balance_by_{by}" in (
        "".join(info.value.__notes__)
    )


def test_a_layer_that_cannot_be_copied_for_profiling_is_named() -> None:
    class Unpicklable(nn.Linear):
        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise TypeError("no copies of this one")

    model = nn.Sequential(nn.Linear(4, 4), Unpicklable(4, 4))
    with pytest.raises(TypeError, match="no copies") as info:
        balance_by_size(2, model, torch.randn(8, 4))
    assert "while copying layer 1 (Unpicklable)" in "".join(info.value.__notes__)
