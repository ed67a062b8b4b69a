"""Checkpoints of torchgpipe 0.0.7 load into a GPipe of this library."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from helpers import Versioned
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.skip import pop, skippable, stash


@skippable(stash=["a"])
class _Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: Tensor) -> Any:
        yield stash("a", x)
        return self.conv(x)


@skippable(pop=["a"])
class _Pop(nn.Module):
    def forward(self, x: Tensor) -> Any:
        a = yield pop("a")
        return x + a


def _model(deferred: bool = True) -> GPipe:
    layers = nn.Sequential(_Stash(), nn.BatchNorm2d(3), _Pop())
    return GPipe(layers, [2, 1], chunks=2, deferred_batch_norm=deferred)


def _saved_by_0_0_7() -> OrderedDict[str, Tensor]:
    """What 0.0.7's ``GPipe.state_dict()`` gave for ``_model()`` (keys, versions)."""
    torch.manual_seed(1)
    saved: OrderedDict[str, Tensor] = OrderedDict(
        [
            ("partitions.0.0.module.conv.weight", torch.randn(3, 3, 1, 1)),
            ("partitions.0.0.module.conv.bias", torch.randn(3)),
            ("partitions.0.1.weight", torch.randn(3)),
            ("partitions.0.1.bias", torch.randn(3)),
            ("partitions.0.1.running_mean", torch.randn(3)),
            ("partitions.0.1.running_var", torch.rand(3)),
            ("partitions.0.1.num_batches_tracked", torch.tensor(7)),
            ("partitions.0.1.sum", torch.randn(1, 3, 1, 1)),
            ("partitions.0.1.sum_squares", torch.randn(1, 3, 1, 1)),
        ]
    )
    paths = ["", "partitions", "partitions.0", "partitions.0.0", "partitions.0.0.module"]
    paths += ["partitions.0.0.module.conv", "partitions.0.1", "partitions.1", "partitions.1.2"]
    paths += ["partitions.1.2.module"]
    saved._metadata = OrderedDict(  # type: ignore[attr-defined]  # torch's own attribute
        (path, {"version": 2 if path == "partitions.0.1" else 1}) for path in paths
    )
    return saved


@pytest.mark.parametrize("deferred", [True, False])
def test_a_checkpoint_of_0_0_7_loads_under_this_librarys_keys(deferred: bool) -> None:
    # It was refused: every key missing, every one of 0.0.7's unexpected. A batch norm
    # not deferred here had its 0.0.7 sums refused as unexpected.
    saved = _saved_by_0_0_7()
    versions = dict(saved._metadata)  # type: ignore[attr-defined]  # torch's own
    model = _model(deferred)
    model.load_state_dict(saved)
    assert saved._metadata == versions  # type: ignore[attr-defined]  # left as it came
    state = model.state_dict()
    assert list(state) == [
        "0.conv.weight",
        "0.conv.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    for key, value in state.items():
        old = key.replace("0.conv", "0.module.conv")
        torch.testing.assert_close(value, saved[f"partitions.0.{old}"], rtol=0, atol=0)
    assert all(key.startswith("partitions.") for key in saved)  # the caller's, as it was


def test_a_meta_model_given_a_checkpoint_of_0_0_7_to_build_from_says_how_to_load_it() -> None:
    # Every key was "one the model does not have", and it asked for the plain model's.
    with torch.device("meta"):
        layers = nn.Sequential(_Stash(), nn.BatchNorm2d(3), _Pop())
    with pytest.raises(ValueError, match=r"torchgpipe 0\.0\.7 .* then call load_state_dict"):
        GPipe(layers, [2, 1], chunks=2, state_dict=_saved_by_0_0_7())
    model = GPipe(layers, [2, 1], chunks=2, deferred_batch_norm=True)  # the resets fill it
    model.load_state_dict(_saved_by_0_0_7())  # as the message says
    torch.testing.assert_close(
        model[1].running_var, _saved_by_0_0_7()["partitions.0.1.running_var"]
    )


def test_a_checkpoint_of_0_0_7_with_a_key_the_model_lacks_is_refused_by_its_name() -> None:
    saved = _saved_by_0_0_7()
    saved["partitions.1.2.module.extra"] = torch.zeros(1)
    unexpected = r'Unexpected key\(s\) in state_dict: "2\.module\.extra"'
    with pytest.raises(RuntimeError, match=unexpected):
        _model().load_state_dict(saved)


def test_a_checkpoint_of_0_0_7_with_a_module_attached_to_its_gpipe_loads() -> None:
    # 0.0.7 kept an attached module's keys as they were, beside its layers' partitions.
    saved = _saved_by_0_0_7()
    saved["aux.weight"], saved["aux.bias"] = torch.ones(1, 2), torch.zeros(1)
    model = _model()
    model.aux = nn.Linear(2, 1)
    model.load_state_dict(saved)
    torch.testing.assert_close(model.aux.weight, torch.ones(1, 2))
    for key, value in saved.items():
        if key.startswith("partitions.") and not key.endswith(("sum", "sum_squares")):
            assert any(torch.equal(value, p) for p in model.state_dict().values()), key


def test_a_state_dict_of_this_library_is_loaded_as_it_is() -> None:
    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = _model()


def test_a_checkpoint_of_0_0_7_loads_into_a_gpipe_inside_a_model() -> None:
    # Torch loads a child without calling its load_state_dict: the keys, under the
    # child's path, were not read.
    saved = OrderedDict((f"pipe.{key}", value) for key, value in _saved_by_0_0_7().items())
    holder = _Holder()
    holder.load_state_dict(saved)
    torch.testing.assert_close(
        holder.pipe[0].conv.weight, saved["pipe.partitions.0.0.module.conv.weight"]
    )


@skippable(stash=["a"])
class _HoldsModule(nn.Module):
    """A skippable class with a child named ``module`` and a weight of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.weight = nn.Parameter(torch.zeros(2))

    def forward(self, x: Tensor) -> Any:
        yield stash("a", x)
        return self.module(x) + self.weight


def test_a_skippable_layer_with_a_child_named_module_is_read_by_0_0_7s_wrapping() -> None:
    # 0.0.7's partitions.0.0.module.weight is the layer's own weight (the wrapper's
    # module. first), not its child's: the two were taken for each other.
    layers = nn.Sequential(_HoldsModule(), _Pop())
    model = GPipe(layers, [1, 1])
    saved = OrderedDict(
        [
            ("partitions.0.0.module.module.weight", torch.full((2, 2), 1.0)),
            ("partitions.0.0.module.module.bias", torch.full((2,), 2.0)),
            ("partitions.0.0.module.weight", torch.full((2,), 3.0)),
        ]
    )
    model.load_state_dict(saved)
    torch.testing.assert_close(model[0].weight.detach(), torch.full((2,), 3.0))
    torch.testing.assert_close(model[0].module.bias.detach(), torch.full((2,), 2.0))


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_0_0_7_is_read_with_the_versions_it_recorded(version: int) -> None:
    # A version 1 layer converts its values as it loads: it must find its version under
    # its path here (the converted one), and find 2 where 0.0.7 recorded 2.
    model = GPipe(nn.Sequential(nn.Identity(), Versioned()), [1, 1])
    saved = OrderedDict([("partitions.1.1.g", torch.full((4,), 5.0))])
    paths = ["", "partitions", "partitions.0", "partitions.0.0", "partitions.1", "partitions.1.1"]
    saved._metadata = OrderedDict(  # type: ignore[attr-defined]  # torch's own attribute
        (path, {"version": version if path == "partitions.1.1" else 1}) for path in paths
    )
    model.load_state_dict(saved)
    torch.testing.assert_close(model[1].g.detach(), torch.full((4,), 5.0 * (3 - version)))
    assert list(saved._metadata) == paths  # type: ignore[attr-defined]  # as it came
