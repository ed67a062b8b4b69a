"""torchgpipe.split: any module as pipeline stages, the same outputs and gradients."""

from __future__ import annotations

import copy
import pickle
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from helpers import PopAdd, StashLinear, Versioned
from split_models import (
    Keywords,
    ReadsProjection,
    ReadsTiedHead,
    TinyGPT,
    UShaped,
    WithUnused,
)
from torch import Tensor, nn
from torch.nn import functional as F

from torchgpipe import GPipe, split
from torchgpipe.balance import balance_by_time
from torchgpipe.split import SplitError, Stage
from torchgpipe.training import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)

MODES = ["always", "except_last", "never"]
SCHEDULES: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "zero-bubble": ScheduleZeroBubble,
    "interleaved": partial(ScheduleInterleaved1F1B, virtual_stages=2),
}


def _gpt() -> tuple[TinyGPT, Tensor, Tensor]:
    torch.manual_seed(0)
    model = TinyGPT()
    ids = torch.randint(0, 32, (8, 8))
    return model, ids, torch.randint(0, 32, (8, 8))


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _grads(model: nn.Module) -> dict[str, Tensor]:
    """Every name of every parameter, with its gradient (a tied one under both names)."""
    return {
        name: p.grad.clone()
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }


def _pipe_grads(pipe: nn.Module) -> dict[str, Tensor]:
    kept = pipe.state_dict(keep_vars=True)
    return {
        k: v.grad.clone()
        for k, v in kept.items()
        if isinstance(v, nn.Parameter) and v.grad is not None
    }


def _assert_close(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


# Splitting.


def test_split_computes_what_the_module_computes_on_its_own_parameters() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, at=["blocks.1", "blocks.3", "norm"])
    assert len(stages) == 4
    assert all(isinstance(s, Stage) for s in stages)
    torch.testing.assert_close(stages(ids), model(ids), rtol=0, atol=0)
    assert stages[1].get_submodule("blocks.1") is model.blocks[1]  # the module itself, no copy
    assert stages[0].tokens.weight is model.tokens.weight
    assert stages[3].head.weight is model.tokens.weight  # tied: one tensor, as in the model


def test_a_tensor_for_a_later_stage_skips_the_stages_between() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, at=["blocks.1", "blocks.2", "blocks.3"])
    # The mask is made in stage 0 and used by every block: stage 1 gets it with its
    # input, stages 2 and 3 straight from stage 0.
    assert len(stages[0].stash_names) == 2
    assert [len(s.pop_names) for s in stages] == [0, 0, 1, 1]
    assert all(len(s.stash_names) == 0 for s in stages[1:])


def test_u_shape_long_skips_go_straight_to_their_level() -> None:
    torch.manual_seed(0)
    model = UShaped()
    x = torch.randn(6, 8)
    stages = split(model, x, at=["down.1", "down.2", "middle", "up.0", "up.1", "up.2"])
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)
    # A stage starts with the call of its module: the sum before up.k is the previous
    # stage's. So down.0's output (stage 0) is used in stage 5, down.1's (stage 1) in
    # stage 4: each goes straight there. down.2's is used by the next stage.
    assert stages[0].stash_names == ("down_0@5",)
    assert stages[1].stash_names == ("down_1@4",)
    assert [len(s.pop_names) for s in stages] == [0, 0, 0, 0, 1, 1, 0]


def test_keyword_inputs_and_structured_outputs() -> None:
    torch.manual_seed(0)
    model = Keywords()
    x, scale = torch.randn(4, 6), torch.randn(4, 6)
    stages = split(model, {"x": x, "scale": scale}, at=["second", "third"])
    ours, theirs = stages({"scale": scale, "x": x}), model(x=x, scale=scale)
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    positional = split(model, (x, scale), at=["third"])
    torch.testing.assert_close(positional((x, scale)), theirs, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"lacks \['scale'\]"):
        stages({"x": x})


class _KeywordOnlyAfterADefault(nn.Module):
    """``forward(x, extra=None, *, feats)``: a given default before a keyword-only one."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: Tensor, extra: Tensor | None = None, *, feats: Tensor) -> Tensor:
        h = self.first(x) + feats
        if extra is not None:
            h = h * extra
        return self.second(h)


def test_a_given_default_before_a_keyword_only_argument_splits() -> None:
    # fx wrote the given argument with its default before the keyword-only one: a
    # SyntaxError in its generated code.
    torch.manual_seed(0)
    model = _KeywordOnlyAfterADefault()
    x, extra, feats = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    stages = split(model, {"x": x, "extra": extra, "feats": feats}, at=["second"])
    got = stages({"x": x, "extra": extra, "feats": feats})
    torch.testing.assert_close(got, model(x, extra, feats=feats), rtol=0, atol=0)


def test_state_dict_keys_are_the_models_and_load_both_ways() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, at=["blocks.2"])
    assert list(stages.state_dict()) == list(model.state_dict())
    other = TinyGPT()
    stages.load_state_dict(other.state_dict())
    torch.testing.assert_close(stages(ids), other(ids), rtol=0, atol=0)
    fresh = TinyGPT()
    fresh.load_state_dict(stages.state_dict())
    torch.testing.assert_close(fresh(ids), other(ids), rtol=0, atol=0)


class _WithVersioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.v, self.b = nn.Linear(4, 4), Versioned(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.v(self.a(x)))


def test_state_dicts_keep_the_modules_versions_under_the_models_paths() -> None:
    # Regression: the versions stayed under the stage-indexed paths ("0.v") while the keys
    # lost the index, so every load took a current checkpoint for an old one (and the
    # reverse: a plain model's versions did not reach the stages).
    x = torch.randn(6, 4)
    plain = _WithVersioned()
    with torch.no_grad():
        plain.v.g.fill_(5.0)
    saved = GPipe(split(plain, x, at=["b"]), [1, 1]).state_dict()
    assert saved._metadata["v"]["version"] == 2  # type: ignore[attr-defined]
    fresh = _WithVersioned()
    fresh.load_state_dict(saved)
    pipe = GPipe(split(_WithVersioned(), x, at=["b"]), [1, 1])
    pipe.load_state_dict(plain.state_dict())
    with torch.device("meta"):
        meta = split(_WithVersioned(), x.to("meta"), at=["b"])
    for gain in (fresh.v.g, pipe.state_dict()["v.g"], GPipe(meta, [1, 1], state_dict=saved)[0].v.g):
        assert gain.tolist() == [5.0] * 4


class _Parted(Versioned):
    """A versioned module with a gain of its own and two children, cut between them."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.l1(x)) * self.g


class _HoldsParted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p, self.h = _Parted(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.h(self.p(x))


def _nested() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(Versioned(), nn.Linear(4, 4)), nn.Linear(4, 4))


def _numbered() -> nn.Sequential:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), Versioned(), nn.Linear(4, 4), Versioned()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    ("build", "at", "gains"),
    [
        (_numbered, ["2", "3"], ["2.g", "4.g"]),  # stages named as the model's own layers
        (_HoldsParted, ["p.l2"], ["p.g"]),  # a module cut in two: a Placeholder holds it
        (_nested, ["1"], ["0.0.g"]),  # a stage's paths ("0.0") are the model's too
    ],
    ids=["numbered", "placeholder", "nested"],
)
def test_versions_survive_names_shared_with_stages_and_modules_cut_in_two(
    build: Callable[[], nn.Module], at: list[str], gains: list[str]
) -> None:
    # Regression: a stage's own entry took the place of the model's layer of the same
    # name (its versions lost), and a Placeholder recorded its own version, 1.
    x = torch.randn(6, 4)
    plain = build()
    with torch.no_grad():
        for key in gains:
            plain.get_parameter(key).fill_(5.0)
    saved = GPipe(split(plain, x, at=at), [1] * (len(at) + 1)).state_dict()
    fresh = build()
    fresh.load_state_dict(saved)
    given = plain.state_dict()
    versions = dict(given._metadata)  # type: ignore[attr-defined]
    pipe = GPipe(split(build(), x, at=at), [1] * (len(at) + 1))
    pipe.load_state_dict(given)
    assert dict(given._metadata) == versions  # type: ignore[attr-defined]  # left as it came
    for key in gains:
        assert fresh.get_parameter(key).tolist() == [5.0] * 4
        assert pipe.state_dict()[key].tolist() == [5.0] * 4


def test_a_load_that_a_module_cut_in_parts_would_convert_is_refused() -> None:
    # _Parted doubles its gain when it loads version 1: its parts loaded without it, and
    # the split model silently held half the gain the plain model would have loaded.
    x = torch.randn(6, 4)
    old = _HoldsParted().state_dict()
    old._metadata["p"]["version"] = 1  # type: ignore[attr-defined]
    pipe = GPipe(split(_HoldsParted(), x, at=["p.l2"]), [1, 1])
    with pytest.raises(RuntimeError, match=r"holds 'p' at version 1, which its _Parted "):
        pipe.load_state_dict(old)
    # What the cut module would not convert loads: no versions (safetensors' files), or
    # none of its keys.
    pipe.load_state_dict(dict(pipe.state_dict()))
    pipe.load_state_dict({k: v for k, v in old.items() if k.startswith("h.")}, strict=False)
    plain = _HoldsParted()
    plain.load_state_dict(old)  # as the message says: the plain model, then split
    assert plain.p.g.tolist() == [2.0] * 4
    pipe = GPipe(split(plain, x, at=["p.l2"]), [1, 1])
    pipe.load_state_dict(plain.state_dict())  # of its own version: nothing to convert
    assert pipe.state_dict()["p.g"].tolist() == [2.0] * 4


def test_a_load_that_raises_leaves_the_given_versions_as_they_came() -> None:
    # torch runs no hook after a load that raised: GPipe's load takes the versions added
    # for the stages out itself (a bare split model, at its next load or state_dict()).
    x = torch.randn(6, 4)
    given = _nested().state_dict()
    versions = dict(given._metadata)  # type: ignore[attr-defined]
    pipe = GPipe(split(_nested(), x, at=["1"]), [1, 1])

    def refuse(*args: Any) -> None:
        raise ValueError("a checkpoint of another run")

    handle = pipe[1].register_load_state_dict_pre_hook(refuse)
    with pytest.raises(ValueError, match="another run"):
        pipe.load_state_dict(given)
    handle.remove()
    assert dict(given._metadata) == versions  # type: ignore[attr-defined]
    other = _nested()
    other.load_state_dict(given)
    assert other[0][0].g.tolist() == [1.0] * 4


def test_split_of_a_sequential_keeps_its_keys() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    stages = split(model, torch.randn(2, 3), at=["2", "4"])
    assert list(stages.state_dict()) == list(model.state_dict())
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data.normal_()
    stages.load_state_dict(twin.state_dict())
    torch.testing.assert_close(stages[2].get_submodule("4").weight, twin[4].weight)


def test_copies_and_pickles_run() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, at=["blocks.2"])
    for twin in (copy.deepcopy(stages), pickle.loads(pickle.dumps(stages))):
        torch.testing.assert_close(twin(ids), model(ids), rtol=0, atol=0)
        assert list(twin.state_dict()) == list(model.state_dict())


def test_balanced_stages_and_balance_by_time() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, stages=3)
    assert len(stages) == 3
    torch.testing.assert_close(stages(ids), model(ids), rtol=0, atol=0)
    fine = split(
        model, ids, at=["positions", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm"]
    )
    balance = balance_by_time(3, fine, ids, timeout=0.2)
    pipe = GPipe(fine, balance, chunks=2)
    torch.testing.assert_close(pipe(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_balanced_split_traces_into_a_wrapper_when_it_must() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = UShaped()

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x)

    torch.manual_seed(0)
    model, x = Wrapper(), torch.randn(4, 8)
    stages = split(model, x, stages=4, by="size")
    assert len(stages) == 4
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_balanced_cuts_keep_a_module_called_many_times_in_one_stage() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.third = (nn.Linear(8, 8) for _ in range(3))
            self.act = nn.ReLU()  # one module, called after each layer

        def forward(self, x: Tensor) -> Tensor:
            x = self.act(self.first(x))
            x = self.act(self.second(x))
            return self.third(x)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.front, self.shared, self.back = Shared(), Shared(), nn.Linear(8, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.back(self.shared(self.front(x)))

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(4, 8)
    stages = split(model, x, stages=2)  # traced into neither Shared: three calls
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)
    with pytest.raises(SplitError, match="calls 'act' in stage 0"):
        split(Shared(), x, at=["second"])


def test_a_device_read_in_one_stage_is_read_again_in_the_next() -> None:
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.middle = nn.Embedding(10, 4), nn.Linear(4, 4)
            self.positions = nn.Embedding(8, 4)

        def forward(self, ids: Tensor) -> Tensor:
            device = ids.device
            x = self.middle(self.tokens(ids))
            return x + self.positions(torch.arange(ids.size(1), device=device))

    model, ids = Positions(), torch.randint(0, 10, (4, 8))
    stages = split(model, ids, at=["middle"])
    handed_on = stages[0](ids)
    assert not any(isinstance(value, torch.device) for value in handed_on)
    torch.testing.assert_close(stages(ids), model(ids), rtol=0, atol=0)


def test_a_device_is_read_again_from_a_tensor_on_it() -> None:
    class Lengths(nn.Module):  # lengths stay on the CPU wherever the rest goes
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
            device = x.device
            h = self.first(x) + torch.ones(4, device=device)
            return self.second(h) + torch.zeros(4, device=device) + lengths.float()[:, None]

    model = Lengths()
    x, lengths = torch.randn(3, 4), torch.tensor([1, 2, 3])
    stages = split(model, (x, lengths), at=["second"])
    code = stages[1].graph.python_code("self").src
    assert "= add.device" in code  # read from what the first stage made, not from lengths
    torch.testing.assert_close(stages((x, lengths)), model(x, lengths), rtol=0, atol=0)


def test_code_that_depends_on_the_mode_is_refused() -> None:
    class Moody(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(F.dropout(self.a(x), 0.5, training=self.training))

    with pytest.raises(SplitError, match=r"test_split\.py:\d+\).*depends on train\(\) or eval"):
        split(Moody(), torch.randn(2, 2), at=["b"])

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x))

    class Outer(nn.Module):  # stages=3 must trace into one of two: the larger fails
        def __init__(self) -> None:
            super().__init__()
            self.moody, self.pair = Moody(), Pair()
            self.moody.a = nn.Linear(2, 2, bias=True)
            self.moody.b = nn.Linear(2, 2, bias=True)
            self.moody.extra = nn.Linear(8, 8)  # the larger of the two

        def forward(self, x: Tensor) -> Tensor:
            return self.pair(self.moody(x))

    model = Outer().eval()
    stages = split(model, torch.randn(2, 2), stages=3)
    assert stages[0].get_submodule("moody") is model.moody  # called whole
    x = torch.randn(2, 2)
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_split_leaves_the_module_as_it_was() -> None:
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x) + torch.tensor([1.0, 2.0]))  # fx keeps it on the module

    model = Constant()
    before = set(vars(model))
    stages = split(model, torch.randn(3, 2), at=["b"])
    assert set(vars(model)) == before
    x = torch.randn(3, 2)
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_missing_keys_are_named_as_the_model_names_them() -> None:
    model, ids, _ = _gpt()
    stages = split(model, ids, at=["blocks.2"])
    state = model.state_dict()
    del state["norm.weight"]
    report = stages.load_state_dict(state, strict=False)
    assert report.missing_keys == ["norm.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key.*"norm\.weight"'):
        stages.load_state_dict(state)


# What cannot be split, and why.


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x)
        if x.sum() > 0:  # the line the error names
            x = -x
        return self.b(x)


def test_data_dependent_control_flow_is_named_by_its_line() -> None:
    with pytest.raises(SplitError, match=r"test_split\.py:\d+ in forward \(`if x\.sum\(\) > 0:"):
        split(_Branchy(), torch.randn(2, 2), at=["b"])


def test_control_flow_inside_a_submodule_is_fine() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.branchy, self.last = _Branchy(), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.last(self.branchy(x))

    model, x = Outer(), torch.randn(3, 2)
    torch.testing.assert_close(split(model, x, at=["last"])(x), model(x))


def test_split_points_must_name_called_submodules_in_order() -> None:
    model, ids, _ = _gpt()
    with pytest.raises(SplitError, match=r"'blocks\.9' names no submodule.*did you mean"):
        split(model, ids, at=["blocks.9"])
    with pytest.raises(SplitError, match="follow the order of the forward"):
        split(model, ids, at=["blocks.2", "blocks.1"])
    with pytest.raises(SplitError, match="first stage would be empty"):
        split(UShaped(), torch.randn(2, 8), at=["down.0"])
    model.unused = nn.Linear(2, 2)
    with pytest.raises(SplitError, match=r"'unused' .* never calls"):
        split(model, ids, at=["unused"])


def test_an_empty_container_as_a_split_point_is_refused_as_one() -> None:
    # The forward calls it, but the trace records no call of an empty nn.Sequential:
    # the message said the forward never called it.
    class Shortcut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.shortcut, self.c = nn.Linear(4, 4), nn.Sequential(), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.c(self.shortcut(self.a(x)))

    with pytest.raises(SplitError, match=r"'shortcut' is an empty Sequential.* next submodule"):
        split(Shortcut(), torch.randn(6, 4), at=["shortcut"])
    model, x = Shortcut(), torch.randn(6, 4)
    torch.testing.assert_close(split(model, x, at=["c"])(x), model(x))  # the one after it


def test_a_module_called_from_two_stages_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.middle = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.shared(self.middle(self.shared(x)))

    with pytest.raises(
        SplitError, match=r"calls 'shared' in stage 0 .*test_split\.py.* in stage 1"
    ):
        split(Twice(), torch.randn(2, 2), at=["middle"])


def test_too_many_stages_and_bad_arguments() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(SplitError, match="into 3 stages"):
        split(model, torch.randn(2, 2), stages=3)
    with pytest.raises(TypeError, match=r"exactly one of at=.*got neither"):
        split(model, torch.randn(2, 2))
    with pytest.raises(TypeError, match=r"exactly one of at=.*got both"):
        split(model, torch.randn(2, 2), at=["0"], stages=2)
    with pytest.raises(TypeError, match="has no default"):
        split(Keywords(), torch.randn(2, 6), at=["third"])
    with pytest.raises(ValueError, match="by is 'time' or 'size', got 'bogus'"):
        split(model, torch.randn(2, 2), at=["1"], by="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stages must be a positive int, got 0"):
        split(model, torch.randn(2, 2), stages=0)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"on the meta device.*at=\[\.\.\.\]"):
        split(meta, torch.randn(2, 2), stages=2)


# What the forward does besides computing: constants, in-place changes, state.


class _Pair(nn.Module):
    """Two layers, and a forward to fill in."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_split_gives_each_call_a_fresh_copy_of_a_constant_changed_in_place() -> None:
    class Accumulates(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            total = torch.zeros(4)  # fx makes it once and keeps it
            h = self.a(x)
            total += h.detach().mean(0)
            return self.b(h) + total + torch.ones(4)

    model, x = Accumulates(), torch.randn(3, 4)
    stages = split(model, x, at=["b"])
    for _ in range(3):  # the example's run and each call start from zeros
        torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)
    copied = [n for s in stages for n in s.graph.nodes if n.target == "clone"]
    assert len(copied) == 1  # only the constant changed in place: torch.ones(4) is not


def test_split_refuses_a_random_draw_on_no_input() -> None:
    class Noisy(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x) + torch.randn(4))

    with pytest.raises(SplitError, match=r"randn\(\.\.\.\) at .*test_split\.py:\d+.*randn_like"):
        split(Noisy(), torch.randn(3, 4), at=["b"])

    class Drawn(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            return self.b(h + torch.randn_like(h) + h.new_empty(4).normal_())

    model, x = Drawn(), torch.randn(3, 4)
    stages = split(model, x, at=["b"])
    torch.manual_seed(1)
    ours = stages(x)
    torch.manual_seed(1)
    torch.testing.assert_close(ours, model(x), rtol=0, atol=0)
    assert not torch.equal(stages(x), ours)  # a new draw at each call


class _Counter(_Pair):
    """Counts its calls in a buffer changed in place, read after ``b`` (``late``) or before."""

    def __init__(self, late: bool) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros(()))
        self.late = late

    def forward(self, x: Tensor) -> Tensor:
        self.step.add_(1)
        if self.late:
            return self.b(self.a(x)) * self.step
        return self.b(self.a(x) * self.step)


def test_split_refuses_a_buffer_changed_in_one_stage_and_read_in_another() -> None:
    # Each partition that reads a buffer holds its own copy: stage 1's step stayed at
    # 0 while stage 0's counted, and GPipe's outputs drifted from the model's, silently.
    model, x = _Counter(late=True), torch.randn(3, 4)
    with pytest.raises(
        SplitError,
        match=r"'step' is changed in place by add_ in stage 0 \(.*\) and read in stage\(s\) \[1\]",
    ):
        split(model, x, at=["b"])
    model = _Counter(late=False)  # read and changed in stage 0 alone: fine
    plain, pipe = copy.deepcopy(model), GPipe(split(model, x, at=["b"]), [1, 1])
    for _ in range(3):
        torch.testing.assert_close(pipe(x), plain(x), rtol=0, atol=0)


def test_split_says_to_give_a_factory_its_sizes_as_one_tuple() -> None:
    class Masked(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            n = x.size(0)
            return self.b(self.a(x)) + torch.ones(n, 4, device=x.device)

    with pytest.raises(SplitError, match=r"sizes one by one.*torch.ones\(\(T, T\), \.\.\.\)"):
        split(Masked(), torch.randn(3, 4), at=["b"])


def test_a_constant_changed_in_place_by_a_method_is_one_tensor_for_its_uses() -> None:
    # fx reads the constant anew at each use; each got a copy of its own, so the read
    # after acc.add_(...) saw zeros (wrong by 1.2, with one stage too).
    class Adds(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            acc = torch.zeros(4)
            acc.add_(x.sum(0))
            return self.b(self.a(x) + acc)

    model, x = Adds(), torch.randn(3, 4)
    for at in (["b"], []):
        stages = split(model, x, at=at)
        for _ in range(2):
            torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


class _Viewed(_Pair):
    """A buffer changed through a view (``how``) before ``b``, read after it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("buf", torch.zeros(4))
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        if self.how == "slice":
            self.buf[:2].add_(1)
        elif self.how == "view":
            self.buf.view(2, 2).add_(1)
        elif self.how == "data":
            self.buf.data.add_(1)
        else:  # a buffer of a submodule split calls whole, in stage 1
            self.bn.running_mean.mul_(0.5)
        return self.bn(self.b(self.a(x)) + self.buf)


@pytest.mark.parametrize("how", ["slice", "view", "data", "submodule"])
def test_split_refuses_a_buffer_changed_through_a_view_or_read_by_a_submodule(how: str) -> None:
    target = "bn.running_mean" if how == "submodule" else "buf"
    with pytest.raises(SplitError, match=rf"'{target}' is changed in place .* in stage 0"):
        split(_Viewed(how).eval(), torch.randn(3, 4), at=["b"])


def test_split_refuses_a_value_changed_in_place_by_a_later_stage() -> None:
    class Doubles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            y = self.b(h + 1)
            h.mul_(2)  # in stage 1, on stage 0's value, which stage 2 reads
            return self.c(y) + h

    model, x = Doubles(), torch.randn(3, 4)
    with pytest.raises(
        SplitError, match=r"'a' made in stage 0 .*changed in place by mul_ in stage 1.*out-of-place"
    ):
        split(model, x, at=["b", "c"])
    stages = split(model, x, at=["c"])  # made and changed in one stage: fine
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_split_stages_hold_the_modules_own_buffers() -> None:
    class Scaled(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("log_scale", torch.zeros(4))
            self.register_buffer("pe", torch.randn(1, 16, 4))

        def forward(self, x: Tensor) -> Tensor:
            x = x + self.pe[:, : x.size(1)]  # a positional encoding, sliced to the length
            return self.b(self.a(x) * self.log_scale.exp())

    model, x = Scaled(), torch.randn(2, 5, 4)
    stages = split(model, x, at=["b"])
    assert list(stages.state_dict()) == list(model.state_dict())
    assert stages[0].log_scale is model.log_scale
    other = Scaled()
    other.log_scale.fill_(1.0)
    stages.load_state_dict(other.state_dict())
    torch.testing.assert_close(stages(x), other(x), rtol=0, atol=0)
    fresh = Scaled()
    fresh.load_state_dict(stages.state_dict())
    torch.testing.assert_close(fresh(x), other(x), rtol=0, atol=0)
    torch.testing.assert_close(stages(x[:, :3]), other(x[:, :3]), rtol=0, atol=0)


def test_split_refuses_a_value_stored_on_the_module_and_puts_it_back() -> None:
    class Auxiliary(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.aux_loss = torch.zeros(())
            self.seen: list[Tensor] = []

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            self.aux_loss = h.pow(2).mean()
            self.seen.append(h)
            self.last = h
            return self.b(h)

    model = Auxiliary()
    before = model.aux_loss
    with pytest.raises(SplitError, match=r"stores a value on the module \(self\.aux_loss.*output"):
        split(model, torch.randn(3, 4), at=["b"])
    assert model.aux_loss is before
    assert model.seen == []
    assert "last" not in vars(model)


def test_split_leaves_the_buffers_as_they_were() -> None:
    class Counts(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("running", torch.zeros(4))

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            self.seen.add_(x.size(0))
            self.running.mul_(0.9).add_(0.1 * h.detach().mean(0))
            return self.b(h)

    model, x = Counts(), torch.randn(8, 4)
    for stages in (split(model, x, at=["b"]), split(model, x, stages=2, by="size")):
        assert model.seen.item() == 0
        assert torch.equal(model.running, torch.zeros(4))
        stages(x)  # the split model updates them as the model does
        assert model.seen.item() == 8
        model.seen.zero_()
        model.running.zero_()


def test_split_model_refuses_keyword_inputs_not_in_the_example() -> None:
    torch.manual_seed(0)
    x, scale = torch.randn(4, 6), torch.randn(4, 6)
    stages = split(Keywords(), {"x": x, "scale": scale}, at=["third"])
    with pytest.raises(TypeError, match=r"has \['bias'\].*arguments \['x', 'scale'\]"):
        stages({"x": x, "scale": scale, "bias": x})
    with pytest.raises(TypeError, match=r"has \['typo'\]"):
        stages({"x": x, "scale": scale, "typo": 1})


def test_split_refuses_a_constant_that_depends_on_the_mode() -> None:
    class Scaled(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x)) * torch.tensor(0.5 if self.training else 1.0)

    with pytest.raises(SplitError, match=r"test_split\.py:\d+\).*depends on train\(\) or eval"):
        split(Scaled(), torch.randn(2, 4), at=["b"])


def test_split_error_for_an_assert_on_an_inputs_size_says_so() -> None:
    class Bounded(_Pair):  # nanoGPT's forward
        def forward(self, x: Tensor) -> Tensor:
            _, t = x.size()
            assert t <= 16, f"Cannot forward sequence of length {t}"
            return self.b(self.a(x))

    with pytest.raises(SplitError, match=r"an assert on an input's size .* take it out"):
        split(Bounded(), torch.randn(2, 4), at=["b"])


def test_split_of_a_split_model_says_to_split_the_original_again() -> None:
    model, x = UShaped(), torch.randn(2, 8)
    once = split(model, x, stages=2)
    with pytest.raises(SplitError, match=r"skip layers.*split's output: split the original"):
        split(once, x, stages=3)
    with pytest.raises(SplitError, match=r"holds torchgpipe\.skip layers.*as it is$"):
        split(nn.Sequential(StashLinear(), PopAdd()), torch.randn(2, 4), stages=2)


def test_split_errors_for_a_flag_or_none_in_the_example() -> None:
    class Flag(_Pair):
        def forward(self, x: Tensor, hidden: bool = False) -> Any:
            h = self.a(x)
            return (self.b(h), h) if hidden else self.b(h)

    class Optional(_Pair):
        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            h = self.a(x)
            return self.b(h if mask is None else h * mask)

    x = torch.randn(2, 4)
    with pytest.raises(SplitError, match=r"TraceError: .*likely cause.*a flag given there"):
        split(Flag(), {"x": x, "hidden": True}, at=["b"])
    with pytest.raises(SplitError, match=r"\['mask'\] as None.*leave them out"):
        split(Optional(), (x, None), at=["b"])
    model = Optional()
    torch.testing.assert_close(split(model, {"x": x}, at=["b"])({"x": x}), model(x))


# In the pipeline: the same outputs and gradients as the module.


@pytest.mark.parametrize("checkpoint", MODES)
def test_gpipe_of_a_split_transformer_is_transparent(checkpoint: str) -> None:
    model, ids, target = _gpt()
    reference = copy.deepcopy(model)
    pipe = GPipe(
        split(model, ids, at=["blocks.1", "blocks.3", "norm"]),
        [1, 1, 1, 1],
        chunks=4,
        checkpoint=checkpoint,
    )  # type: ignore[arg-type]
    _lm_loss(pipe(ids), target).backward()
    _lm_loss(reference(ids), target).backward()
    _assert_close(_pipe_grads(pipe), _grads(reference))
    assert list(pipe.state_dict()) == list(reference.state_dict())


def test_optimizer_state_moves_into_a_split_gpipe_by_name_as_the_readme_says() -> None:
    # The README: an optimizer's state goes by parameter name between a plain model and
    # its GPipe; in a split model each name is the plain one behind its stage's index.
    model, ids, target = _gpt()
    # SGD's momentum: Adam would turn the noise of a gradient that is zero in theory (the
    # attention's key bias) into whole steps, hiding what the test is about.
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        plain_opt.zero_grad()
        _lm_loss(model(ids), target).backward()
        plain_opt.step()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_opt.load_state_dict(plain_opt.state_dict())
    # Names read before the GPipe is built: it gives the model's later holder of the tied
    # weight a copy of its own, which the plain optimizer knows nothing of.
    by_name = dict(model.named_parameters(remove_duplicate=False))
    pipe = GPipe(split(model, ids, at=["blocks.2"]), [1, 1], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for name, p in pipe.named_parameters(remove_duplicate=False):
        opt.state[p] = copy.deepcopy(plain_opt.state[by_name[name.partition(".")[2]]])
    for optimizer, net in ((opt, pipe), (reference_opt, reference)):
        optimizer.zero_grad()
        _lm_loss(net(ids), target).backward()
        optimizer.step()
    ours = dict(pipe.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_step_a_split_transformer_like_the_module(name: str) -> None:
    model, ids, target = _gpt()
    reference = copy.deepcopy(model)
    pipe = GPipe(split(model, ids, at=["blocks.1", "blocks.3", "norm"]), [1, 1, 1, 1], chunks=4)
    result = SCHEDULES[name](pipe, _lm_loss).step(ids, target)
    loss = _lm_loss(reference(ids), target)
    loss.backward()
    torch.testing.assert_close(result.loss, loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_close(_pipe_grads(pipe), _grads(reference))


@pytest.mark.parametrize("checkpoint", MODES)
def test_gpipe_of_a_split_u_shape_and_keywords_is_transparent(checkpoint: str) -> None:
    torch.manual_seed(0)
    for model, example, at in [
        (UShaped(), torch.randn(8, 8), ["down.1", "middle", "up.1"]),
        (Keywords(), {"x": torch.randn(8, 6), "scale": torch.randn(8, 6)}, ["second", "third"]),
    ]:
        reference = copy.deepcopy(model)
        n = len(at) + 1
        pipe = GPipe(split(model, example, at=at), [1] * n, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
        ours = pipe(example)
        theirs = reference(**example) if isinstance(example, dict) else reference(example)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        _total(ours).backward()
        _total(theirs).backward()
        _assert_close(_pipe_grads(pipe), _grads(reference))


def _total(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return (value * value).sum()
    if isinstance(value, dict):
        return sum((_total(v) for v in value.values()), torch.zeros(()))
    return sum((_total(v) for v in value), torch.zeros(()))


def test_dropout_in_a_split_model_is_the_same_in_every_mode() -> None:
    torch.manual_seed(0)
    model = TinyGPT(dropout=0.2)
    ids = torch.randint(0, 32, (8, 8))
    grads = []
    for checkpoint in MODES:
        pipe = GPipe(
            split(copy.deepcopy(model), ids, at=["blocks.2"]),
            [1, 1],
            chunks=4,
            checkpoint=checkpoint,
        )  # type: ignore[arg-type]
        torch.manual_seed(5)
        pipe(ids).square().mean().backward()
        grads.append(_pipe_grads(pipe))
    for other in grads[1:]:
        _assert_close(other, grads[0])


# Across processes: PipelineStage runs the stages of a split model.


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_processes_step_a_split_u_shape_like_the_module(schedule: str, checkpoint: str) -> None:
    from test_nccl_transport import _play

    torch.manual_seed(0)
    plain = UShaped()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    at = ["down.2", "up.0", "up.2"]  # 4 stages, 2 per rank; skips cross the ranks
    build = lambda: split(copy.deepcopy(plain), x, at=at)  # noqa: E731
    results, rules = _play(2, schedule, build, [(x, y)], chunks=4, checkpoint=checkpoint)
    rules.check()
    for value in results:
        assert not isinstance(value, BaseException), value
    loss = F.mse_loss(plain(x), y)
    loss.backward()
    grads: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    for steps, part in results:
        torch.testing.assert_close(steps[0][0], loss.detach(), rtol=1e-5, atol=1e-6)
        grads.update({name.partition(".")[2]: grad for name, grad in steps[0][2].items()})
        state.update(part)
    _assert_close(grads, _grads(plain))
    assert sorted(state) == sorted(plain.state_dict())  # each rank: the model's keys


def test_processes_step_a_split_transformer_with_its_tied_head() -> None:
    from test_nccl_transport import _play

    model, ids, _ = _gpt()
    y = torch.randn(8, 8, 32)
    build = lambda: split(copy.deepcopy(model), ids, at=["blocks.2"])  # noqa: E731
    results, rules = _play(2, "1f1b", build, [(ids, y)], chunks=4)  # the head on rank 1
    rules.check()  # the step's transfers and the tie's
    for value in results:
        assert not isinstance(value, BaseException), value
    F.mse_loss(model(ids), y).backward()
    grads = {
        name.partition(".")[2]: grad for steps, _ in results for name, grad in steps[0][2].items()
    }
    _assert_close(grads, _grads(model))  # tokens.weight and head.weight: the sum of both uses


@pytest.mark.parametrize("checkpoint", MODES)
def test_processes_step_a_split_model_with_keyword_inputs_and_dict_outputs(checkpoint: str) -> None:
    from distributed_helpers import run_threads

    from torchgpipe.distributed import PipelineStage, Transport

    torch.manual_seed(0)
    plain = Keywords()
    inputs = {"x": torch.randn(8, 6), "scale": torch.randn(8, 6)}
    target = torch.randn(8, 3)
    models = [split(copy.deepcopy(plain), inputs, at=["second"]) for _ in range(2)]

    def loss_fn(output: dict[str, Any], target: Tensor) -> Tensor:
        h, g = output["both"]  # means: the step's loss averages the micro-batches'
        return F.mse_loss(output["out"], target) + (h * g).mean()

    def rank(transport: Transport) -> Any:
        stage = PipelineStage(
            models[transport.rank], [1, 1], transport=transport, chunks=4, checkpoint=checkpoint
        )
        result = Schedule1F1B(stage, loss_fn).step(
            inputs if stage.is_first else None, target if stage.is_last else None
        )
        grads = {n.partition(".")[2]: p.grad for n, p in stage.named_parameters()}
        return result.loss, grads

    results = run_threads(rank, 2, timeout=30.0)
    for value in results:
        assert not isinstance(value, BaseException), value
    loss = loss_fn(plain(**inputs), target)
    loss.backward()
    torch.testing.assert_close(results[0][0], loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_close({**results[0][1], **results[1][1]}, _grads(plain))


@pytest.mark.parametrize("how", ["at", "stages"])
def test_split_leaves_the_process_wide_generator_to_other_threads(how: str) -> None:
    # The example run and the balancing draw from generators of their own: the default
    # one is neither advanced nor put back (fork_rng would rewind it under a thread that
    # draws meanwhile, which would then get numbers it already had).
    class Drawn(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x) + torch.randn_like(x))

    model, x = Drawn(), torch.randn(3, 4)
    # The draw runs between a and b: hooks there see whether it moved the default one.
    states: list[Tensor] = []
    unchanged: list[bool] = []
    model.a.register_forward_pre_hook(lambda *_: states.append(torch.random.get_rng_state()))
    model.b.register_forward_pre_hook(
        lambda *_: unchanged.append(torch.equal(states[-1], torch.random.get_rng_state()))
    )
    if how == "at":
        split(model, x, at=["b"])
    else:
        split(model, x, stages=2)
    assert unchanged
    assert all(unchanged)


# What fx would keep as it was at split time, refused: modes, Python draws, hooks.


class _Teacher(_Pair):
    """A frozen part of the forward, in one of the ways users write it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.c = nn.Linear(4, 4)

    @torch.no_grad()
    def _frozen(self, h: Tensor) -> Tensor:
        return self.c(h)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.how == "method":
            t = self._frozen(h)
        elif self.how == "no_grad":
            with torch.no_grad():
                t = self.c(h)
        elif self.how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t = self.c(h)
        else:
            t = self.c(h).clamp(-1, 1) if torch.is_grad_enabled() else self.c(h)
        return self.b(h) + t


@pytest.mark.parametrize("how", ["method", "no_grad", "autocast", "reads"])
def test_split_refuses_code_under_a_mode_entered_in_the_forward(how: str) -> None:
    match = "depends on train.*is_grad_enabled" if how == "reads" else "runs under torch.no_grad"
    with pytest.raises(SplitError, match=rf"test_split\.py:\d+.*{match}"):
        split(_Teacher(how), torch.randn(3, 4), at=["b"])


def test_split_refuses_a_python_random_draw_and_leaves_random_as_it_was() -> None:
    class LayerDrop(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            return self.b(h) if random.random() > 0.5 else h

    draw = random.random
    with pytest.raises(SplitError, match=r"random\.random\(\.\.\.\) at .*test_split\.py"):
        split(LayerDrop(), torch.randn(3, 4), at=["b"])
    assert random.random is draw

    kept: list[Callable[[], float]] = []

    class Keeps(_Pair):  # as code that imports random's functions while a split runs
        def forward(self, x: Tensor) -> Tensor:
            kept.append(random.random)
            return self.b(self.a(x))

    split(Keeps(), torch.randn(3, 4), at=["b"])
    assert random.random is draw
    assert 0 <= kept[0]() < 1  # what it kept draws as ever once the split is over


_draw = random.random  # a name taken before the split: split's wrappers do not see it


@pytest.mark.parametrize("source", ["name", "instance"])
def test_split_refuses_a_random_draw_through_a_name_it_does_not_watch(source: str) -> None:
    # The draw was frozen into the graph: the split model never dropped the layer.
    draw = _draw if source == "name" else random.Random(0).random

    class LayerDrop(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            return h if self.training and draw() < 0.1 else self.b(h)

    with pytest.raises(SplitError, match=r"draws Python random numbers .* at .*test_split\.py:"):
        split(LayerDrop(), torch.randn(3, 4), at=["b"])


def test_split_lets_other_threads_draw_python_random_numbers() -> None:
    # The generator's state, compared before and after, refused valid models whenever
    # another thread drew meanwhile; the watch is the tracing thread's alone.
    stop = threading.Event()

    def draws() -> None:
        while not stop.is_set():
            random.random()

    thread = threading.Thread(target=draws)
    thread.start()
    try:
        for _ in range(3):
            split(nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)]), torch.randn(2, 4), at=["3"])
    finally:
        stop.set()
        thread.join()


def test_split_refuses_a_forward_that_looks_at_an_inputs_type() -> None:
    class Masked(_Pair):
        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            h = self.a(x)
            if isinstance(mask, torch.Tensor):  # False for fx's proxy: the mask was dropped
                h = h.masked_fill(mask, 0.0)
            return self.b(h)

    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    with pytest.raises(SplitError, match=r"computes other outputs than the module itself"):
        split(Masked(), {"x": x, "mask": mask}, at=["b"])

    class WithDropout(Masked):  # a Dropout in eval draws nothing: still compared
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
            return super().forward(self.drop(x), mask)

    with pytest.raises(SplitError, match=r"computes other outputs than the module itself"):
        split(WithDropout(), {"x": x, "mask": mask}, at=["b"])


def test_split_leaves_the_example_as_it_was() -> None:
    class Scales(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            x /= 255.0  # in place on the input, as image code does
            return self.b(self.a(x))

    x = torch.full((3, 4), 255.0)
    split(Scales(), x, at=["b"])
    assert torch.equal(x, torch.full((3, 4), 255.0))


def test_split_refuses_an_in_place_module_on_an_earlier_stages_value() -> None:
    class InPlace(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.act, self.c = nn.ReLU(inplace=True), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            g = self.b(x)
            return self.c(g + self.act(h)) + h

    model, x = InPlace(), torch.randn(3, 4)
    with pytest.raises(SplitError, match=r"made in stage 0 .*changed in place by act in stage 1"):
        split(model, x, at=["b"])
    stages = split(model, x, at=["c"])  # made and changed in one stage: fine
    torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.linear(x))


def test_split_refuses_one_module_under_two_names_in_two_stages() -> None:
    class Shares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = _Normed(), _Normed()
            self.second.norm = self.first.norm

        def forward(self, x: Tensor) -> Tensor:
            return self.second(self.first(x))

    with pytest.raises(
        SplitError, match=r"'first\.norm' in stage 0.*'second\.norm' in stage 1.*two names"
    ):
        split(Shares(), torch.randn(3, 4), at=["second"])


class _Chain(_Pair):
    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_split_refuses_hooks_on_the_model_itself() -> None:
    model = _Chain()
    handle = model.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(SplitError, match=r"_Chain has forward hooks.*register them on"):
        split(model, torch.randn(3, 4), at=["b"])
    handle.remove()
    split(model, torch.randn(3, 4), at=["b"])


class _Counted(_Chain):
    """A module whose extra state (a count) its state dict holds."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 7

    def get_extra_state(self) -> Any:
        return {"count": self.count}

    def set_extra_state(self, state: Any) -> None:
        self.count = state["count"]


class _Holds(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.head = inner, nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


def test_split_refuses_state_that_no_stage_would_hold() -> None:
    # The split model's state dict silently lacked the model's extra state (or one of a
    # module cut inside), and a load hook of either never ran: checkpoints of the model
    # did not load into the split model, nor the other way.
    x = torch.randn(3, 4)
    with pytest.raises(SplitError, match=r"_Counted has its own get_extra_state.*whole"):
        split(_Counted(), x, at=["b"])
    with pytest.raises(SplitError, match=r"_Parted has its own _load_from_state_dict"):
        split(_Parted(), x, at=["l2"])  # the model's own: no stage would convert for it
    with pytest.raises(SplitError, match=r"_Counted at 'inner' has its own get_extra_state"):
        split(_Holds(_Counted()), x, at=["inner.b"])
    renames = _Chain()
    renames._register_load_state_dict_pre_hook(lambda *args: None)
    with pytest.raises(
        SplitError, match=r"_Chain at 'inner' has state-dict hooks.*at its boundaries"
    ):
        split(_Holds(renames), x, at=["inner.b"])
    # Called whole by one stage, the module and its state are the stage's.
    model = _Holds(_Counted())
    model.inner.count = 3
    stages = split(model, x, at=["head"])
    assert list(stages.state_dict()) == list(model.state_dict())
    assert stages.state_dict()["inner._extra_state"] == {"count": 3}
    fresh = _Holds(_Counted())
    fresh.load_state_dict(stages.state_dict())
    assert fresh.inner.count == 3
    # torch's own classes' state-dict methods are their tensors': a model cut inside a
    # Sequential holding a batch norm splits as before.
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
    split(plain, x, at=["0.1"]).load_state_dict(plain.state_dict())


def test_splits_on_two_threads_at_once_each_capture_their_own_model() -> None:
    # fx patches nn.Module.__call__ for the process while it traces: the other thread's
    # split took those calls, and nearly every split of either failed.
    x, failures = torch.randn(3, 4), []

    def splits() -> None:
        for _ in range(5):
            try:
                split(_Holds(_Chain()), x, at=["inner.b"])
            except Exception as error:  # each one is what the test counts
                failures.append(error)

    threads = [threading.Thread(target=splits) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_a_forward_that_splits_may_be_split() -> None:
    # One split at a time in the process, but a split within a split (a module that
    # splits its child at its first forward, which the outer split runs) went on waiting.
    class SplitsChild(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.done = _Chain(), None

        def forward(self, x: Tensor) -> Tensor:
            if self.done is None:
                self.done = split(self.inner, x.detach(), at=["b"])
            return self.done(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.late = nn.Linear(4, 4), SplitsChild()

        def forward(self, x: Tensor) -> Tensor:
            return self.late(self.pre(x))

    assert len(split(Outer(), torch.randn(2, 4), at=["late"])) == 2


def test_a_split_point_inside_torchs_own_module_says_to_cut_around_it() -> None:
    # It pointed at torch's code and said to move it into a submodule.
    class Encoded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.enc(x))

    with pytest.raises(SplitError, match=r"inside 'enc': .*torch's own forward.*no split point"):
        split(Encoded(), torch.randn(2, 5, 8), at=["enc.layers.1"])
    split(Encoded(), torch.randn(2, 5, 8), at=["head"])  # around it


def test_an_ordered_dict_stays_one_through_the_stages_and_out() -> None:
    # fx wrote it as a dict: the split model and GPipe over it returned a plain dict.
    class Ordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Any:
            held = OrderedDict(h=self.a(x), g=x * 2)  # crosses a cut
            y = self.b(held["h"])
            return OrderedDict(out=self.c(y + held["g"]), mid=y)

    plain, x = Ordered(), torch.randn(6, 4)
    pipe = GPipe(split(copy.deepcopy(plain), x, at=["b", "c"]), [1, 1, 1], chunks=3)
    output, expected = pipe(x), plain(x)
    assert type(output) is OrderedDict
    assert list(output) == ["out", "mid"]

    class Sub(OrderedDict[str, Tensor]):
        pass

    class SubOut(Ordered):
        def forward(self, x: Tensor) -> Any:
            return Sub(super().forward(x))

    assert type(split(SubOut(), x, at=["b"])(x)) is Sub
    (output["out"].sum() + output["mid"].sum()).backward()
    (expected["out"].sum() + expected["mid"].sum()).backward()
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_finfo_of_a_traced_dtype_says_to_name_the_dtype() -> None:
    class Masked(_Chain):
        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            return self.b(h + (h < 0).to(h.dtype) * torch.finfo(h.dtype).min)

    with pytest.raises(SplitError, match=r"torch\.finfo .* name the dtype"):
        split(Masked(), torch.randn(3, 4), at=["b"])


class _Encoder(nn.Sequential):
    """A Sequential with a forward of its own, whose control flow fx cannot capture."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        for layer in self:
            x = layer(x)
            if x.abs().max() > 100:
                break
        return x


def test_a_sequential_with_a_forward_of_its_own_is_called_whole() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = _Encoder(nn.Linear(4, 4), nn.Tanh())
            self.head = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.encoder(x))

    model, x = Model(), torch.randn(3, 4)
    for stages in (split(model, x, at=["head"]), split(model, x, stages=2)):
        torch.testing.assert_close(stages(x), model(x), rtol=0, atol=0)


def test_a_reassigned_buffer_is_named_and_updating_it_in_place_is_advised() -> None:
    class Average(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            self.ema = self.ema * 0.9 + h.detach().mean(0) * 0.1
            return self.b(h)

    with pytest.raises(SplitError, match=r"\(self\.ema .*update it in place, self\.ema\.mul_"):
        split(Average(), torch.randn(3, 4), at=["b"])


class _Convs(nn.Module):
    """VGG's pattern: a convolution, then an in-place ReLU on what it made."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class _Aliased(nn.Module):
    """An in-place module on the only use of a value that shares memory with another."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.act, self.same = nn.ReLU(inplace=True), nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.how == "view":
            v = h[:, :2]  # h's memory, one use each
        elif self.how == "identity":
            v = self.same(h)
        elif self.how == "detach":
            v = h.detach()
        else:
            v = h.data  # fx makes it where it is used: in stage 1
        g = self.b(x)  # stage 1
        r = self.act(v)  # changes h too, in the plain model
        return self.c(g) + h + r.sum(1, keepdim=True)  # h read again in stage 2


class _TupleAlias(nn.Module):
    """A module that returns a tensor and a view of it; the tensor changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(2, 4)
        self.both = _Both()

    def forward(self, x: Tensor) -> Tensor:
        pair = self.both(self.a(x))
        g = self.b(x)  # stage 1
        u = F.relu(pair[0], inplace=True)  # changes the view too, in the plain model
        return self.c(pair[1]) + g + u  # the view read in stage 2


class _Both(nn.Module):
    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, h[:, :2]


def test_split_refuses_an_in_place_change_seen_through_a_tuple() -> None:
    with pytest.raises(SplitError, match=r"changed in place by relu in stage 1"):
        split(_TupleAlias(), torch.randn(6, 4), at=["b", "c"])


@pytest.mark.parametrize("how", ["view", "identity", "detach", "data"])
def test_split_refuses_an_in_place_change_of_another_values_memory(how: str) -> None:
    with pytest.raises(SplitError, match=r"made in stage 0 .*changed in place by act in stage 1"):
        split(_Aliased(how), torch.randn(6, 4), at=["b", "c"])


@dataclass
class _Views:
    h: Tensor
    v: Tensor


class _MakesViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> _Views:
        h = self.linear(x)
        return _Views(h, h[:, :4])


def test_split_refuses_a_change_seen_through_an_alias_made_later_or_in_a_dataclass() -> None:
    class LaterAlias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            h = self.l1(x)
            a = h[:, :6]
            y = self.l2(x)  # stage 1
            b = h[:, 2:]  # made in stage 1, h's last use; overlaps a
            a.mul_(3)  # a's one use
            return y * b.sum(1, keepdim=True)

    class InDataclass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.make, self.l2, self.l3 = _MakesViews(), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            views = self.make(x)
            y = self.l2(x)  # stage 1
            views.v.mul_(3)
            return self.l3(y) + views.h  # h read in stage 2

    with pytest.raises(SplitError, match=r"made in stage 0 .*changed in place by mul_"):
        split(LaterAlias(), torch.randn(4, 8), at=["l2"])
    with pytest.raises(SplitError, match=r"made in stage 0 .*changed in place by mul_"):
        split(InDataclass(), torch.randn(4, 8), at=["l2", "l3"])


def test_an_in_place_change_of_memory_no_other_value_will_read_is_accepted() -> None:
    class Passes(nn.Module):  # a norm turned off as nn.Identity, as timm's blocks do
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm = nn.Linear(4, 4), nn.Identity()
            self.act, self.c = nn.ReLU(inplace=True), nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.c(self.act(self.norm(self.a(x))))

    torch.manual_seed(0)
    plain, x = Passes(), torch.randn(6, 4)
    model = GPipe(split(copy.deepcopy(plain), x, at=["act"]), [1, 1], chunks=2)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    _assert_close(_pipe_grads(model), _grads(plain))


@pytest.mark.parametrize("checkpoint", MODES)
def test_an_in_place_module_on_a_value_nothing_else_reads_may_start_a_stage(
    checkpoint: str,
) -> None:
    torch.manual_seed(0)
    plain, x = _Convs(), torch.randn(4, 2, 4, 4)
    for stages in (split(plain, x, at=["features.1", "features.3"]), split(plain, x, stages=3)):
        model = GPipe(copy.deepcopy(stages), [1] * len(stages), chunks=2, checkpoint=checkpoint)
        model(x).square().sum().backward()
        plain.zero_grad()
        plain(x).square().sum().backward()
        _assert_close(_pipe_grads(model), _grads(plain))


def test_processes_step_a_split_model_whose_stage_starts_in_place() -> None:
    from test_nccl_transport import _play

    torch.manual_seed(0)
    plain = _Convs()
    x, y = torch.randn(8, 2, 4, 4), torch.randn(8, 3)
    build = lambda: split(copy.deepcopy(plain), x, at=["features.1"])  # noqa: E731
    results, rules = _play(2, "1f1b", build, [(x, y)], chunks=4, checkpoint="except_last")
    rules.check()
    for value in results:
        assert not isinstance(value, BaseException), value
    F.mse_loss(plain(x), y).backward()
    grads: dict[str, Tensor] = {}
    for steps, _ in results:
        grads.update({name.partition(".")[2]: grad for name, grad in steps[0][2].items()})
    _assert_close(grads, _grads(plain))


# Every module and tensor of the model is held by a stage, so the keys are all there.


def _loads_both_ways(ours: nn.Module, plain: nn.Module) -> None:
    """``ours`` and ``plain`` load each other's state dicts strictly, to equal values."""
    twin = copy.deepcopy(plain)  # ties kept
    with torch.no_grad():
        for p in twin.parameters():
            p.normal_()
    ours.load_state_dict(twin.state_dict())
    loaded = ours.state_dict()
    assert list(loaded) == list(twin.state_dict())
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    back = copy.deepcopy(plain)
    back.load_state_dict(loaded)
    for key, value in back.state_dict().items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


def _pipe_matches(pipe: nn.Module, plain: nn.Module, x: Tensor) -> None:
    """Same outputs and gradients (every name of a tied weight, and None where unused).

    To float32's tolerance, not bit for bit: the matrix product of a micro-batch may
    round otherwise than the whole batch's (it did on a 16-core host, not on 2 cores).
    """
    torch.testing.assert_close(pipe(x), plain(x))
    pipe(x).square().mean().backward()
    plain(x).square().mean().backward()
    _assert_close(_pipe_grads(pipe), _grads(plain))


@pytest.mark.parametrize("how", ["matmul", "linear"])
def test_a_tied_weight_read_directly_keeps_every_name_of_it(how: str) -> None:
    # fx names head.weight by its first name, emb.weight: the stage that reads it held
    # it under that name only, and the model's head.weight was gone from the keys.
    torch.manual_seed(0)
    plain, ids = ReadsTiedHead(how), torch.randint(0, 11, (4, 5))
    stages = split(copy.deepcopy(plain), ids, at=["mid"])
    assert list(stages.state_dict()) == list(plain.state_dict())
    _loads_both_ways(copy.deepcopy(stages), plain)
    pipe = GPipe(stages, [1, 1], chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    _pipe_matches(pipe, plain, ids)
    _loads_both_ways(pipe, plain)


@pytest.mark.parametrize("unused_first", [False, True])
def test_what_the_forward_never_uses_keeps_its_keys_in_the_models_order(
    unused_first: bool,
) -> None:
    # aux (never called), offset and unused_steps (never read) were held by no stage.
    torch.manual_seed(0)
    plain, x = WithUnused(unused_first), torch.randn(6, 4)
    stages = split(copy.deepcopy(plain), x, at=["b"])
    assert list(stages.state_dict()) == list(plain.state_dict())
    assert type(stages[1].get_submodule("aux")) is nn.Linear  # whole, in the last stage
    _loads_both_ways(copy.deepcopy(stages), plain)
    pipe = GPipe(stages, [1, 1], chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    _pipe_matches(pipe, plain, x)
    assert pipe[1].get_submodule("aux").weight.grad is None  # as the plain model's
    assert plain.aux.weight.grad is None
    _loads_both_ways(pipe, plain)


def test_a_module_whose_tensors_the_forward_reads_is_held_whole() -> None:
    # The stage held a bare Module at proj, with its weight and bias but not its type.
    torch.manual_seed(0)
    plain, x = ReadsProjection(), torch.randn(6, 4)
    stages = split(copy.deepcopy(plain), x, at=["b"])
    assert type(stages[1].get_submodule("proj")) is nn.Linear
    assert list(stages.state_dict()) == list(plain.state_dict())
    _pipe_matches(GPipe(stages, [1, 1], chunks=2), plain, x)


class _WithAux(nn.Module):
    """An auxiliary head the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_an_unused_module_moved_to_meta_is_left_out_of_a_model_with_values() -> None:
    # The last stage held it, with values beside it: GPipe refused the stage as a layer
    # that mixes meta tensors and others. It cannot be placed: left out, keys and all.
    torch.manual_seed(0)
    plain, x = _WithAux(), torch.randn(6, 4)
    model = copy.deepcopy(plain)
    model.aux.to("meta")
    stages = split(model, x, at=["b"])
    assert list(stages.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    pipe = GPipe(stages, [1, 1], chunks=2)
    torch.testing.assert_close(pipe(x), plain(x))


class _Reversal(torch.autograd.Function):
    """Gradient reversal: the identity forward, the negated gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return -grad


class _Reverses(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _Reversal.apply(x)  # type: ignore[no-any-return]


class _Adversarial(nn.Module):
    def __init__(self, whole: bool, keyword: bool = False) -> None:
        super().__init__()
        self.features, self.head, self.whole = nn.Linear(4, 4), nn.Linear(4, 2), whole
        self.reverse, self.keyword = _Reverses(), keyword

    def forward(self, x: Tensor) -> Tensor:
        h = self.features(x)
        if self.whole:
            return self.head(self.reverse(h))
        return self.head(_Reversal.apply(x=h) if self.keyword else _Reversal.apply(h))


@pytest.mark.parametrize("keyword", [False, True])
def test_split_refuses_a_custom_autograd_function_in_captured_code(keyword: bool) -> None:
    # Regression: fx kept what its forward computed (nothing, here) and no backward:
    # the stages' outputs were the model's, their gradients were not, silently.
    before = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(SplitError, match=r"_Reversal\.apply\(\.\.\.\) at .*test_split\.py:\d+"):
        split(_Adversarial(whole=False, keyword=keyword), torch.randn(3, 4), at=["head"])
    assert torch.autograd.Function.__dict__["apply"] is before  # put back


def test_a_custom_autograd_function_in_a_module_split_calls_whole_keeps_its_backward() -> None:
    model = _Adversarial(whole=True)
    stages = split(model, torch.randn(3, 4), at=["head"])
    x = torch.randn(6, 4)
    GPipe(stages, [1, 1], chunks=2)(x).sum().backward()
    grads = [p.grad.clone() for p in model.features.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, model.features.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad)


def test_a_failure_inside_a_function_of_torch_names_the_line_that_called_it() -> None:
    class Packs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.GRU(4, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
            return self.head(self.rnn(packed)[1][0])

    example = (torch.randn(2, 3, 4), torch.tensor([3, 2]))
    with pytest.raises(SplitError, match=r"in pack_padded_sequence .*, called at .*test_split"):
        split(Packs(), example, at=["head"])


@pytest.mark.parametrize(("star", "written"), [("args", r"\*args"), ("kwargs", r"\*\*kwargs")])
def test_split_refuses_a_variadic_forward_naming_it_as_written(star: str, written: str) -> None:
    class Variadic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return self.b(self.a(x))

    if star == "kwargs":  # **kwargs alone
        Variadic.forward = lambda self, x, **kwargs: self.b(self.a(x))  # type: ignore[method-assign]
    with pytest.raises(SplitError, match=rf"forward takes {written}; split needs named"):
        split(Variadic(), torch.randn(6, 4), at=["b"])


class _Counts(nn.Module):
    """A layer that counts its calls in a buffer, and keeps a value on itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.steps.add_(1)
        self.scale = x.detach().abs().mean()
        return self.linear(x)


class _Reads(nn.Module):
    """A counting layer, and a head after it: the forward to fill in reads the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = _Counts(), nn.Linear(4, 4)


def test_a_buffer_a_submodule_called_whole_changes_read_in_another_stage_is_refused() -> None:
    # Regression: no change in place in the graph showed it, and the later stage read its
    # own copy, never counted: a warm-up factor stuck at its first value.
    class Warm(_Reads):
        def forward(self, x: Tensor) -> Tensor:
            h = self.enc(x)
            return self.head(h) * torch.clamp(self.enc.steps / 10, max=1.0)

    with pytest.raises(
        SplitError, match=r"'enc\.steps' is changed by 'enc' in stage 0 .* read in stage\(s\) \[1\]"
    ):
        split(Warm(), torch.randn(3, 4), at=["head"])
    model = Warm()
    with pytest.raises(SplitError):
        split(model, torch.randn(3, 4), at=["head"])
    assert model.enc.steps.item() == 0  # split leaves the counter as it was


def test_a_tensor_a_submodule_keeps_on_itself_read_by_the_forward_is_refused() -> None:
    # Regression: with a buffer changed in the same call, the comparison of the captured
    # forward with the module's own was skipped, and the value fx read at capture (the
    # last call's, a constant) went into every later call, with no gradient.
    class Stored(_Reads):
        def forward(self, x: Tensor) -> Tensor:
            h = self.enc(x)
            return self.head(h) * (self.enc.scale + 0)  # computed as fx traces: a constant

    model = Stored()
    model.eval()
    model(torch.randn(3, 4))  # a call before the split stores a scale
    with pytest.raises(SplitError, match=r"read from a module's attribute .*self\.aux_loss"):
        split(model, torch.randn(3, 4), at=["head"])

    class Read(Stored):
        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.enc(x)) * self.enc.scale  # read in the later stage

    model = Read()
    model.eval()
    model(torch.randn(3, 4))
    with pytest.raises(SplitError, match=r"'enc\.scale' is changed by 'enc' in stage 0 .*\[1\]"):
        split(model, torch.randn(3, 4), at=["head"])


def test_split_leaves_the_module_buffers_as_they_were() -> None:
    class Counting(_Pair):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.calls.add_(1)
            return self.b(self.a(x))

    model = Counting()
    split(model, torch.randn(3, 4), at=["b"])
    assert model.calls.item() == 0


@pytest.mark.parametrize("name", ["graph", "index", "count", "pop_names", "code"])
def test_an_attribute_named_as_a_stages_own_is_refused_by_name(name: str) -> None:
    # Regression: it crashed inside torch (a buffer 'index': cannot assign 'int').
    class Chain(_Pair):
        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x))

    model = Chain()
    model.register_buffer(name, torch.zeros(1))
    with pytest.raises(SplitError, match=rf"attributes \['{name}'\] are named as the stages'"):
        split(model, torch.randn(3, 4), at=["b"])
