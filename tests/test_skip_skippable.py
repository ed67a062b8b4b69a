"""@skippable, stash, pop, Namespace: on their own and in a plain nn.Sequential."""

import copy
import copyreg
import functools
import importlib
import io
import pickle
import uuid
import weakref
from typing import Any

import pytest
import torch
from helpers import PopAddFailingOnce
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.skip import Namespace, SkipError, pop, skippable, stash
from torchgpipe.skip.skippable import GLOBAL_NAMESPACE, SkipKey, Skippable
from torchgpipe.skip.tracker import current_tracker


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


def test_skippable_keeps_the_class_name_and_is_a_module() -> None:
    layer = Stash()
    assert type(layer).__name__ == "Stash"
    assert isinstance(layer, Skippable)
    assert isinstance(layer, nn.Module)
    assert layer.stash_names == ("skip",)
    assert Pop.pop_names == ("skip",)


def test_skippables_work_in_a_plain_sequential() -> None:
    model = nn.Sequential(Stash(), nn.Linear(3, 3), Pop())
    x = torch.randn(4, 3)
    expected = model[1](x * 2) + x
    torch.testing.assert_close(model(x), expected)


def test_skippable_has_the_0_0_7_name_sets() -> None:
    # torchgpipe 0.0.7 spelled the declared names stashable_names and poppable_names.
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("a", x)
            yield stash("b", x)
            return x

    assert Two.stashable_names == frozenset({"a", "b"})
    assert Two().stashable_names == frozenset({"a", "b"})
    assert Two().poppable_names == frozenset()
    assert Pop().poppable_names == frozenset({"skip"})
    assert Pop.stashable_names == frozenset()
    assert isinstance(Stash().stashable_names, frozenset)


def test_verify_skippables_imports_from_where_0_0_7_had_it() -> None:
    from torchgpipe.skip import skippable as module
    from torchgpipe.skip.layout import verify_skippables
    from torchgpipe.skip.skippable import verify_skippables as old_path

    assert old_path is verify_skippables
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        module.nothing  # noqa: B018


def test_namespace_imports_from_where_0_0_7_had_it() -> None:
    from torchgpipe.skip.namespace import Namespace as old_path

    assert old_path is Namespace


def test_a_namespace_pickled_by_0_0_7_loads() -> None:
    # 0.0.7's Namespace held its uuid in a slot, ``id``, and pickled by default: a new
    # object of the class, then its slots' state.
    class Old(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, uuid.UUID) or obj is not marker:
                return NotImplemented
            return copyreg.__newobj__, (Namespace,), (None, {"id": ident})  # type: ignore[attr-defined]

    marker, ident = Namespace.__new__(Namespace), uuid.uuid4()
    buffer = io.BytesIO()
    Old(buffer, protocol=2).dump([marker, marker])
    first, second = pickle.loads(buffer.getvalue())
    assert first == second
    assert first is second
    assert hash(first) == hash(second)
    assert "Namespace" in repr(first)
    assert first != Namespace()


@pytest.mark.parametrize("which", ["global", "own"])
def test_a_namespace_pickled_where_it_was_defined_before_still_loads(which: str) -> None:
    # Namespaces were defined in skippable.py, where older pickles look for them (a
    # model saved whole with torch.save).
    ns = GLOBAL_NAMESPACE if which == "global" else Namespace("x")
    new = pickle.dumps(ns)
    assert b"torchgpipe.skip.namespace" in new
    old = new.replace(b"torchgpipe.skip.namespace", b"torchgpipe.skip.skippable")  # one length
    loaded = pickle.loads(old)
    assert loaded == ns
    assert (loaded is GLOBAL_NAMESPACE) == (which == "global")


def test_the_0_0_7_name_sets_are_read_only() -> None:
    layer = Stash()
    with pytest.raises(AttributeError, match=r"stashable_names is read-only.*@skippable"):
        layer.stashable_names = frozenset({"other"})  # type: ignore[assignment]  # refused: the point
    with pytest.raises(AttributeError, match="poppable_names is read-only"):
        layer.poppable_names = frozenset()  # type: ignore[assignment]  # refused: the point
    assert layer.stashable_names == frozenset({"skip"})


def test_the_0_0_7_name_sets_follow_a_new_declaration() -> None:
    @skippable(pop=["other"])
    class Redeclared(Stash):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield pop("other")
            return x

    assert Redeclared.stashable_names == frozenset()
    assert Redeclared().poppable_names == frozenset({"other"})


def test_namespaces_keep_two_uses_of_a_class_apart() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2), Pop().isolate(ns1)
    )
    x = torch.ones(2, 2)
    # x -> stash x, 2x -> stash 2x, 4x -> 4x + 2x -> 6x + x
    torch.testing.assert_close(model(x), 7 * x)


def test_isolate_only_some_names() -> None:
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("a", x)
            yield stash("b", x)
            return x

    ns = Namespace("mine")
    layer = Two().isolate(ns, only=["a"])
    assert layer.stash_keys() == (SkipKey(ns, "a"), SkipKey(GLOBAL_NAMESPACE, "b"))
    with pytest.raises(ValueError, match=r"Two has no skip named \['c'\]"):
        layer.isolate(ns, only=["c"])
    with pytest.raises(TypeError, match="isolate\\(\\) takes a Namespace"):
        layer.isolate("ns")  # type: ignore[arg-type]


def test_isolate_only_one_name_as_a_string() -> None:
    # A string was taken for its letters before the fix: "no skip named ['a', 'l', ...]".
    @skippable(stash=["alice", "bob"])
    class Two(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("alice", x)
            yield stash("bob", x)
            return x

    ns = Namespace("mine")
    layer = Two().isolate(ns, only="alice")
    assert layer.stash_keys() == (SkipKey(ns, "alice"), SkipKey(GLOBAL_NAMESPACE, "bob"))
    with pytest.raises(ValueError, match=r"Two has no skip named \['carol'\]"):
        layer.isolate(ns, only="carol")
    for bad in (3, [b"bob"], ["bob", None]):
        with pytest.raises(TypeError, match=r"only takes a skip name or an iterable of names"):
            layer.isolate(ns, only=bad)  # type: ignore[arg-type]

    def names():  # type: ignore[no-untyped-def]
        yield "bob"
        raise TypeError("a bug of the caller's")

    with pytest.raises(TypeError, match="a bug of the caller's"):  # not taken for a bad type
        layer.isolate(ns, only=names())


def test_none_is_a_skip_value() -> None:
    @skippable(stash=["maybe"])
    class StashNone(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("maybe", None)
            return x

    @skippable(pop=["maybe"])
    class PopNone(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            value = yield pop("maybe")
            assert value is None
            return x

    x = torch.ones(1)
    assert nn.Sequential(StashNone(), PopNone())(x) is x


def test_namespaces_compare_by_identity() -> None:
    assert Namespace() != Namespace()


def test_a_copy_of_a_namespace_equals_it() -> None:
    ns = Namespace("level")
    for twin in (copy.deepcopy(ns), copy.copy(ns), pickle.loads(pickle.dumps(ns))):
        assert twin == ns
        assert hash(twin) == hash(ns)
        assert SkipKey(twin, "x") == SkipKey(ns, "x")
    assert copy.deepcopy(GLOBAL_NAMESPACE) is GLOBAL_NAMESPACE


def test_layers_isolated_together_and_copied_one_by_one_still_match() -> None:
    ns = Namespace()
    layers = [copy.deepcopy(layer) for layer in (Stash().isolate(ns), Pop().isolate(ns))]
    torch.testing.assert_close(nn.Sequential(*layers)(torch.ones(1)), torch.tensor([3.0]))
    ns = Namespace("level 1")
    assert SkipKey(ns, "x") == SkipKey(ns, "x")
    assert "level 1" in str(SkipKey(ns, "x"))
    assert str(SkipKey(GLOBAL_NAMESPACE, "x")) == "'x'"


def test_a_forward_that_returns_its_output_directly_is_accepted() -> None:
    # As in torchgpipe 0.0.7: a forward that yields nothing may return its output.
    @skippable()
    class Plain(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * 2

    x = torch.ones(1)
    torch.testing.assert_close(Plain()(x), x * 2)
    model = nn.Sequential(Stash(), Plain(), Pop())
    torch.testing.assert_close(model(x), x * 4 + x)


def test_a_forward_that_returns_directly_must_not_declare_names() -> None:
    class Plain(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    layer = skippable(stash=["skip"], pop=["other"])(Plain)()
    match = (
        r"Plain.forward returned its output directly \(not a generator\), without "
        r"yielding stash\('skip'\), pop\('other'\)"
    )
    with pytest.raises(SkipError, match=match):
        layer(torch.ones(1))
    with pytest.raises(RuntimeError, match=match):  # what torchgpipe 0.0.7 raised
        layer(torch.ones(1))


def test_a_forward_wrapped_by_a_decorator_is_driven() -> None:
    # torchgpipe 0.0.7 users decorate forward (for logging, say) with functools.wraps.
    def logged(forward):  # type: ignore[no-untyped-def]
        @functools.wraps(forward)
        def wrapper(self, *args):  # type: ignore[no-untyped-def]
            return forward(self, *args)

        return wrapper

    @skippable(stash=["skip"])
    class Logged(nn.Module):
        @logged
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x * 2)
            return x

    ns = Namespace()
    model = nn.Sequential(Logged().isolate(ns), Pop().isolate(ns))
    torch.testing.assert_close(model(torch.ones(1)), torch.tensor([3.0]))


def test_a_forward_that_returns_a_helpers_generator_is_driven() -> None:
    @skippable(pop=["skip"])
    class Helped(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            return self._add(x)

        def _add(self, x: Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("skip")
            return x + skip

    ns = Namespace()
    model = nn.Sequential(Stash().isolate(ns), Helped().isolate(ns))
    assert torch.equal(model(torch.ones(1)), torch.tensor([3.0]))  # 2 from Stash, 1 popped


def test_a_skippable_module_prints_as_in_torchgpipe_0_0_7() -> None:
    @skippable(stash=["hello"])
    class Hello(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("hello", x)
            return self.conv(x)

    expected = "@skippable(Hello(\n  (conv): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))\n))"
    assert repr(Hello()) == expected


def test_skippable_decorates_module_classes_only() -> None:
    with pytest.raises(TypeError, match=r"decorates an nn\.Module class"):
        skippable(stash=["skip"])(int)  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stash": "skip"}, TypeError, "takes a list of names, got the string 'skip'"),
        ({"stash": ["a", "a"]}, ValueError, r"lists \['a'\] more than once"),
        ({"pop": [1]}, TypeError, r"skip names are strings, got \[1\]"),
        ({"stash": None}, TypeError, r"takes a list of names, such as stash=\['skip'\], got None"),
        ({"pop": 5}, TypeError, r"@skippable\(pop=\.\.\.\) takes a list of names"),
    ],
)
def test_bad_declarations_rejected(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        skippable(**kwargs)  # type: ignore[arg-type]


def test_names_by_position_as_in_0_0_7_and_no_parentheses_refused() -> None:
    class Block(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            return x

    assert skippable(["skip"])(Block).stash_names == ("skip",)
    assert skippable((), ["skip"])(Block).pop_names == ("skip",)
    with pytest.raises(TypeError, match=r"call it with its parentheses: @skippable\(stash="):
        skippable(Block)  # type: ignore[arg-type]  # @skippable, bare


def test_popping_an_undeclared_name_names_the_skip_and_layer() -> None:
    @skippable(pop=["skip"])
    class PopOther(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield pop("other")
            return x

    with pytest.raises(
        ValueError, match=r"PopOther.forward yielded pop\('other'\).*pop=\['skip'\]"
    ):
        nn.Sequential(Stash(), PopOther())(torch.ones(1))


def test_yielding_something_else_names_the_layer() -> None:
    @skippable(stash=["skip"])
    class YieldsTensor(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield x
            return x

    with pytest.raises(TypeError, match=r"YieldsTensor.forward yielded tensor.*only stash"):
        YieldsTensor()(torch.ones(1))


def test_stashing_a_non_tensor_names_the_skip_and_layer() -> None:
    @skippable(stash=["skip"])
    class StashList(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", [x])
            return x

    with pytest.raises(TypeError, match=r"StashList.forward stashed list as skip 'skip'"):
        StashList()(torch.ones(1))


def test_each_declared_skip_is_used_once_per_call() -> None:
    @skippable(stash=["skip"])
    class Twice(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            yield stash("skip", x)
            return x

    @skippable(stash=["skip"])
    class Never(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            if False:
                yield
            return x

    with pytest.raises(ValueError, match=r"yielded stash\('skip'\) twice"):
        Twice()(torch.ones(1))
    with pytest.raises(
        ValueError, match=r"Never.forward returned without yielding stash\('skip'\)"
    ):
        Never()(torch.ones(1))


@skippable()
class StashUndeclared(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return x


@skippable()
class PopUndeclared(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield pop("skip")
        return x


@skippable(stash=["skip"])
class NeverStashes(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        if False:
            yield
        return x


@skippable(pop=["skip"])
class NeverPops(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        if False:
            yield
        return x


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([StashUndeclared()], r"yielded stash\('skip'\) but .* declares stash=\[\]; add 'skip'"),
        ([Stash(), PopUndeclared()], r"yielded pop\('skip'\) but .* declares pop=\[\]; add"),
        ([NeverStashes()], r"NeverStashes.forward returned without yielding stash\('skip'\)"),
        ([Stash(), NeverPops()], r"NeverPops.forward returned without yielding pop\('skip'\)"),
        ([Pop().isolate(Namespace("fresh"))], r"popped before any layer stashed it"),
    ],
)
def test_skip_misuse_is_a_skip_error(layers: list[nn.Module], match: str) -> None:
    # torchgpipe 0.0.7 raised RuntimeError, we raised ValueError: SkipError is both.
    for error in (SkipError, RuntimeError, ValueError):
        with pytest.raises(error, match=match):
            nn.Sequential(*layers)(torch.ones(1))
    current_tracker().waiting.clear()  # the stash a failed pop left, for later tests


def test_skip_error_is_both_value_error_and_runtime_error() -> None:
    assert issubclass(SkipError, ValueError)
    assert issubclass(SkipError, RuntimeError)
    assert SkipError.__doc__


def test_pop_before_stash_at_run_time() -> None:
    with pytest.raises(
        ValueError,
        match=r"skip 'skip' in Namespace\('fresh'\) was popped before any layer stashed it",
    ):
        Pop().isolate(Namespace("fresh"))(torch.ones(1))


def test_exceptions_from_the_generator_propagate() -> None:
    @skippable(stash=["skip"])
    class Raises(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            raise ArithmeticError("inside")

    with pytest.raises(ArithmeticError, match="inside"):
        Raises()(torch.ones(1))


def test_a_subclass_may_override_the_generator_and_keeps_the_names() -> None:
    class Triple(Stash):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x * 3)
            return x

    layer = Triple()
    assert layer.stash_names == ("skip",)
    torch.testing.assert_close(nn.Sequential(layer, Pop())(torch.ones(1)), torch.tensor([4.0]))


def test_a_subclass_may_be_decorated_again_with_other_names() -> None:
    @skippable(stash=["other"])
    class Other(Stash):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("other", x)
            return x

    assert Other.stash_names == ("other",)
    assert isinstance(Other(), Stash)
    Other()(torch.ones(1))
    # Stashed under the new name (and taken out here, so that no later test sees it).
    assert current_tracker().waiting.pop(Other().skip_key("other")) is not None


def test_a_subclass_that_returns_directly_still_owes_its_stash() -> None:
    class Plain(Stash):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            return x

    with pytest.raises(SkipError, match=r"Plain.forward returned its output directly"):
        Plain()(torch.ones(1))


def test_a_subclass_may_call_its_bases_forward() -> None:
    # The bug: super().forward(x) ran the subclass's own forward again, without end.
    class Doubled(Stash):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            return super().forward(x) * 2  # the base stashes; its output comes back

    class Again(Doubled):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            return super().forward(x) + 1

    x = torch.tensor([1.0, 2.0])
    # Stash returns 2 x and stashes x.
    torch.testing.assert_close(nn.Sequential(Doubled(), Pop())(x), x * 4 + x)
    torch.testing.assert_close(nn.Sequential(Again(), Pop())(x), x * 4 + 1 + x)
    from torchgpipe import GPipe

    for checkpoint in ["always", "never"]:
        model = GPipe(nn.Sequential(Again(), Pop()), [1, 1], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
        torch.testing.assert_close(model(x.view(2, 1)), (x * 5 + 1).view(2, 1))


def test_a_subclass_may_call_its_bases_forward_again_after_it_failed() -> None:
    # The failed call gave back its stash, and its names, from the record it shares.
    @skippable(stash=["skip"])
    class Fragile(nn.Module):
        def forward(self, x: Tensor, fail: bool = False):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            if fail:
                raise RuntimeError("after the stash")
            return x * 2

    class Retries(Fragile):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            try:
                return super().forward(x, fail=True)
            except RuntimeError:
                return super().forward(x)

    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(nn.Sequential(Retries(), Pop())(x), x * 2 + x)


def test_a_subclass_may_retry_its_bases_forward_that_failed_after_a_pop() -> None:
    # The failed call gave its pop back, for the retry to pop again.
    class Retries(PopAddFailingOnce):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            try:
                return super().forward(x, fail=True)
            except RuntimeError:
                return super().forward(x)

    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(nn.Sequential(Stash(), Retries())(x), x * 2 + x)


def test_a_subclass_failing_around_its_bases_forward_leaves_nothing_waiting() -> None:
    class GivesUp(PopAddFailingOnce):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            return super().forward(x, fail=True)  # its pop given back, then taken back

    class FailsAfter(Stash):
        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            super().forward(x)  # stashed, then taken back
            raise ArithmeticError("after the base")

    ns = Namespace("gives up")
    with pytest.raises(RuntimeError, match="after the pop"):
        nn.Sequential(Stash().isolate(ns), GivesUp().isolate(ns))(torch.ones(1))
    with pytest.raises(ArithmeticError, match="after the base"):
        FailsAfter().isolate(ns)(torch.ones(1))
    assert not [key for key in current_tracker().waiting if key.namespace is ns]


def test_a_subclass_yielding_from_its_bases_forward_is_told_to_call_it() -> None:
    class YieldsFrom(Stash):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            y = yield from super().forward(x)
            return y

    with pytest.raises(TypeError, match=r"super\(\).forward\(x\) returns its output: call it"):
        YieldsFrom()(torch.ones(2))


def test_a_failing_layer_takes_back_its_stash() -> None:
    @skippable(stash=["skip"])
    class Flaky(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x)
            raise ArithmeticError("after the stash")

    ns = Namespace("flaky")
    with pytest.raises(ArithmeticError):
        nn.Sequential(Flaky().isolate(ns), Pop().isolate(ns))(torch.ones(1))
    # Nothing stale is left for a later pop to find.
    with pytest.raises(ValueError, match="popped before any layer stashed it"):
        Pop().isolate(ns)(torch.ones(1))


class Block(nn.Module):
    """A user's layer with a generator forward, made skippable by a call below."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return self.linear(x)


StashBlock = skippable(stash=["skip"])(Block)  # a call, not a decorator: Block stays


def test_a_skippable_made_by_a_call_pickles(monkeypatch: pytest.MonkeyPatch) -> None:
    # The class made takes Block's name, where the module holds Block itself: pickle
    # refused it ("it's not the same object as ...Block"), and so did torch.save.
    ns = Namespace("saved")
    model = nn.Sequential(StashBlock().isolate(ns), Pop().isolate(ns), Stash(), Pop())
    x = torch.randn(3, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    again = skippable(stash=["skip"])(Block)  # the same decoration, another class
    for load in (
        lambda: torch.load(io.BytesIO(buffer.getvalue()), weights_only=False),
        lambda: pickle.loads(pickle.dumps(model)),
        lambda: copy.deepcopy(model),
    ):
        loaded = load()
        assert type(loaded[0]) is StashBlock  # the class of this process, found again
        assert type(loaded[0]) is not again
        assert type(loaded[2]) is Stash  # decorated classes pickle by name, as before
        torch.testing.assert_close(loaded(x), model(x))
    # A process that never made StashBlock makes it again from Block and the names.
    # Imported by name: torchgpipe.skip.skippable, as an attribute, is the decorator.
    module = importlib.import_module("torchgpipe.skip.skippable")
    monkeypatch.setattr(module, "_MADE", weakref.WeakValueDictionary())
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded[0]) is not StashBlock
    assert isinstance(loaded[0], Block)
    assert loaded[0].stash_names == ("skip",)
    assert loaded[0].skip_key("skip") == SkipKey(ns, "skip")
    torch.testing.assert_close(loaded(x), model(x))


def test_namespaces_are_ordered_and_none_is_the_default_one_as_in_0_0_7() -> None:
    ns1, ns2 = Namespace(), Namespace()
    assert sorted([ns2, ns1]) == sorted([ns1, ns2])
    assert (ns1 < ns2) != (ns2 < ns1)
    assert copy.deepcopy(ns1) <= ns1
    assert isinstance(None, Namespace)
    assert ns1 != None  # noqa: E711  # None is a namespace, the default one, not this one

    # isolate(None) puts the names back into the default namespace.
    model = GPipe(nn.Sequential(Stash().isolate(ns1).isolate(None), Pop()), [1, 1])
    x = torch.randn(2, 3)
    torch.testing.assert_close(model(x), 3 * x)
