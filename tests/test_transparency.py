"""GPipe computes what the unwrapped model computes: outputs, gradients, weights."""

import copy
import gc
import weakref
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from torchgpipe import GPipe, is_checkpointing, is_recomputing
from torchgpipe.skip import Namespace, pop, skippable, stash


class MaskDropout(nn.Module):
    """Dropout drawn from PyTorch's generator like nn.Dropout, that also records the mask of
    each forward pass, so the plain model can be run with the very same masks."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.masks: list[Tensor] = []
        self.replay: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.replay is not None:
            mask = self.replay
        else:
            mask = torch.empty_like(x).bernoulli_(1 - self.p)
            if not is_recomputing():
                self.masks.append(mask)
        return x * mask / (1 - self.p)


class Split(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x), torch.sigmoid(x)


class Merge(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return self.linear(a) * b


class Twice(nn.Module):
    """Tuple in, tuple out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        a, b = pair
        return torch.tanh(self.linear(a)), b * 2


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def convnet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        MaskDropout(0.3),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        MaskDropout(0.5),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def tuple_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), Split(6), Twice(6), Twice(6), Merge(6))


MODELS: dict[str, tuple[Callable[[], nn.Sequential], Callable[[int], Tensor], list[list[int]]]] = {
    "mlp": (mlp, lambda b: torch.randn(b, 6), [[5], [1, 4], [2, 3], [1, 1, 1, 1, 1]]),
    "convnet": (convnet, lambda b: torch.randn(b, 3, 8, 8), [[8], [3, 5], [2, 2, 2, 2]]),
    "tuple": (tuple_net, lambda b: torch.randn(b, 6), [[5], [2, 3], [1, 1, 1, 2]]),
}
CASES = [(name, balance) for name, (_, _, balances) in MODELS.items() for balance in balances]


def _replay_masks(gpipe_model: nn.Module, plain: nn.Sequential) -> None:
    """Give the plain model's dropouts the masks the pipeline drew, micro-batches joined."""
    for ours, theirs in zip(gpipe_model.modules(), plain.modules(), strict=True):
        if isinstance(ours, MaskDropout):
            assert isinstance(theirs, MaskDropout)
            theirs.replay = torch.cat(ours.masks)
            ours.masks.clear()


def _assert_same_grads(a: nn.Module, b: nn.Module, *, exact: bool) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        if exact:
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(("name", "balance"), CASES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_outputs_and_gradients_match_the_plain_model(
    name: str, balance: list[int], chunks: int, checkpoint: str, backward_by: str
) -> None:
    build, make_input, _ = MODELS[name]
    plain = build().double()
    model = GPipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=checkpoint)
    x = make_input(10).double()

    x1 = x.clone().requires_grad_()
    out = model(x1)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    _replay_masks(model, plain)
    x2 = x.clone().requires_grad_()
    expected = plain(x2)
    expected.backward(grad_out)

    exact = chunks == 1  # one micro-batch: the very same operations
    if exact:
        assert torch.equal(out, expected)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    _assert_same_grads(model, plain, exact=exact)
    assert x1.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunks", [1, 4])
def test_eval_mode_with_real_dropout_matches(chunks: int) -> None:
    plain = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2)).double()
    model = GPipe(copy.deepcopy(plain), [2, 2], chunks=chunks).eval()
    plain.eval()
    x = torch.randn(9, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)


def test_dict_values_between_layers(backward_by: str) -> None:
    class ToDict(nn.Module):
        def forward(self, x: Tensor) -> dict[str, object]:
            return {"h": x * 2, "ids": x.argmax(dim=1), "note": "kept"}

    class FromDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, d: dict[str, object]) -> dict[str, Tensor]:
            assert d["note"] == "kept"
            h, ids = d["h"], d["ids"]
            assert isinstance(h, Tensor)
            assert isinstance(ids, Tensor)
            return {"y": self.linear(h) + ids.unsqueeze(1)}

    plain = nn.Sequential(nn.Linear(4, 4), ToDict(), FromDict()).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=3, checkpoint="always")
    x = torch.randn(7, 4, dtype=torch.float64)
    out, expected = model(x), plain(x)
    assert list(out) == ["y"]
    torch.testing.assert_close(out["y"], expected["y"], rtol=1e-12, atol=1e-12)
    out["y"].sum().backward()
    expected["y"].sum().backward()
    _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_optimizer_steps_give_the_same_weights(checkpoint: str, backward_by: str) -> None:
    plain = convnet().double()
    model = GPipe(copy.deepcopy(plain), [3, 5], chunks=4, checkpoint=checkpoint)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    opt_model = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
        y = torch.randint(0, 5, (8,))
        for net, opt in [(model, opt_model), (plain, opt_plain)]:
            opt.zero_grad()
            if net is plain:
                _replay_masks(model, plain)
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("balance", [[1, 2], [2, 1], [1, 1, 1]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inplace_layer_at_a_partition_boundary(
    balance: list[int], checkpoint: str, backward_by: str
) -> None:
    # ReLU(inplace=True) first in a partition modifies the partition's input: the copy kept
    # for recomputation must not see that, and recomputation may do it again.
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)).double()
    model = GPipe(copy.deepcopy(plain), balance, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    out, expected = model(x), plain(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    _assert_same_grads(model, plain, exact=False)


class Duplicated(nn.Module):
    """Hands on one tensor twice, as ``(h, h)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.linear(x)  # saved by no backward: the plain model may change it
        return h, h


class DoubleFirst(nn.Module):
    """Doubles the first of two tensors in place: in the plain model, both are one."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        a.mul_(2)
        return a + b * b


def duplicated_net() -> nn.Sequential:
    return nn.Sequential(Duplicated(4), DoubleFirst(), nn.Linear(4, 3)).double()


@pytest.mark.parametrize("balance", [[1, 2], [1, 1, 1]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_one_tensor_handed_on_twice_stays_one(
    balance: list[int], checkpoint: str, backward_by: str
) -> None:
    # The next stage receives the same tensor twice, as the next layer does in the
    # plain model: an in-place change of one is a change of the other.
    plain = duplicated_net()
    model = GPipe(copy.deepcopy(plain), balance, chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    out, expected = model(x), plain(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_one_tensor_returned_twice_is_one_output(
    chunks: int, checkpoint: str, backward_by: str
) -> None:
    # The outputs were gathered, and came out of the stages' node, once per place.
    plain = duplicated_net()
    model = GPipe(copy.deepcopy(plain[:1]), [1], chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    pair = model(x)
    assert pair[0] is pair[1]
    out, expected = plain[1:](pair), plain(x)  # the pair changed in place after the pipeline
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    _assert_same_grads(model, plain[:1], exact=False)


def test_defaultdict_input_and_output() -> None:
    class Double(nn.Module):
        def forward(self, d: defaultdict[str, Tensor]) -> defaultdict[str, Tensor]:
            assert d.default_factory is list  # the type and its factory arrive intact
            out: defaultdict[str, Tensor] = defaultdict(list)
            out["x"] = d["x"] * 2
            return out

    plain = nn.Sequential(Double(), Double())
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=3)
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    out = model(defaultdict(list, x=x))
    assert type(out) is defaultdict
    assert out.default_factory is list
    torch.testing.assert_close(out["x"], plain(defaultdict(list, x=x))["x"])


# Skip connections across partitions (torchgpipe.skip).


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * width, width)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.linear(torch.cat([x, skip], dim=1))


def _unet(width: int = 6, levels: int = 3) -> nn.Sequential:
    """Down 1..levels, a middle layer, Up levels..1: skips nested like a U-Net's."""
    spaces = [Namespace() for _ in range(levels)]
    downs = [Down(width).isolate(ns) for ns in spaces]
    ups = [Up(width).isolate(ns) for ns in reversed(spaces)]
    return nn.Sequential(*downs, nn.Linear(width, width), *ups)


def _long_skip(width: int = 6, middle: int = 8) -> nn.Sequential:
    """One skip from the first layer over `middle` layers to the last."""
    return nn.Sequential(Down(width), *[nn.Linear(width, width) for _ in range(middle)], Up(width))


SKIP_CASES = [
    ("unet", [7]),
    ("unet", [2, 3, 2]),
    ("unet", [1, 1, 1, 1, 1, 1, 1]),
    ("unet", [3, 4]),
    ("long", [1] * 10),
    ("long", [2, 4, 4]),
    ("long", [9, 1]),
]


@pytest.mark.parametrize(("name", "balance"), SKIP_CASES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_skips_match_the_plain_model(
    name: str, balance: list[int], chunks: int, checkpoint: str, backward_by: str
) -> None:
    plain = (_unet() if name == "unet" else _long_skip()).double()
    model = GPipe(copy.deepcopy(plain), balance, chunks=chunks, checkpoint=checkpoint)
    x1 = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out, expected = model(x1), plain(x2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    _assert_same_grads(model, plain, exact=False)
    assert x1.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inplace_first_layer_on_an_input_that_needs_grad(checkpoint: str, backward_by: str) -> None:
    # Regression: micro-batches are views of one input; with checkpoint='never' an
    # in-place first layer modified two views of a tensor that needs grad, and
    # backward failed its version check ("modified by an inplace operation").
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)
    leaf = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    model(leaf * 1).sum().backward()
    expected = leaf.grad.clone()  # type: ignore[union-attr]
    leaf.grad = None
    plain(leaf * 1).sum().backward()
    torch.testing.assert_close(expected, leaf.grad)
    _assert_same_grads(model, plain, exact=False)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inplace_first_layer_on_an_input_that_needs_no_grad(
    checkpoint: str, training: bool, backward_by: str
) -> None:
    # The micro-batches are views of one input sharing its version counter: an in-place
    # first layer on one of them must not fail what another saved (a Linear's input),
    # in training or in eval mode (no checkpointing there) with grad on.
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 4)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, checkpoint=checkpoint)
    model.train(training)
    plain.train(training)
    x = torch.randn(4, 4, dtype=torch.float64)
    out = model(x.clone())
    out.sum().backward()
    expected = plain(x.clone())
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    _assert_same_grads(model, plain, exact=False)


class _Counted(nn.Module):
    """Scales by a count of its calls, kept in a buffer: in place, or assigned anew."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.in_place:
            self.calls.add_(1)
        else:
            self.calls = self.calls + 1
        return x * (1 + 0.1 * self.calls)


def _buffered_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)),
        _Counted(in_place=True),
        nn.Tanh(),
        _Counted(in_place=False),
        nn.Linear(4, 3),
    ).double()


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_buffers_a_forward_changes_are_recomputed_from_where_it_started(
    chunks: int, checkpoint: str, backward_by: str
) -> None:
    # Spectral norm's power iteration and a call counter change buffers in the forward;
    # recomputation must compute what the forward did, and leave them as it did.
    x = torch.randn(6, 4, dtype=torch.float64)
    results = {}
    for mode in ("never", checkpoint):
        model = GPipe(_buffered_net(), [2, 3], chunks=chunks, checkpoint=mode)
        for _ in range(2):  # the second forward starts from the buffers the first left
            out = model(x)
            out.square().sum().backward()
        results[mode] = (out, model.state_dict(), {n: p.grad for n, p in model.named_parameters()})
    out, state, grads = results[checkpoint]
    torch.testing.assert_close(out, results["never"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, results["never"][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads, results["never"][2], rtol=1e-10, atol=1e-12)
    if chunks == 1:  # one micro-batch: the plain model's run
        plain = _buffered_net()
        for _ in range(2):
            expected = plain(x)
            expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state, plain.state_dict(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_functional_call_recomputes_with_the_parameters_it_was_given(
    checkpoint: str, backward_by: str
) -> None:
    plain = mlp().double()
    model = GPipe(copy.deepcopy(plain), [2, 3], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 6, dtype=torch.float64)
    given = {k: v.detach() * 2 for k, v in plain.named_parameters()}
    ours = {k: v.clone().requires_grad_() for k, v in given.items()}
    theirs = {k: v.clone().requires_grad_() for k, v in given.items()}
    torch.func.functional_call(model, ours, (x,)).square().sum().backward()
    torch.func.functional_call(plain, theirs, (x,)).square().sum().backward()
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())  # not the module's own


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_functional_call_with_computed_parameters_is_refused_by_a_checkpointed_cell(
    checkpoint: str, backward_by: str
) -> None:
    model = GPipe(mlp(), [2, 3], chunks=3, checkpoint=checkpoint)
    scale = torch.tensor(2.0, requires_grad=True)
    given = {k: v.detach() * scale for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match="computed from other tensors"):
        torch.func.functional_call(model, given, (torch.randn(6, 6),)).sum().backward()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_layer_that_changes_its_own_parameter_in_its_forward(
    checkpoint: str, backward_by: str
) -> None:
    # Embedding(max_norm=...) renormalizes the rows it looks up, in place, each forward.
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)).double()

    x = torch.randint(0, 10, (6, 3))
    results = []
    for mode in ("never", checkpoint):
        model = GPipe(build(), [1, 1], chunks=3, checkpoint=mode)
        model(x).square().sum().backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-12)


def test_layers_changed_after_wrapping_are_guarded_as_they_are_now(backward_by: str) -> None:
    # Pruning a wrapped layer, then making it permanent, changes its parameters and
    # buffers; the next run's recomputation follows the modules as they are then.
    prune = pytest.importorskip("torch.nn.utils.prune")
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    model = GPipe(copy.deepcopy(plain), [2, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 4, dtype=torch.float64)
    for layers in (model, plain):
        layers(x).sum().backward()
        prune.l1_unstructured(layers[0], "weight", amount=0.5)
        layers.zero_grad()
        layers(x).sum().backward()
        prune.remove(layers[0], "weight")
        layers(x).square().sum().backward()
    _assert_same_grads(model, plain, exact=False)
    seen = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(is_checkpointing())
            return x

    model = GPipe(nn.Sequential(nn.Linear(4, 4), Probe()), [2], checkpoint="always").double()
    model(x).sum().backward()
    with torch.no_grad():
        model(x)
    assert seen == [True, False, False]  # forward, recomputation, no_grad forward


def test_retain_graph_recomputes_from_the_same_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's way keeps the graph (retain_graph=True): each recomputation starts
    # from a copy of the forward's buffers.
    from torchgpipe import pipeline

    monkeypatch.setattr(pipeline, "workers_run_backward", lambda devices: False)
    model = GPipe(_buffered_net(), [2, 3], chunks=2, checkpoint="always")
    out = model(torch.randn(4, 4, dtype=torch.float64))
    out.sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out.sum().backward()
    second = [p.grad for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close([2 * g for g in first], second, rtol=1e-12, atol=1e-12)


def test_a_run_keeps_no_parameter_alive_after_its_backward(backward_by: str) -> None:
    model = GPipe(mlp(), [2, 3], chunks=2, checkpoint="always")
    given = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    torch.func.functional_call(model, given, (torch.randn(4, 6),)).sum().backward()
    refs = [weakref.ref(p) for p in given.values()]
    del given
    gc.collect()
    assert all(ref() is None for ref in refs)


class _DoubleFirstOfInput(nn.Module):
    """Doubles the first of its two inputs in place and multiplies them."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        c, d = pair
        c.mul_(2)  # d is c when the caller passed one tensor twice
        return c * d


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_one_tensor_given_twice_is_one_tensor_in_every_micro_batch(
    checkpoint: str, backward_by: str
) -> None:
    plain = nn.Sequential(_DoubleFirstOfInput(), nn.Linear(4, 1)).double()
    model = GPipe(copy.deepcopy(plain), [1, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4, dtype=torch.float64)
    y = x.clone()
    out, expected = model((x, x)), plain((y, y))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    _assert_same_grads(model, plain, exact=False)


class ClosedOver(nn.Module):
    """Scales by a tensor it holds without registering it (a list hides it from Module)."""

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.held = [scale]
        self.checkpointing: list[bool] = []  # per forward (not recomputation)

    def forward(self, x: Tensor) -> Tensor:
        if not is_recomputing():
            self.checkpointing.append(is_checkpointing())
        return x * self.held[0]


def closed_over_net(scale: Tensor) -> nn.Sequential:
    """A first partition (``[2, 1]``) with no parameter, scaled by ``scale``, closed over."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Tanh(), ClosedOver(scale), nn.Linear(4, 3)).double()


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_tensor_a_layer_closes_over_gets_the_plain_models_gradient(
    checkpoint: str, chunks: int, backward_by: str
) -> None:
    # A checkpointed cell whose inputs and parameters want no gradient recorded no graph,
    # so the tensor got none ('always': the backward refused, "does not require grad")
    # or the last micro-batch's share alone ('except_last'). torchgpipe 0.0.7's gave it.
    scale = torch.tensor([1.5, -2.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    model = GPipe(closed_over_net(scale), [2, 1], chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    out = model(x)
    out.square().sum().backward()
    got, scale.grad = scale.grad, None
    plain = closed_over_net(scale)
    expected = plain(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    assert got is not None
    torch.testing.assert_close(got, scale.grad)
    _assert_same_grads(model, plain, exact=False)
    # Its forward still says it is checkpointed, as every cell of the mode's does.
    checkpointed = model[1].checkpointing  # type: ignore[attr-defined]
    stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    assert checkpointed == [True] * stop + [False] * (chunks - stop)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_autograd_grad_of_a_closed_over_tensor_matches_the_plain_model(
    checkpoint: str, engine_backward: None
) -> None:
    # In the caller's graph every cell of the partition is a plain call: one of them
    # checkpointed (a node whose recomputation hands back only its inputs' and its
    # parameters' gradients) gave torch.autograd.grad the first micro-batch's share alone.
    scale = torch.tensor([1.5, -2.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    model = GPipe(closed_over_net(scale), [2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 4, dtype=torch.float64)
    (got,) = torch.autograd.grad(model(x).square().sum(), [scale])
    (expected,) = torch.autograd.grad(closed_over_net(scale)(x).square().sum(), [scale])
    torch.testing.assert_close(got, expected)


class _Kept(nn.Module):
    """Doubles its input, keeping weak references to each input and output."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        y = x * 2
        self.refs += [weakref.ref(x), weakref.ref(y)]
        return y


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_frozen_partition_keeps_no_input_or_output_until_the_backward(checkpoint: str) -> None:
    # A graph per stage (CPU partitions): no gradient goes back through what wants
    # none, so its cells keep none of it: neither the outputs (the next stage holds what
    # it needs of them) nor the copies of the micro-batches (in the caller's graph, what
    # a cell keeps is the plain model's rule).
    kept = _Kept()
    frozen = nn.Linear(4, 4).requires_grad_(False)
    model = GPipe(
        nn.Sequential(kept, frozen, nn.Linear(4, 2)), [2, 1], chunks=4, checkpoint=checkpoint
    )
    out = model(torch.randn(8, 4))
    gc.collect()
    assert [ref() for ref in kept.refs] == [None] * 8
    out.sum().backward()


def _scripted_net() -> nn.Sequential:
    torch.manual_seed(3)
    traced = torch.jit.trace(nn.Linear(6, 6).double(), torch.zeros(2, 6, dtype=torch.float64))
    return nn.Sequential(
        nn.Linear(4, 6),
        torch.jit.script(nn.BatchNorm1d(6)),
        nn.Tanh(),
        traced,
        torch.jit.script(nn.Linear(6, 3)),
    ).double()


@pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:DeprecationWarning")
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_torchscript_layers_match_the_plain_model(checkpoint: str, backward_by: str) -> None:
    # Regression: a checkpointed cell read a scripted module's parameters and buffers by
    # a get() that their TorchScript tables do not have (AttributeError).
    plain = _scripted_net()  # twice: a deep copy of a scripted module holds no leaves
    model = GPipe(_scripted_net(), [2, 3], chunks=3, checkpoint=checkpoint)
    x = torch.randn(9, 4, dtype=torch.float64)
    out = model(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    # Batch norm sees each micro-batch apart: so does the plain model here.
    expected = torch.cat([plain(part) for part in x.chunk(3)])
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)
    _assert_same_grads(model, plain, exact=False)
