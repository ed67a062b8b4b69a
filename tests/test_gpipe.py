import copy
import inspect
import pickle
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import OnBackward
from torch import Tensor, nn
from torch.nn.utils import parametrize

from torchgpipe import BalanceError, GPipe, Schedule1F1B, ScheduleGPipe


def _mlp(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_signature_matches_torchgpipe() -> None:
    params = inspect.signature(GPipe).parameters
    assert list(params) == [
        "module",
        "balance",
        "devices",
        "chunks",
        "checkpoint",
        "deferred_batch_norm",
        "init",  # beyond torchgpipe 0.0.7: models built on the meta device
        "state_dict",
    ]
    keyword_only = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keyword_only] == list(params)[2:]
    assert params["balance"].default is None  # GPipe(module) raises BalanceError
    assert params["chunks"].default == 1
    assert params["checkpoint"].default == "except_last"
    assert params["devices"].default is None
    assert params["deferred_batch_norm"].default is False
    assert params["init"].default is None
    assert params["state_dict"].default is None


def test_attributes() -> None:
    model = GPipe(_mlp(), [1, 3], devices=["cpu", 0 if False else "cpu"], chunks=3)
    assert model.balance == [1, 3]
    assert model.devices == [torch.device("cpu")] * 2
    assert model.chunks == 3
    assert model.checkpoint == "except_last"
    assert [len(p) for p in model.partitions] == [1, 3]


def test_partitions_are_a_module_list_that_adds_no_state() -> None:
    model = GPipe(_mlp(), [1, 3])
    assert isinstance(model.partitions, nn.ModuleList)
    assert model.partitions[1][0] is model[1]
    assert list(model.state_dict()) == list(_mlp().state_dict())


def test_partitions_keep_the_layers_names_as_in_0_0_7() -> None:
    # The bug: each partition renumbered its layers from 0, where 0.0.7's kept their names
    # (partitions[1].fc, and a partition's state dict under the layers' keys).
    module = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), b=nn.ReLU(), fc=nn.Linear(2, 2)))
    model = GPipe(module, [2, 1])
    assert model.partitions[1].fc is module.fc
    assert model.partitions[1][0] is module.fc
    assert list(model.partitions[0].state_dict()) == ["a.weight", "a.bias"]
    numbered = GPipe(_mlp(), [1, 3])
    assert [name for name, _ in numbered.partitions[1].named_children()] == ["1", "2", "3"]


def test_partitions_follow_the_models_training_flag_and_leave_the_layers_theirs() -> None:
    # The bug: after model.eval() each partition still said training (0.0.7's registered
    # partitions followed the model).
    model = GPipe(_mlp(), [1, 3])
    model.eval()
    assert [p.training for p in model.partitions] == [False, False]
    assert not model.partitions.training
    model.train()
    model[2].eval()  # a layer set apart stays so
    assert [p.training for p in model.partitions] == [True, True]
    assert not model[2].training


@pytest.mark.parametrize("layers", [4, 0])
def test_balance_left_out_points_to_automatic_balancing(layers: int) -> None:
    # torchgpipe 0.0.7's own test leaves it out of an empty nn.Sequential.
    with pytest.raises(BalanceError, match=r"balance is required.*torchgpipe\.balance"):
        GPipe(_mlp() if layers else nn.Sequential())


def test_numpy_integers_are_accepted_for_chunks_and_balance() -> None:
    np = pytest.importorskip("numpy")
    model = GPipe(_mlp(), np.array([2, 2]), chunks=np.int64(3))
    assert model.chunks == 3
    assert type(model.chunks) is int
    assert model(torch.randn(6, 4)).shape == (6, 4)


def test_default_devices_without_cuda_are_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert GPipe(_mlp(), [2, 1, 1]).devices == [torch.device("cpu")] * 3


def test_devices_accept_strings_and_torch_devices_and_repeat() -> None:
    model = GPipe(_mlp(), [1, 1, 2], devices=["cpu", torch.device("cpu"), "cpu", "cpu"])
    assert model.devices == [torch.device("cpu")] * 3  # extra devices are ignored


@pytest.mark.cuda
def test_devices_accept_ints_as_cuda_indices() -> None:
    model = GPipe(_mlp(), [2, 2], devices=[0, 0])
    assert model.devices == [torch.device("cuda", 0)] * 2
    assert model[0].weight.device == torch.device("cuda", 0)


@pytest.mark.cuda
def test_default_devices_with_cuda_are_every_gpu() -> None:
    n = torch.cuda.device_count()
    model = GPipe(_mlp(n), [1] * n)
    assert model.devices == [torch.device("cuda", j) for j in range(n)]


def test_layers_are_moved_to_their_partition_device() -> None:
    model = GPipe(_mlp(), [2, 2], devices=["cpu", "cpu"])
    assert all(p.device.type == "cpu" for p in model.parameters())


# Wrong input, each rejected before any work.


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match=r"wraps an nn.Sequential, got Linear"):
        GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


class _Residual(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def test_a_sequential_with_a_forward_of_its_own_is_refused() -> None:
    # Its layers ran one after another, without the residual: other outputs, silently.
    with pytest.raises(TypeError, match=r"_Residual has a forward of its own"):
        GPipe(_Residual(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1])


class _Named(nn.Sequential):
    def describe(self) -> str:
        return "layers"


def test_a_sequential_subclass_that_keeps_its_forward_is_taken() -> None:
    plain = _Named(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(4, 2)
    torch.testing.assert_close(GPipe(plain, [1, 1])(x), plain(x))


def test_duplicate_children_rejected() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layer 2 is the same module as layer 0"):
        GPipe(nn.Sequential(layer, nn.ReLU(), layer), [1, 2])


def test_parameters_shared_between_partitions_are_copied_per_partition() -> None:
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    c.bias = a.bias
    model = GPipe(nn.Sequential(a, b, c), [1, 2])
    assert model[1].weight is not model[0].weight  # tests/test_tied.py has the rest
    assert model[2].bias is not model[0].bias
    torch.testing.assert_close(model[1].weight, model[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(model[2].bias, model[0].bias, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["chunks", "checkpoint", "balance", "devices", "partitions"])
def test_layer_named_like_an_attribute_rejected(name: str) -> None:
    module = nn.Sequential(OrderedDict([("a", nn.Identity()), (name, nn.Identity())]))
    with pytest.raises(ValueError, match=rf"\['{name}'\] are also attributes of GPipe"):
        GPipe(module, [1, 1])


def _own_attributes() -> set[str]:
    """What a GPipe (with ties and deferred batch norm) holds beyond any nn.Module."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    # Built at collection, where conftest does not hide a GPU: name the CPU.
    model = GPipe(
        nn.Sequential(a, nn.BatchNorm1d(2), b),
        [2, 1],
        devices=["cpu", "cpu"],
        deferred_batch_norm=True,
    )
    return set(vars(model)) - set(vars(nn.Module()))


@pytest.mark.parametrize("name", sorted(_own_attributes()))
def test_every_attribute_of_gpipe_is_refused_as_a_layer_name_before_any_change(name: str) -> None:
    norm = nn.BatchNorm1d(2)
    module = nn.Sequential(OrderedDict([("norm", norm), (name, nn.Identity())]))
    with pytest.raises(ValueError, match=rf"\['{name}'\] are also attributes of GPipe"):
        GPipe(module, [1, 1], deferred_batch_norm=True)
    assert module.norm is norm  # not replaced by a deferred batch norm


def test_parameters_shared_within_one_layer_are_fine() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.b.weight = self.a.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x))

    GPipe(nn.Sequential(Tied(), nn.Linear(2, 2)), [1, 1])


@pytest.mark.parametrize(
    ("balance", "match"),
    [
        ([1, 2], "balance sums to 3 but the module has 4 layers; pass a balance that sums to 4"),
        ([3, 2], "balance sums to 5 but the module has 4 layers"),
        ([0, 4], r"balance\[0\] = 0"),
        ([5, -1], r"balance\[1\] = -1"),
        ([], "balance is empty"),
        (None, "balance is required.*torchgpipe.balance.balance_by_time"),
    ],
)
def test_bad_balance_rejected(balance: list[int] | None, match: str) -> None:
    with pytest.raises(BalanceError, match=match):
        GPipe(_mlp(), balance)
    assert issubclass(BalanceError, ValueError)


@pytest.mark.parametrize("balance", [[1.5, 2.5], ["2", "2"], 4, [True, 3]])
def test_balance_of_wrong_type_rejected(balance: object) -> None:
    with pytest.raises(TypeError, match="balance must be a sequence of ints"):
        GPipe(_mlp(), balance)  # type: ignore[arg-type]


def test_too_few_devices_rejected() -> None:
    with pytest.raises(IndexError, match=r"3 partitions but only 2 device\(s\)"):
        GPipe(_mlp(), [1, 1, 2], devices=["cpu", "cpu"])


def test_bad_device_rejected() -> None:
    with pytest.raises(ValueError, match="is not a device"):
        GPipe(_mlp(), [4], devices=["gpu7"])
    with pytest.raises(TypeError, match="a device must be"):
        GPipe(_mlp(), [4], devices=[1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="a sequence with a device per partition"):
        GPipe(_mlp(), [4], devices="cpu")


def test_meta_device_rejected_before_the_model_changes() -> None:
    model = _mlp(2)
    weight = model[1].weight
    with pytest.raises(ValueError, match=r"'meta' is the meta device.*torch.device\('meta'\)"):
        GPipe(model, [1, 1], devices=["cpu", "meta"])
    with pytest.raises(ValueError, match=r"device\(type='meta'\) is the meta device"):
        GPipe(model, [1, 1], devices=[torch.device("meta"), "cpu"])
    assert model[1].weight is weight
    assert weight.device.type == "cpu"


def test_cuda_device_without_cuda_rejected() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        GPipe(_mlp(), [2, 2], devices=["cuda:0", "cuda:1"])


@pytest.mark.parametrize("chunks", [2.5, "2", True])
def test_chunks_that_are_not_integers_rejected(chunks: object) -> None:
    with pytest.raises(TypeError, match="chunks must be an int"):
        GPipe(_mlp(), [4], chunks=chunks)  # type: ignore[arg-type]


def test_arguments_taken_as_torchgpipe_0_0_7_took_them() -> None:
    class Named:
        def __init__(self, value: str) -> None:
            self.value = value

        def __str__(self) -> str:
            return self.value

    model = GPipe(
        nn.Sequential(nn.Linear(1, 1)),
        balance=(1,),
        devices=("cpu",),
        chunks=42.000,  # type: ignore[arg-type]
        checkpoint=Named("always"),  # type: ignore[arg-type]
        deferred_batch_norm=np.bool_(True),  # type: ignore[arg-type]
    )
    assert model.balance == [1]
    assert model.devices == [torch.device("cpu")]
    assert model.chunks == 42
    assert type(model.chunks) is int
    assert model.checkpoint == "always"
    assert type(model.checkpoint) is str
    assert model.deferred_batch_norm is True
    assert GPipe(_mlp(), [4], checkpoint=np.str_("never")).checkpoint.__class__ is str
    assert GPipe(_mlp(), [4], chunks=np.float32(4)).chunks == 4  # type: ignore[arg-type]
    assert GPipe(_mlp(), [4], deferred_batch_norm=0).deferred_batch_norm is False  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="deferred_batch_norm must be a bool, got 2"):
        GPipe(_mlp(), [4], deferred_batch_norm=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -2])
def test_non_positive_chunks_rejected(chunks: int) -> None:
    with pytest.raises(ValueError, match=f"chunks must be a positive number.*got {chunks}"):
        GPipe(_mlp(), [4], chunks=chunks)


def test_unknown_checkpoint_mode_rejected() -> None:
    # Worded as torchgpipe 0.0.7's message, which its own test matches, then ours.
    expected = "checkpoint is not one of 'always', 'except_last', or 'never': unknown"
    with pytest.raises(ValueError, match=f"{expected} checkpoint mode 'sometimes'$"):
        GPipe(_mlp(), [4], checkpoint="sometimes")  # type: ignore[arg-type]


def test_chunks_and_checkpoint_assigned_later_are_checked_at_once() -> None:
    # Read at every call, they were never checked again: a bad one failed inside the
    # next call, with tensor_split's or a KeyError's words.
    plain, x = _mlp(), torch.randn(6, 4)
    model = GPipe(copy.deepcopy(plain), [2, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"chunks must be a positive number.*got 0"):
        model.chunks = 0
    with pytest.raises(TypeError, match="chunks must be an int"):
        model.chunks = 2.5  # type: ignore[assignment]
    with pytest.raises(ValueError, match="unknown checkpoint mode 'bogus'"):
        model.checkpoint = "bogus"  # type: ignore[assignment]
    assert (model.chunks, model.checkpoint) == (2, "except_last")  # kept
    model.chunks, model.checkpoint = np.int64(3), np.str_("never")  # type: ignore[assignment]
    assert type(model.chunks) is int
    assert type(model.checkpoint) is str
    assert vars(model)["chunks"] == 3  # where a plain attribute is: copies keep it
    assert copy.deepcopy(model).chunks == 3
    assert pickle.loads(pickle.dumps(model)).checkpoint == "never"
    del model.chunks  # as a plain attribute may be
    assert "chunks" not in vars(model)
    model.chunks = 2
    torch.testing.assert_close(model(x), plain(x))


def test_tensors_of_the_sequential_itself_are_refused() -> None:
    # Kept by no partition: missing from the GPipe's state dict (a strict load of it into
    # the plain model failed), left on meta where built there, refused from state_dict=.
    module = _mlp()
    module.register_buffer("step", torch.zeros(()))
    with pytest.raises(ValueError, match=r"itself holds tensors \['step'\].*into a layer"):
        GPipe(module, [2, 2])
    module.register_buffer("step", None)  # none held: nothing lost
    module.register_buffer("scratch", torch.zeros(()), persistent=False)  # in no state dict
    GPipe(module, [2, 2])
    parametrized = _mlp()  # its ModuleDict of parametrizations was taken for a layer
    parametrized.register_parameter("w", nn.Parameter(torch.ones(2)))
    parametrize.register_parametrization(parametrized, "w", nn.Identity())
    with pytest.raises(ValueError, match=r"itself holds tensors \['parametrizations'\]"):
        GPipe(parametrized, [2, 3])  # four layers and the ModuleDict


def test_errors_come_before_any_work() -> None:
    module = _mlp()
    weight = module[0].weight
    with pytest.raises(ValueError, match="checkpoint"):
        GPipe(module, [2, 2], checkpoint="no")  # type: ignore[arg-type]
    assert module[0].weight is weight


# Behaving like the wrapped Sequential.


def test_len_indexing_and_iteration() -> None:
    module = _mlp()
    model = GPipe(module, [2, 2])
    assert len(model) == 4
    assert model[0] is module[0]
    assert model[-1] is module[3]
    assert list(model) == list(module)
    assert list(model[1:3]) == [module[1], module[2]]
    with pytest.raises(IndexError, match="index 4 is out of range: the model has 4 layers"):
        model[4]
    with pytest.raises(IndexError, match="index -5 is out of range"):
        model[-5]
    # A slice keeps the layers' names, as the Sequential's own slice does.
    named = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), b=nn.ReLU(), c=nn.Linear(2, 2)))
    sliced = GPipe(named, [2, 1])[::2]
    assert (
        list(sliced.state_dict())
        == list(named[::2].state_dict())
        == ["a.weight", "a.bias", "c.weight", "c.bias"]
    )


def test_state_dict_keys_are_the_sequentials() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    keys = list(module.state_dict())
    model = GPipe(module, [2, 1])
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_parameters()] == [
        name for name, _ in module.named_parameters()
    ]
    plain = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert torch.equal(plain[0].weight, model[0].weight)


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to("cpu"),
        lambda m: m.to(torch.device("cpu")),
        lambda m: m.to(device="cpu"),
        lambda m: m.to("cpu", torch.float64),
        lambda m: m.to(torch.zeros(1)),
        lambda m: m.cpu(),
        lambda m: m.cuda(),
        lambda m: m.xpu(),
        lambda m: m.ipu(),
        lambda m: m.to_empty(device="cpu"),
    ],
)
def test_moving_is_refused(move: object) -> None:
    model = GPipe(_mlp(), [2, 2])
    with pytest.raises(TypeError, match="cannot be moved as a whole"):
        move(model)  # type: ignore[operator]


def test_dtype_changes_work() -> None:
    model = GPipe(_mlp(), [2, 2])
    assert model.to(torch.float64) is model
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(torch.randn(3, 4, dtype=torch.float64)).dtype == torch.float64
    model.half()
    assert model.partitions[1][0].weight.dtype == torch.float16
    model.to(dtype=torch.float32)
    assert model[3].weight.dtype == torch.float32
    # to(dtype, non_blocking): the bool was taken for a device index, and refused.
    assert model.to(torch.float64, True) is model
    assert model[0].weight.dtype == torch.float64


def test_deepcopy_gives_an_independent_working_model() -> None:
    model = GPipe(_mlp(), [2, 2], chunks=2)
    other = copy.deepcopy(model)
    assert other.partitions[0][0] is other[0]
    assert other[0] is not model[0]
    x = torch.randn(4, 4)
    assert torch.equal(other(x), model(x))


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_a_copy_of_a_model_that_ran_runs_its_own_layers(copier: Any) -> None:
    # A GPipe keeps the description of its stages from call to call; a copy must not
    # keep the original's (its partitions, streams).
    model = GPipe(_mlp(), [2, 2], chunks=2)
    x = torch.randn(4, 4)
    before = model(x).detach()
    with torch.no_grad():
        model.eval()(x)
    model.train()
    other = copier(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2.0)
    plain = nn.Sequential(*other)
    # Close, not equal: a micro-batch's matrix product may round apart from the batch's.
    torch.testing.assert_close(other(x), plain(x))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(x), plain(x))
    assert torch.equal(model(x), before)


# Caller state inside every partition.


class StateProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return self.linear(x)


def test_grad_mode_holds_in_every_partition() -> None:
    probes = [StateProbe() for _ in range(3)]
    model = GPipe(nn.Sequential(*probes), [1, 1, 1], chunks=2)
    with torch.no_grad():
        out = model(torch.randn(4, 4))
    assert not out.requires_grad
    assert all(seen == [(False, False)] * 2 for seen in (p.seen for p in probes))
    with torch.enable_grad():
        assert model(torch.randn(4, 4)).requires_grad


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_autocast_holds_in_every_partition_and_recomputation(checkpoint: str) -> None:
    probes = [StateProbe() for _ in range(2)]
    model = GPipe(nn.Sequential(*probes), [1, 1], chunks=2, checkpoint=checkpoint)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    # A checkpointed forward records no graph (grad off); recomputation and plain cells
    # run with grad. Autocast is on in all of them.
    expected = {(False, True), (True, True)} if checkpoint == "always" else {(True, True)}
    assert all(set(p.seen) == expected for p in probes)
    assert all(p.linear.weight.grad is not None for p in probes)


def test_cpu_pipeline_creates_no_cuda_state() -> None:
    script = (
        "import torch\n"
        "from torch import nn\n"
        "from torchgpipe import GPipe\n"
        "model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Dropout(), nn.Linear(2, 2)), [1, 2],"
        " devices=['cpu', 'cpu'], chunks=2, checkpoint='always')\n"
        "model(torch.randn(4, 2)).sum().backward()\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@dataclass
class Hidden:
    h: Tensor


class ToHidden(nn.Linear):
    def forward(self, x: Tensor) -> Hidden:  # type: ignore[override]
        return Hidden(super().forward(x))


class FromHidden(nn.Linear):
    def forward(self, x: Hidden) -> Tensor:  # type: ignore[override]
        return super().forward(torch.tanh(x.h))


def test_dataclass_output_is_gathered_from_every_micro_batch() -> None:
    model = GPipe(nn.Sequential(nn.Linear(4, 4), ToHidden(4, 3)), [1, 1], chunks=4)
    x = torch.randn(8, 4)
    out = model(x)
    assert type(out) is Hidden
    assert torch.allclose(out.h, model[1](model[0](x)).h)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_dataclass_between_partitions_gets_its_gradients(checkpoint: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(ToHidden(4, 4), FromHidden(4, 4))
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(8, 4)
    plain(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6)  # type: ignore[arg-type]


class Box:
    def __init__(self, h: Tensor) -> None:
        self.h = h


class ToBox(nn.Linear):
    def forward(self, x: Tensor) -> Box:  # type: ignore[override]
        return Box(super().forward(x))


def test_object_holding_tensors_between_partitions_rejected() -> None:
    model = GPipe(nn.Sequential(ToBox(4, 4), nn.Identity()), [1, 1], chunks=2)
    with pytest.raises(TypeError, match=r"is a Box, whose attributes 'h' hold tensors") as info:
        model(torch.randn(4, 4))
    assert "partition" in " ".join(getattr(info.value, "__notes__", []))


def test_step_errors_about_the_target_name_it() -> None:
    model = GPipe(_mlp(2), [1, 1], chunks=2)
    schedule = Schedule1F1B(model, lambda out, y: out.mean())
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"0-dim tensor.*: target; give the target"):
        schedule.step(x, torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"the target holds no tensor.*close over"):
        schedule.step(x, ["a"] * 6)
    with pytest.raises(ValueError, match=r"of the target .*target\['w'\] has 5"):
        schedule.step(x, {"y": torch.zeros(6), "w": torch.zeros(5)})


def test_an_empty_model_passes_its_input_through() -> None:
    # As nn.Sequential() does, and as torchgpipe 0.0.7's GPipe(nn.Sequential(), []) did.
    model = GPipe(nn.Sequential(), [])
    x = torch.tensor(42)
    assert model(x) is x
    assert model((x,)) == (x,)
    assert len(model) == 0
    assert len(model.partitions) == 0
    with pytest.raises(ValueError, match="this GPipe is empty"):
        ScheduleGPipe(model, nn.functional.mse_loss).step(torch.ones(2, 1), torch.ones(2, 1))
    with pytest.raises(BalanceError, match="balance is empty"):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [])


# A GPipe called from inside its own partitions would wait for the call it is part of:
# refused at once, and the GPipe serves the next call.

_FROM_INSIDE = "called from inside one of its own partitions"


class _CallsBack(nn.Module):
    """Identity; calls ``self.call`` (not a submodule) in its forward or its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.call: Any = None
        self.in_backward = False

    def forward(self, x: Tensor) -> Tensor:
        if self.call is None:
            return x
        if self.in_backward:
            return OnBackward.apply(x, self.call)  # type: ignore[no-any-return]
        self.call()
        return x


def _raised_within_a_minute(fn: Any) -> BaseException | None:
    """What ``fn()`` raised on a thread of its own (None if nothing); a hang fails."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the call hung"
    return raised[0] if raised else None


@pytest.mark.parametrize("partition", [0, 1])  # the caller's thread, a worker
@pytest.mark.parametrize("outer", ["model", "step"])
@pytest.mark.parametrize("inner", ["model", "step", "backward"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_a_gpipe_called_from_its_own_layer_is_refused_not_hung(
    partition: int, outer: str, inner: str, in_backward: bool
) -> None:
    layer = _CallsBack()
    balance = [2, 1] if partition == 0 else [1, 2]
    model = GPipe(nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 4)), balance, chunks=2)
    schedule = ScheduleGPipe(model, nn.functional.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    earlier = model(x).sum()  # a loss to backpropagate through the GPipe from inside
    inners = {
        "model": lambda: model(x),
        "step": lambda: schedule.step(x, y),
        "backward": earlier.backward,
    }
    layer.call, layer.in_backward = inners[inner], in_backward

    def call() -> None:
        if outer == "model":
            model(x).sum().backward()
        else:
            schedule.step(x, y)

    error = _raised_within_a_minute(call)
    assert isinstance(error, RuntimeError)
    assert _FROM_INSIDE in str(error)
    assert f" {partition} on cpu" in " ".join(error.__notes__)  # the partition or stage
    layer.call = None
    model.zero_grad()
    model(x).sum().backward()  # the GPipe serves the next call, and the next step
    assert model[0].weight.grad is not None
    schedule.step(x, y)


def test_a_gpipe_called_from_a_gpipe_inside_its_partition_is_refused() -> None:
    # The inner GPipe's workers work for the outer's call: the outer is refused there too.
    layer = _CallsBack()
    inner = GPipe(nn.Sequential(nn.Linear(4, 4), layer), [1, 1], chunks=2)
    outer = GPipe(nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 4)), [1, 1, 1], chunks=2)
    x = torch.randn(4, 4)
    layer.call = lambda: outer(x)
    error = _raised_within_a_minute(lambda: outer(x))
    assert isinstance(error, RuntimeError)
    assert _FROM_INSIDE in str(error)
    layer.call = lambda: inner[0](x)  # a layer of the inner GPipe, called alone, is fine
    assert _raised_within_a_minute(lambda: outer(x).sum().backward()) is None


class _Announcing:
    """A lock that sets ``waiting`` when a thread other than ``owner`` comes to take it."""

    def __init__(self, lock: Any, owner: int) -> None:
        self.lock, self.owner = lock, owner
        self.waiting = threading.Event()

    def __enter__(self) -> None:
        if threading.get_ident() != self.owner:
            self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_second_threads_call_does_not_reset_deferred_batch_norm_under_way() -> None:
    # Thread A's forward stops after its first micro-batch left the batch norm until
    # thread B has come to the workers' lock: B's call must not have told the deferred
    # batch norm about its micro-batches yet, or A's statistics would start over halfway.
    # (A schedule's step holds the workers from its start: Workers.exclusive.)
    started = threading.Event()
    calls = []

    class Gate(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(None)
            if len(calls) == 1:
                started.set()
            elif len(calls) == 2:
                assert lock.waiting.wait(timeout=30)
            return x

    torch.manual_seed(0)
    layers = nn.Sequential(nn.BatchNorm1d(3, momentum=None), Gate(), nn.Identity())
    plain = copy.deepcopy(layers)
    model = GPipe(layers, [2, 1], chunks=4, deferred_batch_norm=True)
    lock = _Announcing(model.workers._lock, threading.get_ident())
    model.workers._lock = lock  # type: ignore[assignment]
    a, b = torch.randn(8, 3) + 5, torch.randn(8, 3) - 5

    def call(x: Tensor) -> None:
        with torch.no_grad():  # training mode: the statistics are tracked
            model(x)

    other = threading.Thread(target=lambda: (started.wait(timeout=30), call(b)))
    other.start()
    call(a)
    other.join(timeout=60)
    assert not other.is_alive()
    plain(a)
    plain(b)
    bn, plain_bn = model[0], plain[0]
    assert bn.num_batches_tracked == plain_bn.num_batches_tracked == 2
    torch.testing.assert_close(bn.running_mean, plain_bn.running_mean)
    torch.testing.assert_close(bn.running_var, plain_bn.running_var)
