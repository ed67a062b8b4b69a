"""verify_skippables and the route of each skip through the partitions."""

import pytest
import torch
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.skip import Namespace, SkipRoute, pop, skippable, stash, verify_skippables
from torchgpipe.skip.layout import skip_layout
from torchgpipe.skip.skippable import GLOBAL_NAMESPACE


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


def test_verify_accepts_matching_skips() -> None:
    ns = Namespace()
    verify_skippables(nn.Sequential(Stash(), Stash().isolate(ns), Pop().isolate(ns), Pop()))
    verify_skippables(nn.Sequential(nn.Linear(2, 2)))  # no skips at all


def test_verify_reports_every_problem_at_once() -> None:
    lonely, orphan = Namespace("lonely"), Namespace("orphan")
    model = nn.Sequential(
        Pop(),  # 0: pops the global 'skip' before layer 1 stashes it
        Stash(),  # 1
        Stash().isolate(lonely),  # 2: never popped
        Pop().isolate(orphan),  # 3: never stashed
        Stash(),  # 4: the global 'skip' stashed a second time
    )
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    message = str(info.value)
    assert "'skip' is stashed by layer 1 (Stash) and layer 4 (Stash)" in message
    assert "'skip' is popped by layer 0 (Pop) before layer 1 (Stash) stashes it" in message
    assert "'skip' in Namespace('lonely') is stashed by layer 2 (Stash) but never popped" in message
    assert "'skip' in Namespace('orphan') is popped by layer 3 (Pop) but never stashed" in message
    assert "isolate(Namespace())" in message


def test_verify_reports_a_skip_popped_twice() -> None:
    with pytest.raises(TypeError, match=r"'skip' is popped by layer 1 \(Pop\) and layer 2 \(Pop\)"):
        verify_skippables(nn.Sequential(Stash(), Pop(), Pop()))


def test_a_module_that_stashes_and_pops_one_name_is_declared_then_refused() -> None:
    # As in torchgpipe 0.0.7: the declaration passes, verify_skippables (and GPipe) refuse.
    @skippable(stash=["skip"], pop=["skip"])
    class Both(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("skip")
            yield stash("skip", x)
            return x + skip

    expected = r"'skip' is both stashed and popped by layer 1 \(Both\)"
    with pytest.raises(TypeError, match=expected):
        verify_skippables(nn.Sequential(nn.Identity(), Both()))
    with pytest.raises(TypeError, match=expected):
        GPipe(nn.Sequential(nn.Identity(), Both()), [1, 1])


def test_verify_reports_one_module_used_twice() -> None:
    # named_children() gives a repeated child once: Sequential(down, up, down) passed,
    # though its one object stashes the same skip twice (isolate cannot tell them apart).
    down, up = Stash(), Pop()
    with pytest.raises(
        TypeError,
        match=r"'skip' is stashed by layer 0 \(Stash\) and layer 2 \(Stash, the same "
        r"object as layer 0; use a new instance\)",
    ):
        verify_skippables(nn.Sequential(down, up, down))
    inner = nn.Sequential(nn.Identity(), up)
    with pytest.raises(TypeError, match=r"popped by layer 1\.1 \(Pop\) and layer 2\.1 \(Pop, the"):
        verify_skippables(nn.Sequential(down, inner, inner))
    ns = Namespace()
    verify_skippables(nn.Sequential(down, up, Stash().isolate(ns), Pop().isolate(ns)))


class _Aliased(nn.Module):
    """Holds its stash under a second name too, and calls it once."""

    def __init__(self) -> None:
        super().__init__()
        self.down = Stash()
        self.first = self.down
        self.inner = nn.Sequential(nn.Identity(), Stash().isolate(Namespace()))
        self.inner_again = self.inner

    def forward(self, x: Tensor) -> Tensor:
        return self.down(x)


def test_a_second_name_of_a_module_is_not_a_second_use() -> None:
    # Counted as two stashes (and refused, saying to use a new instance, which would
    # have untied its weights), where the plain model calls it once.
    model = nn.Sequential(_Aliased(), nn.Identity(), Pop())
    with pytest.raises(TypeError) as info:  # the isolated stash is never popped
        verify_skippables(model)
    assert "stashed by layer 0.inner.1 (Stash) but never popped" in str(info.value)
    assert "inner_again" not in str(info.value)  # found once, not twice
    model[0].inner = model[0].inner_again = nn.Identity()
    verify_skippables(model)
    x = torch.randn(4, 2)
    torch.testing.assert_close(GPipe(model, [1, 1, 1], chunks=2)(x), model(x))
    # Held by two modules, it may be called by both: still refused.
    shared = Stash()
    twice = nn.Sequential(_Calls(shared), _Calls(shared), Pop())
    with pytest.raises(TypeError, match=r"the same object as layer 0\.inner; use a new instance"):
        verify_skippables(twice)


class _Calls(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


def test_verify_finds_skippables_inside_layers() -> None:
    inner = nn.Sequential(nn.Identity(), Stash())
    with pytest.raises(TypeError, match=r"stashed by layer 0\.1 \(Stash\) but never popped"):
        verify_skippables(nn.Sequential(inner, nn.Identity()))
    verify_skippables(nn.Sequential(inner, Pop()))


def test_verify_takes_a_sequential() -> None:
    with pytest.raises(TypeError, match=r"takes an nn\.Sequential, got Stash"):
        verify_skippables(Stash())  # type: ignore[arg-type]


def test_gpipe_verifies_before_any_work() -> None:
    with pytest.raises(TypeError, match="never popped"):
        GPipe(nn.Sequential(Stash(), nn.Identity()), [1, 1])


def test_layout_says_which_partition_stashes_and_pops() -> None:
    ns = Namespace("inner")
    model = nn.Sequential(Stash(), Stash().isolate(ns), nn.Identity(), Pop().isolate(ns), Pop())
    layout = skip_layout(model, [2, 1, 2])
    assert layout.routes == (
        SkipRoute(GLOBAL_NAMESPACE, "skip", 0, 2),
        SkipRoute(ns, "skip", 0, 2),
    )
    assert [r.key for r in layout.inbound(2)] == [r.key for r in layout.routes]
    assert layout.outbound(0) == tuple(r.key for r in layout.routes)
    assert layout.inbound(1) == ()
    assert layout.outbound(1) == ()

    within = skip_layout(model, [5])
    assert not any(r.crosses for r in within.routes)
    assert within.inbound(0) == ()
    assert within.outbound(0) == ()


def test_gpipe_exposes_the_layout_as_a_table() -> None:
    ns = Namespace("inner")
    model = nn.Sequential(Stash(), Stash().isolate(ns), nn.Identity(), Pop().isolate(ns), Pop())
    pipe = GPipe(model, [1, 2, 2])
    assert pipe.skip_layout.routes == (
        SkipRoute(GLOBAL_NAMESPACE, "skip", 0, 2),
        SkipRoute(ns, "skip", 1, 2),
    )
    lines = str(pipe.skip_layout).splitlines()
    assert lines[0].split() == ["skip", "stashed", "by", "popped", "by"]
    assert lines[1].split() == ["'skip'", "0", "2"]
    assert lines[2].split() == ["'skip'", "in", "Namespace('inner')", "1", "2"]
    assert str(GPipe(nn.Sequential(nn.Identity()), [1]).skip_layout) == "no skips"
    pipe(torch.ones(2, 2))  # and it runs


class Calls(nn.Module):
    """Calls its children in an order verify_skippables cannot know."""

    def __init__(self, *children: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(children)

    def forward(self, x: Tensor) -> Tensor:
        for part in reversed(self.parts):
            x = part(x)
        return x


def test_verify_checks_the_order_inside_nested_sequentials() -> None:
    nested = nn.Sequential(nn.Sequential(nn.Identity(), Pop()), nn.Sequential(Stash()))
    with pytest.raises(TypeError, match=r"popped by layer 0\.0\.1 \(Pop\) before layer 0\.1\.0"):
        verify_skippables(nn.Sequential(nested))
    # Inside another kind of container the calling order is unknown: not reported.
    verify_skippables(nn.Sequential(Calls(Pop(), Stash())))
