"""Models built on the meta device: each partition (each process) allocates its own layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from distributed_helpers import mlp, run_threads
from helpers import Versioned
from split_models import ReadsProjection, ReadsTiedHead, WithUnused
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, Schedule1F1B, split
from torchgpipe.distributed import PipelineStage, RemoteError, Transport
from torchgpipe.materialize import on_meta


def _on_meta(seed: int = 0) -> nn.Sequential:
    with torch.device("meta"):
        return mlp(seed)


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


class Positions(nn.Module):
    """A buffer computed in the constructor, with no reset_parameters to compute it again."""

    def __init__(self, persistent: bool = True) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=persistent)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.table


def test_a_meta_model_loads_the_plain_models_state_dict_and_computes_the_same() -> None:
    plain = mlp()
    model = GPipe(_on_meta(), [3, 5], chunks=2, state_dict=plain.state_dict())
    assert not on_meta(model)
    x = torch.randn(6, 4)
    out = model(x)
    torch.testing.assert_close(out, plain(x))
    out.square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert model.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("deferred", [False, True])
def test_a_meta_model_is_reset_by_its_modules_own_reset_parameters(deferred: bool) -> None:
    # BatchNorm's running statistics are buffers its reset fills: torch's own class (and
    # DeferredBatchNorm, this library's), so known to.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = GPipe(layers, [2, 2], chunks=2, deferred_batch_norm=deferred)
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    bound = 1 / 4**0.5  # a Linear's reset draws its weight within 1 / sqrt(fan_in)
    assert 0 < model[0].weight.abs().max() <= bound
    torch.testing.assert_close(model[1].running_var, torch.ones(8))
    torch.testing.assert_close(model[1].weight, torch.ones(8))
    assert int(model[1].num_batches_tracked) == 0


def test_attention_is_reset_children_first_as_its_constructor_does() -> None:
    # MultiheadAttention names its reset _reset_parameters, and zeroes the bias of its
    # child out_proj after the child's own reset: the order of the constructors.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    model = GPipe(layers, [1, 1])
    attention = model[1]
    assert attention.in_proj_weight.abs().sum() > 0
    torch.testing.assert_close(attention.out_proj.bias, torch.zeros(8))
    torch.testing.assert_close(attention.in_proj_bias, torch.zeros(24))


def test_init_fills_each_layer() -> None:
    seen: list[type] = []

    def init(layer: nn.Module) -> None:
        seen.append(type(layer))
        for p in layer.parameters():
            p.fill_(0.5)

    model = GPipe(_on_meta(), [4, 4], init=init)
    assert seen == [type(layer) for layer in mlp() if list(layer.parameters())]  # the Linears
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_what_cannot_be_filled_is_refused_by_name() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), Positions())
    with pytest.raises(
        ValueError, match=r"nothing is known to fill 1\.table \(Positions: it has no"
    ):
        GPipe(layers, [1, 1])
    assert on_meta(layers[0])  # a refusal leaves the model as it was
    # A persistent buffer comes from the state dict; one outside it cannot.
    plain = nn.Sequential(nn.Linear(4, 4), Positions())
    model = GPipe(layers, [1, 1], state_dict=plain.state_dict())
    torch.testing.assert_close(model[1].table, torch.arange(4.0))
    with torch.device("meta"):
        unsaved = nn.Sequential(nn.Linear(4, 4), Positions(persistent=False))
    with pytest.raises(ValueError, match=r"1\.table"):
        GPipe(unsaved, [1, 1], state_dict=plain.state_dict())


class _Counted(nn.Linear):
    resets = 0

    def reset_parameters(self) -> None:
        type(self).resets += 1
        super().reset_parameters()


class _NeedsStd(nn.Module):
    """A module whose reset needs the argument its constructor gave it."""

    def __init__(self, std: float = 0.02) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters(std)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.w, std=std)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


def test_a_state_dict_that_holds_a_layer_spares_its_resets() -> None:
    # Every reset ran, then the load overwrote it: time thrown away (seconds for an
    # orthogonal init of large layers), and a reset that needs arguments failed.
    plain = nn.Sequential(_Counted(4, 4), nn.Tanh(), _NeedsStd(), _Rotary(fills=True))
    with torch.device("meta"):
        meta = nn.Sequential(_Counted(4, 4), nn.Tanh(), _NeedsStd(), _Rotary(fills=True))
    _Counted.resets = 0
    model = GPipe(meta, [2, 2], state_dict=plain.state_dict())
    assert _Counted.resets == 0
    torch.testing.assert_close(model[2].w, plain[2].w)
    torch.testing.assert_close(model[3].linear.weight, plain[3].linear.weight)
    # In no state dict: the reset above it runs, and the load then wins.
    torch.testing.assert_close(model[3].frequencies, torch.arange(1.0, 5.0))


def test_a_reset_that_needs_arguments_is_named_when_it_must_run() -> None:
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), _NeedsStd())
    with pytest.raises(TypeError) as info:
        GPipe(meta, [1, 1])
    assert any("reset_parameters() of _NeedsStd in layer 1" in n for n in info.value.__notes__)
    assert on_meta(meta[1])  # put back


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"state_dict": {}}, r"the state dict has no 0\.bias, 0\.weight"),
        (
            {"state_dict": {**mlp().state_dict(), "0.weight": torch.zeros(3, 3)}},
            r"0\.weight has shape \(3, 3\) in the state dict but \(8, 4\)",
        ),
        ({"init": lambda layer: None, "state_dict": {}}, "pass init or state_dict, not both"),
    ],
)
def test_bad_state_dicts_are_refused(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPipe(_on_meta(), [4, 4], **arguments)


def test_meta_arguments_are_refused_for_a_model_with_values() -> None:
    with pytest.raises(ValueError, match="fill layers built on the meta device"):
        GPipe(mlp(), [4, 4], state_dict=mlp().state_dict())


def test_a_layer_half_on_the_meta_device_is_refused() -> None:
    layer = nn.Linear(4, 4)
    with torch.device("meta"):
        layer.bias = nn.Parameter(torch.empty(4))
    with pytest.raises(ValueError, match="layer 0 holds tensors on the meta device and others"):
        GPipe(nn.Sequential(layer, nn.ReLU()), [1, 1])


def test_each_process_allocates_only_its_own_layers_and_trains_as_the_plain_model() -> None:
    plain = mlp()
    models = [_on_meta() for _ in range(2)]
    x, y = torch.randn(6, 4), torch.randn(6, 4)

    def rank(transport: Transport) -> Any:
        model = models[transport.rank]
        stage = PipelineStage(
            model, [4, 4], transport=transport, chunks=2, state_dict=plain.state_dict()
        )
        mine = {name for name, _ in stage.named_children()}
        others = [layer for name, layer in model.named_children() if name not in mine]
        assert not on_meta(stage)
        assert all(on_meta(layer) for layer in others if list(layer.parameters()))
        result = Schedule1F1B(stage, _mse).step(x if stage.is_first else None, y)
        return result.loss, {n: p.grad for n, p in stage.named_parameters()}

    (loss0, grads0), (loss1, grads1) = run_threads(rank, 2)
    loss = _mse(plain(x), y)
    loss.backward()
    torch.testing.assert_close(loss0, loss.detach())
    torch.testing.assert_close(loss1, loss.detach())
    grads = {**grads0, **grads1}
    assert grads.keys() == {n for n, _ in plain.named_parameters()}
    for name, q in plain.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=name)


# The checkpoint recipe of the README: each rank saves its own layers under the plain
# model's keys; the files merged load into the plain model, into one process, or into
# a run with another balance.


def test_checkpoints_of_a_run_load_anywhere(tmp_path: Any) -> None:
    plain = mlp()
    models = [mlp() for _ in range(2)]  # here: mlp() seeds the generator threads share
    x, y = torch.randn(6, 4), torch.randn(6, 4)

    def train_and_save(transport: Transport) -> None:
        stage = PipelineStage(models[transport.rank], [4, 4], transport=transport, chunks=2)
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
        Schedule1F1B(stage, _mse).step(x if stage.is_first else None, y)
        optimizer.step()
        torch.save(stage.state_dict(), tmp_path / f"rank{transport.rank}.pt")

    assert run_threads(train_and_save, 2) == [None, None]
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    _mse(plain(x), y).backward()
    optimizer.step()

    merged: dict[str, Tensor] = {}
    for path in sorted(tmp_path.glob("rank*.pt")):
        merged.update(torch.load(path))
    # Into the plain model, with strict key checking.
    restored = mlp(seed=1)
    restored.load_state_dict(merged)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value, msg=key)
    # Into one process, built on the meta device.
    model = GPipe(_on_meta(), [2, 2, 4], chunks=3, state_dict=merged)
    torch.testing.assert_close(model(x), plain(x))

    # Into a run of four processes with another balance: each loads its own layers.
    metas = [_on_meta() for _ in range(4)]

    def resume(transport: Transport) -> Tensor:
        stage = PipelineStage(
            metas[transport.rank], [2, 2, 2, 2], transport=transport, chunks=2, state_dict=merged
        )
        return Schedule1F1B(stage, _mse).step(x if stage.is_first else None, y).loss

    losses = run_threads(resume, 4)
    expected = _mse(plain(x), y).detach()
    for loss in losses:
        torch.testing.assert_close(loss, expected)


# Ties inside a partition: to_empty() gives each holder of a tensor a new one, so
# materialize puts the first holder's back in every holder (one tensor, filled once).


class _Pair(nn.Module):
    """Two Linears of one layer that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Wrap(nn.Module):
    """A layer around a module that another layer may hold too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.inner(x))


def _tied(kind: str) -> nn.Sequential:
    """A model of four layers whose tie lies inside the first two-layer (or three) partition."""
    torch.manual_seed(0)
    if kind == "pair":
        return nn.Sequential(_Pair(), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    if kind == "shared module":
        inner = nn.Linear(4, 4)
        return nn.Sequential(_Wrap(inner), _Wrap(inner), nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    if kind == "head":  # layer 2 uses layer 0's weight, in the same partition
        model[2].weight = model[0].weight
    else:  # "albert": every layer shares one weight, inside and across partitions
        for layer in model[1:]:
            layer.weight = model[0].weight
    return model


def _meta_tied(kind: str) -> nn.Sequential:
    with torch.device("meta"):
        return _tied(kind)


def _same_tensor(module: nn.Module, names: list[str]) -> bool:
    tensors = dict(module.named_parameters(remove_duplicate=False))
    return all(tensors[name] is tensors[names[0]] for name in names)


TIES = {  # kind: its balance, and names that must hold one tensor in partition 0
    "head": ([3, 1], ["0.weight", "2.weight"]),
    "albert": ([2, 2], ["0.weight", "1.weight"]),
    "pair": ([2, 2], ["0.a.weight", "0.b.weight"]),
    "shared module": ([2, 2], ["0.inner.weight", "1.inner.weight"]),
}


@pytest.mark.parametrize("kind", sorted(TIES))
@pytest.mark.parametrize("fill", ["state_dict", "reset", "init"])
def test_a_tie_inside_a_partition_stays_one_tensor_in_gpipe(kind: str, fill: str) -> None:
    balance, names = TIES[kind]
    plain = _tied(kind)
    options: dict[str, Any] = {
        "state_dict": {"state_dict": plain.state_dict()},
        "reset": {},
        "init": {"init": lambda layer: [p.normal_() for p in layer.parameters()]},
    }[fill]
    model = GPipe(_meta_tied(kind), balance, chunks=2, **options)
    assert _same_tensor(model, names)
    if fill != "state_dict":
        return
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    _mse(model(x), y).backward()
    _mse(plain(x), y).backward()
    got = dict(model.named_parameters(remove_duplicate=False))
    for name, q in plain.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name].grad, q.grad, msg=name)


@pytest.mark.parametrize("kind", sorted(TIES))
def test_a_tie_inside_a_stage_stays_one_tensor_across_processes(kind: str) -> None:
    balance, names = TIES[kind]
    plain = _tied(kind)
    models = [_meta_tied(kind) for _ in range(2)]
    x, y = torch.randn(6, 4), torch.randn(6, 4)

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank],
            balance,
            transport=transport,
            chunks=2,
            state_dict=plain.state_dict(),
        )
        tied = _same_tensor(stage, names) if stage.is_first else True
        Schedule1F1B(stage, _mse).step(x if stage.is_first else None, y)
        grads = {n: p.grad for n, p in stage.named_parameters(remove_duplicate=False)}
        return tied, grads

    (tied0, grads0), (_, grads1) = run_threads(rank, 2)
    assert tied0
    _mse(plain(x), y).backward()
    grads = {**grads0, **grads1}
    for name, q in plain.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name], q.grad, msg=name)


# The legacy hook-based norms keep their values in weight_orig, weight_u, ... (weight_g,
# weight_v), which reset_parameters() does not fill: it writes the derived weight.


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    ("norm", "hook"),
    [(nn.utils.spectral_norm, "spectral_norm"), (nn.utils.weight_norm, "weight_norm")],
)
def test_legacy_norm_hooks_need_init_or_a_state_dict(norm: Callable[..., Any], hook: str) -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), norm(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=rf"1 \(Linear under torch\.nn\.utils\.{hook}\)"):
        GPipe(layers, [1, 1])
    assert on_meta(layers[0])  # a refusal leaves the model as it was
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), norm(nn.Linear(4, 4))).eval()
    model = GPipe(layers, [1, 1], state_dict=plain.state_dict()).eval()
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), plain(x))


# What nothing is known to fill is refused up front: torch.empty would leave it garbage.


class _MaskedLinear(nn.Linear):
    """A subclass that adds a buffer, which the Linear reset it inherits leaves alone."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("mask", torch.ones(4, 4).tril())


class _Rotary(nn.Module):
    """A reset of its own, for its Linear and (``fills``) its buffer out of state dicts."""

    def __init__(self, fills: bool = False) -> None:
        super().__init__()
        self.fills = fills
        self.linear = nn.Linear(4, 4)
        self.register_buffer("frequencies", torch.arange(1.0, 5.0), persistent=False)

    def reset_parameters(self) -> None:
        self.linear.reset_parameters()
        if self.fills:
            self.frequencies.copy_(torch.arange(1.0, 5.0))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.frequencies


def test_a_buffer_of_a_users_class_is_refused_when_torchs_reset_leaves_it() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(_MaskedLinear(), nn.Linear(4, 4))
    with pytest.raises(
        ValueError, match=r"reset_parameters\(\) left 0\.mask as allocated"
    ) as refused:
        GPipe(layers, [1, 1])
    assert "pass init=" in str(refused.value)
    assert "0.weight" not in str(refused.value)  # the reset fills that


class _BatchNormAct(nn.BatchNorm1d):
    """A user's subclass of a torch class that adds nothing to fill: torch's reset does."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(super().forward(x))


class _DataFill(nn.Module):
    """A reset that writes its buffer through ``.data``, which moves no version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("mask", torch.empty(3))

    def reset_parameters(self) -> None:
        self.weight.data.fill_(1.0)
        self.mask.data.fill_(2.0)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight * self.mask


def test_resets_that_fill_a_users_buffers_their_own_way_are_accepted() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(_BatchNormAct(3), _DataFill())
    model = GPipe(layers, [1, 1])
    torch.testing.assert_close(model[0].running_mean, torch.zeros(3))
    torch.testing.assert_close(model[0].running_var, torch.ones(3))
    torch.testing.assert_close(model[1].mask, torch.full((3,), 2.0))


def test_a_users_own_reset_is_trusted_with_its_buffers_and_checked() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), _Rotary(fills=True))
    model = GPipe(layers, [1, 1])
    torch.testing.assert_close(model[1].frequencies, torch.arange(1.0, 5.0))
    # A reset that leaves its buffer as allocated is caught once it has run.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), _Rotary())
    with pytest.raises(ValueError, match=r"reset_parameters\(\) left 1\.frequencies as allocated"):
        GPipe(layers, [1, 1])
    # A state dict never holds the buffer (persistent=False): the check still applies.
    plain = nn.Sequential(nn.Linear(4, 4), _Rotary())
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), _Rotary())
    with pytest.raises(ValueError, match=r"left 1\.frequencies as allocated"):
        GPipe(layers, [1, 1], state_dict=plain.state_dict())


def test_what_a_reset_cannot_fill_comes_from_init_a_state_dict_or_a_real_layer() -> None:
    with torch.device("meta"):
        masked = nn.Sequential(_MaskedLinear(), nn.Tanh())
    model = GPipe(masked, [1, 1], state_dict=nn.Sequential(_MaskedLinear()).state_dict())
    torch.testing.assert_close(model[0].mask, torch.ones(4, 4).tril())
    with torch.device("meta"):
        layers = nn.Sequential(_MaskedLinear(), _Rotary())
    # init must fill every tensor of the layer it is given, the weights as the buffers.
    model = GPipe(layers, [1, 1], init=_fills_every_tensor(2.0))
    torch.testing.assert_close(model[1].frequencies, torch.full((4,), 2.0))
    torch.testing.assert_close(model[0].weight.detach(), torch.full((4, 4), 2.0))
    # A layer built with values is kept as it is, its neighbours made from meta.
    with torch.device("meta"):
        first = nn.Linear(4, 4)
    model = GPipe(nn.Sequential(first, _Rotary()), [1, 1])
    torch.testing.assert_close(model[1].frequencies, torch.arange(1.0, 5.0))


class _ScaledLinear(nn.Linear):
    """A subclass that adds a parameter (LoRA-style), which Linear's reset leaves alone."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


class _Block(nn.Module):
    """A reset of its own that resets its child and forgets its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.ones(4))

    def reset_parameters(self) -> None:
        self.linear.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.gamma


def _with_buffer() -> nn.Linear:
    linear = nn.Linear(4, 4)
    linear.register_buffer("mask", torch.ones(4, 4).tril())  # on torch's own class
    return linear


def _half_filled() -> _Rotary:
    rotary = _Rotary()
    rotary.reset_parameters = lambda: rotary.frequencies[0].fill_(1.0)  # type: ignore[method-assign]
    return rotary


@pytest.mark.parametrize(
    ("build", "left"),
    [
        (_ScaledLinear, "0.scale"),
        (_Block, "0.gamma"),
        (_with_buffer, "0.mask"),
        (_half_filled, "0.frequencies"),
    ],
)
def test_a_tensor_a_reset_leaves_as_allocated_is_refused_whatever_holds_it(
    build: Callable[[], nn.Module], left: str
) -> None:
    # Resets are trusted with nothing: every tensor they should fill is checked.
    with torch.device("meta"):
        layers = nn.Sequential(build(), nn.Tanh())
    with pytest.raises(ValueError, match=rf"left {left} as allocated"):
        GPipe(layers, [1, 1])


def test_a_pruned_layer_needs_init_or_a_state_dict() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        torch.nn.utils.prune.identity(layers[0], "weight")
    with pytest.raises(ValueError, match=r"0 \(Linear under torch\.nn\.utils\.prune\)"):
        GPipe(layers, [1, 1])
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    torch.nn.utils.prune.random_unstructured(plain[0], "weight", amount=0.5)
    model = GPipe(layers, [1, 1], state_dict=plain.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), plain(x))


class _Counts(nn.Module):
    """Integer and empty buffers, filled through ``.data`` or needing nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.register_buffer("ids", torch.empty(4, dtype=torch.long), persistent=False)
        self.register_buffer("cache", torch.empty(0), persistent=False)
        self.register_buffer("seen", torch.empty(4, dtype=torch.uint8), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        self.ids.data.copy_(torch.arange(4))  # moves no version counter
        self.seen.data.zero_()  # nor this: zeros, an unsigned tensor's lowest value

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight + self.ids


class _Alias(nn.Module):
    """A parent that holds its child's weight under a name of its own, with no reset."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.w = self.proj.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) + x @ self.w.t()


def test_integer_empty_and_aliased_tensors_are_filled_by_what_can_fill_them() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(_Counts(), _Alias())
    model = GPipe(layers, [1, 1])
    assert torch.equal(model[0].ids, torch.arange(4))
    assert torch.equal(model[0].seen, torch.zeros(4, dtype=torch.uint8))
    assert model[1].w is model[1].proj.weight  # one tensor, the child's reset filled it
    assert model[1].w.abs().max() < 1  # Linear's reset: U(-1/2, 1/2), not the mark
    assert not model[1].w.isnan().any()


class _Scaled(nn.Module):
    """A module whose extra state (not a parameter nor a buffer) is in its state dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.factor = 1.0

    def get_extra_state(self) -> Any:
        return {"factor": self.factor}

    def set_extra_state(self, state: Any) -> None:
        self.factor = state["factor"]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.factor


def test_a_state_dict_loads_as_load_state_dict_does() -> None:
    plain = nn.Sequential(_Scaled(), nn.BatchNorm1d(4), nn.Linear(4, 4))
    plain[0].factor = 3.0
    plain.train()(torch.randn(8, 4))
    saved = plain.state_dict()
    del saved["1.num_batches_tracked"]  # an older checkpoint: load_state_dict accepts it
    with torch.device("meta"):
        layers = nn.Sequential(_Scaled(), nn.BatchNorm1d(4))
    last = nn.Linear(4, 4)  # built with values among meta layers: loaded too
    model = GPipe(nn.Sequential(*layers, last), [1, 2], state_dict=saved).eval()
    assert model[0].factor == 3.0
    assert model[1].num_batches_tracked == 0
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), plain.eval()(x))


def test_a_state_dict_with_keys_the_model_lacks_or_no_values_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keys the model does not: 8\.weight, typo"):
        GPipe(
            _on_meta(),
            [4, 4],
            state_dict={**mlp().state_dict(), "8.weight": torch.ones(1), "typo": torch.ones(1)},
        )
    with pytest.raises(ValueError, match=r"on the meta device, with no values"):
        GPipe(_on_meta(), [4, 4], state_dict=_on_meta().state_dict())


def test_a_refusal_leaves_the_model_as_it_was_with_deferred_batch_norm() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Positions())
    with pytest.raises(ValueError, match=r"nothing is known to fill 2\.table"):
        GPipe(layers, [2, 1], deferred_batch_norm=True)
    assert type(layers[1]) is nn.BatchNorm1d


# A tied parameter: every holder ends with its first holder's values; a state dict may
# hold any of its names, the last present winning, as in load_state_dict (loaded_value).


class _Table(nn.Module):
    """A layer that holds a weight and has no reset_parameters()."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1) @ self.weight.t()


def _head_tied(head_resets: bool = False) -> nn.Sequential:
    """An embedding, a body, and a head tied to the embedding (with a reset, or none)."""
    embedding = nn.Embedding(11, 6)
    head: nn.Module = nn.Linear(6, 11, bias=False) if head_resets else _Table(embedding.weight)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Tanh(), nn.Linear(6, 6), head)


@pytest.mark.parametrize("balance", [[2, 2], [4]])
def test_a_head_tied_to_an_earlier_layer_needs_no_reset_of_its_own(balance: list[int]) -> None:
    with torch.device("meta"):
        layers = _head_tied()
    model = GPipe(layers, balance)
    torch.testing.assert_close(model[3].weight, model[0].weight, rtol=0, atol=0)
    assert model[0].weight.abs().max() > 0  # Embedding's reset: drawn from N(0, 1)


def test_the_first_holder_of_a_tied_parameter_must_be_filled() -> None:
    # The head's reset would fill it, but every holder ends with the first's values.
    with torch.device("meta"):
        table = _Table(nn.Parameter(torch.empty(11, 6)))
        head = nn.Linear(6, 11, bias=False)
        head.weight = table.weight
    with pytest.raises(ValueError, match=r"fill 0\.weight \(_Table: it has no reset") as refused:
        GPipe(nn.Sequential(table, nn.Tanh(), head), [2, 1])
    assert "2.weight" not in str(refused.value)


KEEPS = ["0.weight", "3.weight", "both, unequal"]


def _tied_checkpoint(keep: str) -> tuple[nn.Sequential, dict[str, Tensor]]:
    """A plain tied model that loaded a checkpoint keeping one name of the tie (or both)."""
    plain = _head_tied(head_resets=True)
    state = {key: value.clone() for key, value in plain.state_dict().items()}
    if keep == "both, unequal":
        state["3.weight"] = torch.full((11, 6), 7.0)
    else:
        del state[{"0.weight": "3.weight", "3.weight": "0.weight"}[keep]]
    plain.load_state_dict(state, strict=False)  # strict: it would want both names
    return plain, state


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("balance", [[2, 2], [4]])
def test_a_tie_fills_from_a_state_dict_as_load_state_dict_does(
    keep: str, balance: list[int]
) -> None:
    plain, state = _tied_checkpoint(keep)
    loaded = GPipe(_head_tied(head_resets=True), balance)
    loaded.load_state_dict(state, strict=False)  # [4]: no copies, so strict wants both names
    with torch.device("meta"):
        layers = _head_tied(head_resets=True)
    model = GPipe(layers, balance, state_dict=state)
    for name in ("0.weight", "3.weight"):
        torch.testing.assert_close(model.state_dict()[name], plain.state_dict()[name])
        torch.testing.assert_close(model.state_dict()[name], loaded.state_dict()[name])


@pytest.mark.parametrize("keep", [None, *KEEPS])
def test_every_rank_starts_a_tie_with_its_first_holders_values(keep: str | None) -> None:
    # The head, with no reset, on rank 1: its values come from rank 0's embedding.
    plain, state = _tied_checkpoint(keep) if keep else (None, None)
    with torch.device("meta"):
        models = [_head_tied() for _ in range(2)]

    def rank(transport: Transport) -> dict[str, Tensor]:
        stage = PipelineStage(models[transport.rank], [2, 2], transport=transport, state_dict=state)
        return dict(stage.state_dict())

    merged = {key: value for weights in run_threads(rank, 2) for key, value in weights.items()}
    torch.testing.assert_close(merged["3.weight"], merged["0.weight"], rtol=0, atol=0)
    for name, value in {} if plain is None else plain.state_dict().items():
        torch.testing.assert_close(merged[name], value, msg=name)


def test_a_refusal_once_building_began_puts_the_model_back_as_it_was() -> None:
    # A reset's failure is known only once it ran: layers before it are allocated by then.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _ScaledLinear(), nn.Tanh())
    weight = layers[0].weight
    with pytest.raises(ValueError, match=r"left 2\.scale as allocated"):
        GPipe(layers, [2, 2], deferred_batch_norm=True)
    assert type(layers[1]) is nn.BatchNorm1d
    assert layers[0].weight is weight
    assert weight.is_meta
    assert all(t.is_meta for t in [*layers.parameters(), *layers.buffers()])
    # An init over the parameters alone would now be refused: the batch norm's running
    # statistics are buffers, which init must fill too (here by the layer's own reset).
    model = GPipe(layers, [2, 2], init=_parameters_and_statistics(0.5))
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    torch.testing.assert_close(model[1].running_var, torch.ones(4))


def test_a_refusal_puts_an_rnns_flat_weights_back_with_its_parameters() -> None:
    # The parameters went back to meta, the flat weights an LSTM computes from stayed
    # on the CPU: memory held until the model was given again.
    with torch.device("meta"):
        layers = nn.Sequential(nn.LSTM(4, 4), _ScaledLinear())
    with pytest.raises(ValueError, match=r"left 1\.scale as allocated"):
        GPipe(layers, [1, 1])
    lstm = layers[0]
    assert all(w.is_meta for w in lstm._flat_weights)
    assert all(w is p for w, p in zip(lstm._flat_weights, lstm.parameters(), strict=True))


def _fills_every_tensor(value: float) -> Callable[[nn.Module], None]:
    def init(layer: nn.Module) -> None:
        for tensor in [*layer.parameters(), *layer.buffers()]:
            tensor.fill_(value)

    return init


def _parameters_and_statistics(value: float) -> Callable[[nn.Module], None]:
    """Fills the parameters with ``value``; a batch norm's statistics, as its reset does."""

    def init(layer: nn.Module) -> None:
        for parameter in layer.parameters():
            parameter.fill_(value)
        if isinstance(layer, nn.modules.batchnorm._NormBase):
            layer.reset_running_stats()

    return init


def test_a_stage_that_fails_to_start_leaves_every_processs_model_as_it_was() -> None:
    with torch.device("meta"):
        models = [
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Positions(), nn.Tanh())
            for _ in range(2)
        ]

    def rank(transport: Transport) -> Any:
        return PipelineStage(
            models[transport.rank], [2, 2], transport=transport, deferred_batch_norm=True
        )

    outcomes = run_threads(rank, 2, timeout=10.0)
    assert all(isinstance(outcome, Exception) for outcome in outcomes), outcomes
    for model in models:
        assert type(model[1]) is nn.BatchNorm1d
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


class _EmbeddingAndHead(nn.Module):
    """A tie inside one layer, as a language model's: the head takes the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(300, 16)
        self.head = nn.Linear(16, 300, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.embedding(x))


class _Replaces(nn.Module):
    """A tie inside one layer whose first holder has no reset and whose second
    replaces its parameter rather than filling it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.ParameterDict({"w": nn.Parameter(torch.empty(4, 4))})
        self.linear = nn.Linear(4, 4, bias=False)
        self.linear.weight = self.table["w"]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def _new_weight(linear: nn.Linear) -> None:
    linear.weight = nn.Parameter(torch.full_like(linear.weight, 0.25))


def test_a_tie_inside_a_layer_keeps_its_first_filled_holders_values() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        layers = nn.Sequential(_EmbeddingAndHead(), nn.Identity())
    model = GPipe(layers, [1, 1])
    weight = model[0].embedding.weight
    assert model[0].head.weight is weight
    assert 0.8 < float(weight.detach().std()) < 1.2  # Embedding's N(0, 1), not Linear's bound
    with torch.device("meta"):
        layers = nn.Sequential(_Replaces(), nn.Identity())
    layers[0].linear.reset_parameters = lambda: _new_weight(layers[0].linear)  # type: ignore[method-assign]
    model = GPipe(layers, [1, 1])
    assert model[0].table["w"] is model[0].linear.weight
    assert torch.equal(model[0].linear.weight, torch.full((4, 4), 0.25))


def test_a_parents_reset_runs_after_its_childrens_as_its_constructor_ran() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        layers = nn.Sequential(
            nn.Transformer(8, 2, 1, 1, 64, dropout=0.0, batch_first=True), nn.Identity()
        )
    model = GPipe(layers, [1, 1])
    weight = model[0].encoder.layers[0].linear1.weight  # (64, 8): xavier, not kaiming
    assert float(weight.detach().abs().max()) <= (6 / (8 + 64)) ** 0.5  # kaiming's: 8**-0.5


def test_a_split_model_with_a_tie_loads_the_plain_models_state_dict() -> None:
    from split_models import TinyGPT

    from torchgpipe import split

    torch.manual_seed(0)
    plain = TinyGPT()
    ids = torch.randint(0, 32, (4, 8))
    with torch.device("meta"):
        meta = split(TinyGPT(), ids.to("meta"), at=["blocks.1"])
    model = GPipe(meta, [1, 1], state_dict=plain.state_dict())
    torch.testing.assert_close(model(ids), plain(ids))


def test_a_refusal_puts_back_the_values_a_state_dict_loaded_into_real_layers() -> None:
    real = nn.Linear(4, 4)
    before = real.weight.detach().clone()
    with torch.device("meta"):
        rest = [nn.Linear(4, 4), _Rotary()]
    layers = nn.Sequential(real, *rest)
    saved = {k: torch.full_like(v, 7.0, device="cpu") for k, v in layers.state_dict().items()}
    with pytest.raises(ValueError, match=r"left 2\.frequencies as allocated"):
        GPipe(layers, [1, 2], state_dict=saved)
    assert torch.equal(real.weight, before)
    assert layers[0] is real


def test_a_parent_module_cannot_move_or_wipe_a_gpipe() -> None:
    model = GPipe(mlp(), [4, 4])
    parent = nn.ModuleDict({"pipe": model})
    for move in (lambda: parent.to("meta"), lambda: parent.to_empty(device="cpu")):
        with pytest.raises(TypeError, match="cannot be moved as a whole"):
            move()
    assert not any(p.is_meta for p in model.parameters())
    assert parent.to(torch.float64) is parent  # a dtype change still reaches it
    assert all(p.dtype == torch.float64 for p in model.parameters())


class _Scale(nn.Module):
    """A weight with no reset of its own: its parent's fills it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class _FillsChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = _Scale()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.scale.weight, 2.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale(x)


def test_a_parents_reset_may_fill_a_child_that_has_none() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(_FillsChild(), nn.Identity())
    model = GPipe(layers, [1, 1])
    torch.testing.assert_close(model[0].scale.weight.detach(), torch.full((4,), 2.0))


# A split model: what its forward reads directly, or never uses, is filled as any layer.


def _split_on_meta(build: Callable[[], nn.Module], example: Tensor, at: str) -> nn.Sequential:
    with torch.device("meta"):
        return split(build(), example.to("meta"), at=[at])


def _same_values(model: nn.Module, plain: nn.Module) -> None:
    assert list(model.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)


def _kaiming(weight: Tensor) -> bool:
    """Drawn by Linear's reset: finite, within 1/sqrt(fan_in)."""
    weight = weight.detach()
    return bool(weight.isfinite().all()) and float(weight.abs().max()) <= weight.size(1) ** -0.5


def test_a_split_models_tie_read_directly_is_filled_from_either_source() -> None:
    # head.weight was missing from the split model's keys: the state dict was refused.
    torch.manual_seed(0)
    plain, ids = ReadsTiedHead(), torch.randint(0, 11, (4, 5))
    model = GPipe(_split_on_meta(ReadsTiedHead, ids, "mid"), [1, 1], state_dict=plain.state_dict())
    _same_values(model, plain)
    torch.testing.assert_close(model(ids), plain(ids))
    model = GPipe(_split_on_meta(ReadsTiedHead, ids, "mid"), [1, 1])
    head, embedding = model.state_dict()["head.weight"], model.state_dict()["emb.weight"]
    assert head.isfinite().all()
    torch.testing.assert_close(head, embedding, rtol=0, atol=0)


def test_a_module_the_split_forward_reads_directly_is_filled_by_its_reset() -> None:
    # The stage held a bare Module at proj, refused as having no reset_parameters().
    torch.manual_seed(0)
    plain, x = ReadsProjection(), torch.randn(6, 4)
    model = GPipe(_split_on_meta(ReadsProjection, x, "b"), [1, 1])
    proj = model[1].get_submodule("proj")
    assert type(proj) is nn.Linear
    assert _kaiming(proj.weight)
    model = GPipe(_split_on_meta(ReadsProjection, x, "b"), [1, 1], state_dict=plain.state_dict())
    _same_values(model, plain)
    torch.testing.assert_close(model(x), plain(x))


class _ReadsAhead(nn.Module):
    """Reads b's weight and bias in a stage before the one that calls b."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(F.linear(self.a(x), self.b.weight, self.b.bias))


def test_a_tensor_read_in_a_stage_without_its_module_is_refused_by_the_modules_type() -> None:
    with pytest.raises(
        ValueError, match=r"fill b\.weight \(a Linear's, which a stage of the split model reads"
    ):
        GPipe(_split_on_meta(_ReadsAhead, torch.randn(2, 4), "b"), [1, 1])
    plain, x = _ReadsAhead(), torch.randn(2, 4)
    model = GPipe(_split_on_meta(_ReadsAhead, x, "b"), [1, 1], state_dict=plain.state_dict())
    torch.testing.assert_close(model(x), plain(x))


def test_what_the_split_forward_never_uses_is_filled_by_its_reset_or_the_state_dict() -> None:
    # aux, offset and unused_steps were held by no stage: the state dict was refused.
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    model = GPipe(_split_on_meta(lambda: WithUnused(tensors=False), x, "b"), [1, 1])
    assert _kaiming(model[1].get_submodule("aux").weight)
    with pytest.raises(
        ValueError, match=r"nothing is known to fill offset \(the split model's own"
    ):
        GPipe(_split_on_meta(WithUnused, x, "b"), [1, 1])  # the model's own: no reset
    plain = WithUnused()
    model = GPipe(_split_on_meta(WithUnused, x, "b"), [1, 1], state_dict=plain.state_dict())
    _same_values(model, plain)
    torch.testing.assert_close(model(x), plain(x))


# A buffer that two layers hold: every holder ends with its first holder's values.


class _Frequencies(nn.Module):
    """Fills its buffer in its own reset."""

    def __init__(self, persistent: bool = True) -> None:
        super().__init__()
        self.register_buffer("freq", torch.empty(4), persistent=persistent)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freq.copy_(torch.arange(4.0))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.freq


class _Reads(nn.Module):
    def __init__(self, freq: Tensor, persistent: bool = True) -> None:
        super().__init__()
        self.register_buffer("freq", freq, persistent=persistent)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.freq


class _ReadsUnder(nn.Module):
    """Holds the buffer in a child; its own reset fills its own weight only."""

    def __init__(self, freq: Tensor, persistent: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.reader = _Reads(freq, persistent)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.reader(x) * self.w


def _shares_a_buffer(persistent: bool = True) -> nn.Sequential:
    first = _Frequencies(persistent)
    return nn.Sequential(first, _ReadsUnder(first.freq, persistent))


@pytest.mark.parametrize("balance", [[1, 1], [2]])
def test_a_buffer_two_layers_hold_takes_its_first_holders_values(balance: list[int]) -> None:
    # [1, 1]: the second partition's copy was never filled, and used as it was allocated.
    plain, x = _shares_a_buffer(), torch.ones(2, 4)
    with torch.device("meta"):
        layers = _shares_a_buffer()
    model = GPipe(layers, balance)
    torch.testing.assert_close(model[1].reader.freq, torch.arange(4.0), rtol=0, atol=0)
    torch.testing.assert_close(model(x), plain(x))
    # From a state dict whose two names disagree: the last, as load_state_dict does.
    state = {**plain.state_dict(), "1.reader.freq": torch.full((4,), 5.0)}
    plain.load_state_dict(state)
    with torch.device("meta"):
        layers = _shares_a_buffer()
    model = GPipe(layers, balance, state_dict=state)
    _same_values(model, plain)
    torch.testing.assert_close(model(x), plain(x))


def test_a_buffer_whose_first_holder_is_on_another_rank_needs_a_state_dict() -> None:
    # Buffers do not travel between processes: rank 1 cannot take rank 0's values.
    plain = _shares_a_buffer()

    def build(state: dict[str, Tensor] | None) -> list[Any]:
        with torch.device("meta"):
            models = [_shares_a_buffer() for _ in range(2)]

        def rank(transport: Transport) -> dict[str, Tensor]:
            stage = PipelineStage(
                models[transport.rank], [1, 1], transport=transport, state_dict=state
            )
            return dict(stage.state_dict())

        return run_threads(rank, 2)

    first, second = build(None)
    assert isinstance(first, RemoteError)
    assert isinstance(second, ValueError)
    assert "1.reader.freq: each a buffer whose first holder is a layer of another" in str(second)
    assert "pass state_dict=" in str(second)
    first, second = build(plain.state_dict())
    torch.testing.assert_close(second["1.reader.freq"], torch.arange(4.0), rtol=0, atol=0)
    torch.testing.assert_close(first["0.freq"], torch.arange(4.0), rtol=0, atol=0)


def test_a_buffer_in_no_state_dict_whose_first_holder_is_on_another_rank_is_refused() -> None:
    # The refusal said to pass state_dict=, which never holds a persistent=False buffer.
    plain = _shares_a_buffer(persistent=False)
    with torch.device("meta"):
        models = [_shares_a_buffer(persistent=False) for _ in range(2)]

    def rank(transport: Transport) -> Any:
        return PipelineStage(
            models[transport.rank], [1, 1], transport=transport, state_dict=plain.state_dict()
        )

    first, second = run_threads(rank, 2)
    assert isinstance(first, RemoteError)
    assert isinstance(second, ValueError)
    assert "1.reader.freq: each a buffer whose first holder is a layer of another" in str(second)
    assert "persistent=False" in str(second)
    assert "pass state_dict=" not in str(second)


class _WithLazyAux(nn.Module):
    """A lazy head the forward never calls: its parameters are never initialized."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.aux = nn.LazyLinear(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_an_unused_lazy_module_of_a_split_meta_model_is_left_out() -> None:
    # The last stage held it, and the check of what fills it read its uninitialized
    # parameters' sizes: "Attempted to use an uninitialized parameter".
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    stages = _split_on_meta(_WithLazyAux, x, "b")
    assert list(stages.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    model = GPipe(stages, [1, 1])
    assert _kaiming(model[1].get_submodule("b").weight)
    plain = _WithLazyAux()
    state = {
        key: value for key, value in plain.state_dict().items() if key.startswith(("a.", "b."))
    }
    model = GPipe(_split_on_meta(_WithLazyAux, x, "b"), [1, 1], state_dict=state)
    torch.testing.assert_close(model(x), plain(x))


class _WithRealAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_what_split_left_out_may_be_in_the_state_dict_it_fills_from() -> None:
    # The bug: the plain model's own state dict was refused ("keys the model does not:
    # aux.bias, aux.weight") for a meta model whose unused head has values, which
    # split leaves out (a layer is all meta or all values).
    torch.manual_seed(0)
    plain = _WithRealAux()
    with torch.device("meta"):
        meta = _WithRealAux()
    meta.aux = nn.Linear(4, 3)  # the reverse of an unused head moved to meta
    stages = split(meta, torch.randn(6, 4, device="meta"), at=["b"])
    assert stages[0].left_out == ("aux.weight", "aux.bias")
    model = GPipe(stages, [1, 1], chunks=2, state_dict=plain.state_dict())
    x = torch.randn(6, 4)
    torch.testing.assert_close(model(x), plain(x))


# A module that two layers of one partition hold (not only a tied parameter): the
# second layer used to be allocated whole again (to_empty), its shared tensors left as
# uninitialized memory after the first layer had filled them.


class _Gain(nn.Module):
    """A weight its holder's reset fills; with ``resets``, one of its own too (zeros)."""

    def __init__(self, resets: bool) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.empty(4))
        if resets:
            self.reset_parameters = lambda: nn.init.zeros_(self.g)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.g


class _FillsGain(nn.Module):
    def __init__(self, gain: _Gain) -> None:
        super().__init__()
        self.linear, self.gain = nn.Linear(4, 4), gain
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain.g)

    def forward(self, x: Tensor) -> Tensor:
        return self.gain(self.linear(x))


class _ReusesGain(nn.Module):
    """A later layer that holds the same _Gain; with ``redraws``, a reset that writes it."""

    def __init__(self, gain: _Gain, redraws: bool) -> None:
        super().__init__()
        self.linear, self.gain = nn.Linear(4, 4), gain
        if redraws:
            self.reset_parameters = self._redraw

    def _redraw(self) -> None:
        self.linear.reset_parameters()
        nn.init.normal_(self.gain.g)

    def forward(self, x: Tensor) -> Tensor:
        return self.gain(self.linear(x))


def _shares_a_module(kind: str) -> nn.Sequential:
    gain = _Gain(resets=kind == "own reset")
    return nn.Sequential(_FillsGain(gain), _ReusesGain(gain, redraws=kind == "later reset"))


@pytest.mark.parametrize("kind", ["no reset", "own reset", "later reset"])
def test_a_module_two_layers_of_a_partition_hold_keeps_the_first_layers_values(
    kind: str,
) -> None:
    plain = _shares_a_module(kind)
    torch.full((1 << 16,), 123.0)  # junk in the allocator, where g was put before
    with torch.device("meta"):
        layers = _shares_a_module(kind)
    model = GPipe(layers, [2])
    assert model[0].gain is model[1].gain
    assert _kaiming(model[1].linear.weight)  # the later layer's own tensors are filled
    torch.testing.assert_close(model[0].gain.g, plain[0].gain.g, rtol=0, atol=0)


def test_init_of_a_later_layer_leaves_a_module_an_earlier_layer_filled() -> None:
    with torch.device("meta"):
        layers = _shares_a_module("no reset")
    given = iter([1.0, 2.0])  # the first layer's init fills 1, the second's 2
    model = GPipe(layers, [2], init=lambda layer: _fills_every_tensor(next(given))(layer))
    torch.testing.assert_close(model[0].gain.g.detach(), torch.ones(4))
    torch.testing.assert_close(model[1].linear.weight.detach(), torch.full((4, 4), 2.0))


def test_a_state_dict_without_a_modules_extra_state_is_refused() -> None:
    # It was accepted, and the module kept the extra state it was built with.
    plain = nn.Sequential(_Scaled(), nn.Identity())
    saved = {k: v for k, v in plain.state_dict().items() if not k.endswith("_extra_state")}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0\._extra_state"'):
        nn.Sequential(_Scaled(), nn.Identity()).load_state_dict(saved)
    with torch.device("meta"):
        layers = nn.Sequential(_Scaled(), nn.Identity())
    with pytest.raises(ValueError, match=r"the state dict has no 0\._extra_state;"):
        GPipe(layers, [1, 1], state_dict=saved)
    assert on_meta(layers)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("version", [2, 1])
def test_a_state_dict_loads_with_the_versions_its_metadata_records(
    version: int, nested: bool
) -> None:
    # The metadata was dropped: a current checkpoint was converted as an old one.
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Identity(), nn.Sequential(Versioned()) if nested else Versioned())

    plain = build()
    versioned = plain[1][0] if nested else plain[1]
    with torch.no_grad():
        versioned.g.fill_(5.0)
    saved = plain.state_dict()
    path = "1.0" if nested else "1"
    saved._metadata[path]["version"] = version  # type: ignore[attr-defined]  # torch's own
    loaded = build()
    loaded.load_state_dict(saved)
    with torch.device("meta"):
        layers = build()
    model = GPipe(layers, [1, 1], state_dict=saved)
    torch.testing.assert_close(model[1].state_dict(), loaded[1].state_dict(), rtol=0, atol=0)
    expected = torch.full((4,), 5.0 * (3 - version))
    torch.testing.assert_close(model.state_dict()[f"{path}.g"], expected)


def test_an_init_that_leaves_a_buffer_unfilled_is_refused() -> None:
    # Over the parameters alone, the batch norm's running statistics stayed garbage.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(
        ValueError,
        match=r"layer 1: init left 1\.running_mean, 1\.running_var, 1\.num_batches_tracked as "
        r"allocated .* call layer\.reset_running_stats\(\)",
    ):
        GPipe(layers, [2, 1], init=lambda layer: [p.fill_(0.5) for p in layer.parameters()])
    assert all(t.is_meta for t in [*layers.parameters(), *layers.buffers()])
    model = GPipe(layers, [2, 1], init=_parameters_and_statistics(0.5))
    torch.testing.assert_close(model[1].running_mean, torch.zeros(8))
    assert int(model[1].num_batches_tracked) == 0


class _Slots(nn.Module):
    """An integer buffer its reset fills in part only: the first half."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("idx", torch.empty(4, dtype=dtype))

    def reset_parameters(self) -> None:
        self.idx[:2] = 0

    def forward(self, x: Tensor) -> Tensor:
        return x


@pytest.mark.parametrize("dtype", [torch.int64])
def test_a_wide_integer_buffer_a_reset_fills_in_part_is_refused(dtype: torch.dtype) -> None:
    # It was accepted: any write counted, and the rest kept the mark (the lowest value).
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), _Slots(dtype))
    with pytest.raises(ValueError, match=r"reset_parameters\(\) left 1\.idx as allocated"):
        GPipe(layers, [1, 1])


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32])
def test_a_narrow_integer_buffer_counts_as_filled_once_written(dtype: torch.dtype) -> None:
    # Their marks are plausible values (a random fill of a large int16 or int32 tensor
    # meets some): a write is all that is checked.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), _Slots(dtype))
    model = GPipe(layers, [1, 1])
    assert not model[1].idx[:2].any()


class _Written(nn.Module):
    """A buffer its reset writes all over with ``value`` (``through_data``: by ``.data``)."""

    def __init__(self, dtype: torch.dtype, value: Any, through_data: bool) -> None:
        super().__init__()
        self.value, self.through_data = value, through_data
        self.register_buffer("b", torch.empty(6, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        (self.b.data if self.through_data else self.b).fill_(self.value)

    def forward(self, x: Tensor) -> Tensor:
        return x


@pytest.mark.parametrize(
    ("dtype", "value", "through_data"),
    [
        (torch.int64, torch.iinfo(torch.int64).min, False),  # minus infinity, as an integer
        (torch.int32, torch.iinfo(torch.int32).min, True),
        (torch.int16, torch.iinfo(torch.int16).min + 1, False),
        (torch.bool, True, True),  # a mask, through .data: no version, no new storage
        (torch.uint8, 255, True),
        (torch.int8, -128, True),
    ],
    ids=str,
)
def test_a_reset_writing_any_one_value_all_over_counts_as_filled(
    dtype: torch.dtype, value: Any, through_data: bool
) -> None:
    # Regression: the mark was one value (the lowest; True, 255): a reset that wrote it
    # on purpose was refused ("left 1.b as allocated").
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), _Written(dtype, value, through_data))
    model = GPipe(layers, [1, 1])
    assert model[1].b.tolist() == [value] * 6


@pytest.mark.parametrize("left", [slice(1, None), slice(None, -1), slice(0, 1)], ids=str)
def test_a_wide_integer_buffer_with_one_element_left_is_refused(left: slice) -> None:
    # Regression: only marks of two values left counted as a hole: one element passed.
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.empty(3, dtype=torch.int64))

        def reset_parameters(self) -> None:
            everything = torch.ones(3, dtype=torch.bool)
            everything[left] = False
            self.b[everything] = 7

        def forward(self, x: Tensor) -> Tensor:
            return x

    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), Two())
    with pytest.raises(ValueError, match=r"left 1\.b as allocated"):
        GPipe(layers, [1, 1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint16, torch.bool])
def test_integer_buffers_laid_out_in_pieces_are_marked_and_checked(dtype: torch.dtype) -> None:
    # Regression: index_put, which marked them, is not there for uint16 (an error from
    # inside torch), and the check copied the whole tensor.
    class Transposed(nn.Module):
        def __init__(self, fill: bool) -> None:
            super().__init__()
            self.fill = fill
            self.register_buffer("b", torch.empty(3, 5, dtype=dtype).t())

        def reset_parameters(self) -> None:
            if self.fill:
                self.b.zero_()

        def forward(self, x: Tensor) -> Tensor:
            return x

    with torch.device("meta"):
        filled = nn.Sequential(nn.Linear(2, 2), Transposed(True))
        left = nn.Sequential(nn.Linear(2, 2), Transposed(False))
    assert not GPipe(filled, [1, 1])[1].b.any()
    with pytest.raises(ValueError, match=r"left 1\.b as allocated"):
        GPipe(left, [1, 1])


def test_a_random_fill_of_a_large_int16_buffer_counts_as_filled() -> None:
    # Some of its values are marks: where that refused it, 11 of 20 seeds were refused.
    class Seeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seeds", torch.empty(1 << 16, dtype=torch.int16))

        def reset_parameters(self) -> None:
            self.seeds.random_(-(1 << 15), 1 << 15)

        def forward(self, x: Tensor) -> Tensor:
            return x

    for seed in range(5):
        torch.manual_seed(seed)
        with torch.device("meta"):
            layers = nn.Sequential(Seeds(), nn.Identity())
        GPipe(layers, [1, 1])


def test_a_tensor_initializer_given_as_init_is_named_and_the_model_put_back() -> None:
    # init=nn.init.xavier_uniform_ passes the up-front check (a function of one
    # argument) and failed with torch's "'Linear' object has no attribute 'dim'" alone.
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(AttributeError) as raised:
        GPipe(layers, [1, 1], init=nn.init.xavier_uniform_)
    notes = getattr(raised.value, "__notes__", [])
    assert any("raised by init(layer) on layer 0 (Linear)" in note for note in notes)
    assert any("not a tensor" in note for note in notes)
    assert all(p.is_meta for p in layers.parameters())


def test_a_complex_parameter_a_reset_fills_in_one_part_only_is_refused() -> None:
    # Regression: the mark was nan+0j, so writing the real part alone passed.
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, dtype=torch.cfloat))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.real.normal_()

        def forward(self, x: Tensor) -> Tensor:
            return x

    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(2, 2), Half())
    with pytest.raises(ValueError, match=r"left 1\.w as allocated"):
        GPipe(layers, [1, 1])


def test_lazy_layers_are_refused_before_anything_changes() -> None:
    # torch's own errors came from inside the checks: "uninitialized parameter".
    with torch.device("meta"):
        layers = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"layer 0 \(LazyLinear\) holds uninitialized \(lazy\)"):
        GPipe(layers, [1, 1])
    layers(torch.randn(2, 3, device="meta"))  # what the refusal advises: shapes, no memory
    assert layers[0].weight.shape == (4, 3)
    assert _kaiming(GPipe(layers, [1, 1])[0].weight)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
    with torch.device("meta"):
        second = nn.Linear(4, 4)
    mixed = nn.Sequential(nn.LazyLinear(4), second)  # a real lazy layer among meta ones
    with pytest.raises(ValueError, match=r"layer 0 \(LazyLinear\) holds uninitialized"):
        GPipe(mixed, [1, 1], state_dict=plain.state_dict())
    assert second.weight.is_meta


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"state_dict": "ckpt/rank0.pt"}, r"got str 'ckpt/rank0\.pt'; load the file first"),
        ({"state_dict": mlp().state_dict}, r"got method Module\.state_dict; call it"),
        ({"state_dict": {0: torch.ones(1)}}, r"keys must be str .*, not int 0"),
        (
            {"state_dict": {**mlp().state_dict(), "0.weight": None}},
            r"must hold a Tensor at the key of each .* holds 0\.weight \(NoneType None\)",
        ),
        ({"init": "xavier"}, r"init must be a function .* got str 'xavier'"),
        ({"init": lambda: None}, r"init\(layer\), but function .* takes \(\); give it one"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_up_front(
    arguments: dict[str, Any], match: str
) -> None:
    layers = _on_meta()
    with pytest.raises(TypeError, match=match):
        GPipe(layers, [4, 4], **arguments)
    assert all(p.is_meta for p in layers.parameters())
    with pytest.raises(TypeError, match=match):  # the same checks, before any transport
        PipelineStage(layers, [4, 4], **arguments)


class _WithOwnTensor(nn.Module):
    """A model whose own parameter (not a submodule's) its own reset fills."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.empty(3, 4))
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.position, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x + self.position)))


def test_a_split_models_own_tensor_is_refused_as_its_own() -> None:
    # Named "Stage: it has no reset_parameters()", where the model has one that no
    # stage runs.
    with torch.device("meta"):
        model = _WithOwnTensor()
    stages = split(model, torch.zeros(2, 3, 4, device="meta"), at=["second"])
    with pytest.raises(ValueError, match=r"position \(the split model's own, not a submodule"):
        GPipe(stages, [1, 1])
    plain = split(_WithOwnTensor(), torch.zeros(2, 3, 4), at=["second"])
    filled = GPipe(stages, [1, 1], state_dict=plain.state_dict())
    torch.testing.assert_close(filled[0].position, plain[0].position)


class _FrequencyReader(nn.Module):
    def __init__(self, freq: Tensor, persistent: bool) -> None:
        super().__init__()
        self.register_buffer("freq", freq, persistent=persistent)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.freq


def test_a_buffer_tied_under_a_persistent_false_name_loads_the_plain_state_dict() -> None:
    # The second name, in no state dict, was added to the one given: "keys the model
    # does not: 1.freq".
    def build() -> nn.Sequential:
        freq = torch.arange(4.0)
        return nn.Sequential(_FrequencyReader(freq, True), _FrequencyReader(freq, False))

    plain = build()
    with torch.device("meta"):
        meta = build()
    model = GPipe(meta, [2], state_dict=plain.state_dict())
    assert model[1].freq is model[0].freq
    torch.testing.assert_close(model[1].freq, torch.arange(4.0))


class _RotaryNeedsBase(_Rotary):
    """Its reset fills a persistent=False buffer, and needs an argument to."""

    def reset_parameters(self, base: float = 1.0, *, must: bool) -> None:  # type: ignore[override]
        super().reset_parameters()


def test_a_reset_that_must_run_beside_a_state_dict_points_to_init_alone() -> None:
    plain = nn.Sequential(_Rotary(fills=True))
    with torch.device("meta"):
        meta = nn.Sequential(_RotaryNeedsBase(fills=True))
    with pytest.raises(TypeError) as info:
        GPipe(meta, [1], state_dict=plain.state_dict())
    (note,) = [n for n in info.value.__notes__ if "reset_parameters()" in n]
    assert "a persistent=False buffer): pass init= to fill that layer instead" in note


class _Idle(nn.Linear):
    def reset_parameters(self) -> None:  # leaves its weights as allocated
        pass


@pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")
def test_a_refusal_leaves_a_model_with_torchscript_layers_as_it_was() -> None:
    # Regression: putting a scripted module's tables back cleared them, which TorchScript's
    # tables cannot do (AttributeError), hiding the refusal.
    scripted = torch.jit.script(nn.Linear(4, 4))
    with torch.device("meta"):
        rest = nn.Sequential(nn.Linear(4, 4), _Idle(4, 4))
    weight = scripted.weight
    with pytest.raises(ValueError, match=r"left 2\.weight, 2\.bias as allocated"):
        GPipe(nn.Sequential(scripted, *rest), [1, 2])
    assert scripted.weight is weight
