"""Models built on the meta device: each partition (each process) allocates its own layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from distributed_helpers import mlp, run_threads
from torch import Tensor, nn

from torchgpipe import GPipe, Schedule1F1B
from torchgpipe.distributed import PipelineStage, Transport
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


def test_a_meta_model_is_reset_by_its_modules_own_reset_parameters() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = GPipe(layers, [2, 2], chunks=2)
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
    with pytest.raises(ValueError, match=r"1\.table \(Positions\) cannot be made on its device"):
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
